"""Which offload groups leave the device after the warm-up step (megalite/model/offload_plan.py,
Megatron's PipelineOffloadManager policy): the last group of each name, --activation-offload-fraction,
--delta-offload-bytes-across-pp-ranks, --fine-grained-offloading-max-inflight-offloads; the
losses and gradients stay bit for bit those without offloading.

The model (test_recompute_modules' config): a dense layer (attn_norm, qkv_linear, core_attn,
attn_proj, mlp_norm: 5 groups) then an MoE layer (the same 5, then expert_fc1, moe_act): 12 groups
a micro-batch, 7 names. Two steps of two micro-batches (F0 B0 F1 B1), every name offloaded."""

import pytest
import torch

from megalite.model.gpt import GPTModel
from megalite.model.offload import OFFLOAD_MODULES, end_offload_step
from megalite.model.offload_plan import OffloadPlan
from megalite.parallel.pipeline.actions import F
from megalite.parallel.pipeline.schedules import schedule_actions
from megalite.parallel.state import ParallelState
from tests.model.test_activation_offload import offloading
from tests.model.test_recompute_modules import BATCH, SEQ, config

DENSE = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
GROUPS = DENSE + DENSE + ("expert_fc1", "moe_act")  # one micro-batch's, in forward order


def two_steps(cfg, pp_rank=None):
    """Per step: the loss of each micro-batch, the summed gradients, the groups offloaded per name,
    the joins per name."""
    model = GPTModel(cfg, ParallelState.single(), init_seed=7).train()
    if pp_rank is not None:  # as pipeline rank pp_rank would plan
        p = model.offloader.plan
        model.offloader.plan = OffloadPlan(p.fraction, p.delta_bytes, pp_rank, p.max_inflight)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 64, (BATCH, SEQ), generator=g) for _ in range(2)]
    steps = []
    for _ in range(2):
        before = dict(model.offloader.offloaded_groups)
        model.zero_grad()
        losses = []
        for tokens in batches:
            loss = model(tokens, labels=tokens.roll(-1, 1)).mean()
            loss.backward()
            losses.append(loss.detach())
        groups = {n: c - before.get(n, 0) for n, c in model.offloader.offloaded_groups.items() if c > before.get(n, 0)}
        steps.append((losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, groups,
                      dict(model.offloader.plan.joins)))
        model.offloader.plan.joins.clear()
        end_offload_step([model])
    return steps


def counts(*names):
    out = {}
    for name in names:
        out[name] = out.get(name, 0) + 1
    return out


@pytest.fixture(scope="module")
def reference():
    return two_steps(config(None))


def tuned(**fields):
    return offloading(config(None), OFFLOAD_MODULES).replace(**fields)


# step 2's offloaded groups, two micro-batches. Micro-batch 0's backward runs first: its last group of
# each of the 7 names stays (the margin); micro-batch 1's backward comes next when it runs its
# forward (no pipelining), so its last groups stay too: the dense layer's 5 groups offload in each.
# Fraction 0.5: micro-batch 0 keeps int(5 x 0.5) = 2 of its 5 eligible (the last), micro-batch 1
# int(12 x 0.5) = 6 of its 12 (the MoE layer's last 6; its attn_norm then stays as the last of its
# name). Fraction 0: none. Delta 1 byte on pipeline rank 1: the first group (micro-batch 0's attn_norm).
CASES = {
    "default": (dict(), None, counts(*DENSE, *DENSE)),
    "fraction 0.5": (dict(activation_offload_fraction=0.5), None, counts(*DENSE[:3], *DENSE)),
    "fraction 0": (dict(activation_offload_fraction=0.0), None, {}),
    "delta on rank 1": (dict(delta_offload_bytes_across_pp_ranks=1), 1, counts(*DENSE[1:], *DENSE)),
    "delta on rank 0": (dict(delta_offload_bytes_across_pp_ranks=1), 0, counts(*DENSE, *DENSE)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_groups_offloaded_after_the_warm_up_step(reference, case):
    fields, pp_rank, want = CASES[case]
    steps = two_steps(tuned(**fields), pp_rank)
    assert steps[0][2] == counts(*GROUPS, *GROUPS)  # the warm-up step offloads every group
    assert steps[1][2] == want
    for (losses, grads, *_), (want_losses, want_grads, *_) in zip(steps, reference):
        assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
        assert grads.keys() == want_grads.keys()
        assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads), case


@pytest.mark.parametrize("cap, want", [
    (None, {}),
    # each offload joined at once: 24 in the warm-up step, 10 after (the default case's groups)
    (0, (counts(*GROUPS, *GROUPS), counts(*DENSE, *DENSE))),
    # names with two groups a micro-batch join the older one; expert_fc1 and moe_act have one each
    (1, (counts(*DENSE, *DENSE), {})),
])
def test_max_inflight_offloads_joins(cap, want):
    steps = two_steps(tuned(offload_max_inflight=cap))
    assert (steps[0][3], steps[1][3]) == (want or ({}, {}))


def plan_on_schedule(schedule, pp_size, rank, microbatches, names, chunks=1):
    """An OffloadPlan run through a rank's schedule actions for two steps: per forward (this
    rank's order), the groups offloaded in the second step."""
    plan = OffloadPlan(pp_rank=rank)
    actions = [a for a in schedule_actions(schedule, pp_size, rank, microbatches, chunks) if not a.is_comm]
    offloaded = []
    for _ in range(2):
        records, offloaded = {}, []
        for action in actions:
            key = (action.chunk, action.microbatch)
            if action.kind != F:
                plan.backward_started(records[key])
                continue
            records[key] = plan.start_chunk()
            offloaded.append([])
            for name in names:
                record, offload = plan.start_group(records[key], name)
                record.bytes += 8 if plan.warmup else 0
                if offload:
                    offloaded[-1].append(name)
        plan.end_step()
    return offloaded


NAMES = ("core_attn", "attn_proj", "core_attn", "attn_proj")
FIRST = ["core_attn", "attn_proj"]  # a chunk keeping its last group of each name


def test_pipeline_first_stage_keeps_only_the_first_micro_batchs_last_groups():
    """1F1B at p = 2, 3 micro-batches: on rank 0 micro-batch k's forward runs before micro-batch
    k-1's backward, so only micro-batch 0 (whose backward runs first) keeps its last groups; on the
    last rank each micro-batch's backward follows its forward, so every one keeps them."""
    assert plan_on_schedule("1f1b", 2, 0, 3, NAMES) == [FIRST, list(NAMES), list(NAMES)]
    assert plan_on_schedule("1f1b", 2, 1, 3, NAMES) == [FIRST] * 3


def test_interleaved_keeps_the_last_groups_where_the_backward_comes_next():
    """Interleaved 1F1B, p = 2, two virtual stages, 4 micro-batches (forwards (mb, chunk): (0,0)
    (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1); backwards start with chunk 1's (0,1) (1,1), then (0,0)
    (1,0), ...). Rank 0: only (0,1), whose backward runs first, keeps its last groups (its four
    warm-up forwards run before any backward; later forwards run ahead of the backwards before them).
    Rank 1 (the model's last stage on chunk 1): each chunk-1 forward's backward follows it at once."""
    everything = list(NAMES)
    assert plan_on_schedule("interleaved_1f1b", 2, 0, 4, NAMES, chunks=2) == [
        everything, everything, FIRST, everything, everything, everything, everything, everything]
    assert plan_on_schedule("interleaved_1f1b", 2, 1, 4, NAMES, chunks=2) == [
        everything, everything, FIRST, FIRST, everything, everything, FIRST, FIRST]


def test_the_training_loop_ends_the_warm_up_step(monkeypatch):
    """From the command line through the training loop (one CPU process, 2 layers, 2 micro-batches
    a step, core_attn and attn_proj offloaded at --activation-offload-fraction 0.5): the warm-up step
    offloads all 8 groups; the next, micro-batch 0 keeps the second layer's two (the margin) and
    int(2 x 0.5) = 1 of the first layer's, micro-batch 1 int(4 x 0.5) = 2, the second layer's."""
    from megalite.config.arguments import parse_args
    from megalite.parallel.state import ParallelState
    from megalite.training import setup_run
    from megalite.training.loop import Trainer
    from tests.training.launch import BASE, drop_flags

    monkeypatch.setattr(setup_run, "init_distributed", lambda parallel: (ParallelState.single(), torch.device("cpu")))
    extra = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48", "--seq-length", "16",
             "--global-batch-size", "4", "--train-iters", "2", "--lr-warmup-iters", "0", "--eval-iters", "0",
             "--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj",
             "--min-offloaded-tensor-size", "0", "--activation-offload-fraction", "0.5"]
    run = setup_run.build_run(parse_args(drop_flags(BASE, *extra) + extra))
    trainer = Trainer(run)
    iterator = setup_run.data_iterator(run, trainer.train_ds, 0)
    offloader = run.models[0].offloader
    trainer.train_step(iterator)
    assert offloader.offloaded_groups == {"core_attn": 4, "attn_proj": 4} and not offloader.plan.warmup
    trainer.train_step(iterator)
    assert offloader.offloaded_groups == {"core_attn": 4 + 2, "attn_proj": 4 + 1}
    trainer.close()
