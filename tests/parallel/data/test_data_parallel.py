"""Data parallelism against the single-process reference.

With the global batch fixed (16 sequences), training 3 Adam steps at DP = 2 and 4 (gloo, CPU)
gives the same parameters as plain PyTorch at DP = 1 within 1e-6 relative (fp32, dropout off):
with overlap_grad_reduce on and off, gradient accumulation 1 and 4, the distributed optimizer
on and off (with overlapped parameter gather and CPU offload), FSDP2, and combined with TP = 2
(with and without sequence parallelism). Every DP replica ends bitwise identical.

The measure, for every parameter tensor after the 3 steps: max|ours - reference| /
max|reference| (tests.numerics.rel_error), at most 1e-6 for every tensor, biases and norms
included. The models start from GPTModel's initialisation with every 1-D parameter (biases,
norm weights) moved by N(0, 0.02²) noise (make_model), so no tensor is measured against the
three updates it received alone (zero-initialised biases end at ~3·lr).

Each micro-batch's loss is its masked mean and the step's loss the mean over micro-batches, so
the DP = 1 reference with the same micro-batch size is the same function; only the order of
floating-point sums differs (over ranks, over TP halves of the sequence). Adam's eps is 1e-3
(lr / eps = 1), not the usual 1e-8: Adam's first update is lr·g/(|g| + eps), whose slope at
g ≈ 0 is lr/eps, so with eps = 1e-8 last-bit differences in near-zero gradients become
differences of up to lr. The key part of GPT-2's QKV bias is the extreme case: its gradient is
exactly zero in exact arithmetic (softmax ignores a shift common to all keys) and about 1e-11
in fp32, pure rounding noise that Adam with eps = 1e-8 turns into steps of ~lr/300 that differ
between any two summation orders. Measured worst relative errors over the battery: eps = 1e-8:
5e-4 (zero-initialised biases), 1.8e-4 (weights, TP = 2, with the noisy biases); eps = 1e-5:
1e-5; eps = 1e-3: 2.7e-7 (every tensor). So eps = 1e-3 keeps Adam's update a contraction of the
gradient error (|Δupdate| <= |Δg|) and 1e-6 is an honest bound with a 3.7x margin.

Inside the same spawn (tests/parallel/data/dp_checks.py): the distributed optimizer's contiguous 1/d
shard of every bucket, --overlap-param-gather leaving the all-gather pending after step() until
the forward pre-hooks wait for it, and FSDP2's no_sync reducing nothing before the last
micro-batch.
"""

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

from megalite.model.gpt import GPTModel, masked_mean_loss
from megalite.model.weights import load_full_weights
from megalite.optimizer.mixed_precision import build_optimizer, no_weight_decay
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads
from megalite.parallel.data.fsdp import apply_fsdp2
from megalite.parallel.sharding import gather_tp_full
from megalite.parallel.spawn import pair_state
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.model.test_gpt_tp import VOCAB, make_config
from tests.numerics import rel_error
from tests.parallel.data.dp_checks import FSDPNoSyncProbe, overlapped_gather_problems, shard_layout_problems

TOL = 1e-6
GLOBAL_BATCH, SEQ, STEPS = 16, 16, 3
OPTIM = dict(lr=1e-3, adam_eps=1e-3, weight_decay=0.1, clip_grad=1.0)


# --- shared harness (also used by test_optimizer.py) ---------------------------------------
def global_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=g) > 0.2).float()
    return tokens, labels, mask


def micro_batches(step: int, dp_rank: int, dp_size: int, micro: int):
    """This DP rank's contiguous slice of the global batch, cut into micro-batches."""
    per_rank = GLOBAL_BATCH // dp_size
    tokens, labels, mask = (t[dp_rank * per_rank:(dp_rank + 1) * per_rank] for t in global_batch(step))
    return [(tokens[i:i + micro], labels[i:i + micro], mask[i:i + micro]) for i in range(0, per_rank, micro)]


_INITIAL_WEIGHTS: dict = {}


def initial_weights(config) -> dict:
    """The full (TP = 1) starting weights of the test models: GPTModel's initialisation with
    every 1-D parameter moved by N(0, 0.02²) noise (GPTModel zeroes biases)."""
    config = dataclasses.replace(config, sequence_parallel=False, params_dtype="float32")
    key = repr(config)
    if key not in _INITIAL_WEIGHTS:
        model = GPTModel(config, ParallelState.single(), init_seed=7)
        noise = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim == 1:
                    param.add_(0.02 * torch.randn(param.shape, generator=noise))
        _INITIAL_WEIGHTS[key] = {name: p.detach() for name, p in model.named_parameters()}
    return _INITIAL_WEIGHTS[key]


def make_model(config, pstate, **kwargs) -> GPTModel:
    """A (TP/PP shard of the) test model holding its slice of initial_weights(config)."""
    model = GPTModel(config, pstate, init_seed=7, **kwargs)
    load_full_weights(model, initial_weights(config).__getitem__)
    return model


def train_step(chunk, optimizer, pstate, step, micro, before_step=None, after_backward=None):
    """One optimizer step over this rank's micro-batches; returns optimizer.step()'s result.
    after_backward(i, last) runs after micro-batch i's backward."""
    optimizer.zero_grad()
    batches = micro_batches(step, pstate.dp_rank, pstate.dp_size, micro)
    for i, (tokens, labels, mask) in enumerate(batches):
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else chunk.no_sync():
            loss = masked_mean_loss(chunk(tokens, labels=labels), mask) / len(batches)
            optimizer.scale_loss(loss).backward()
        if after_backward is not None:
            after_backward(i, last)
    finalize_model_grads([chunk], pstate)
    if before_step is not None:
        before_step()
    return optimizer.step()


def full_params(module, tp_group) -> dict:
    """Every parameter as the full TP = 1 tensor (FSDP2 shards gathered too), fp32."""
    out = {}
    for name, param in module.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
        out[name] = gather_tp_full(param, value.float(), tp_group)
    return out


def build(pstate, family, *, fsdp=False, overlap=False, dist_opt=False, bucket_size=None, sp=False,
          params_dtype="float32", grad_dtype=torch.float32, **optim):
    config = make_config(family, sequence_parallel=sp and pstate.tp_size > 1, params_dtype=params_dtype)
    model = make_model(config, pstate)
    if fsdp:
        chunk = apply_fsdp2(model, pstate)
    else:
        chunk = DistributedDataParallel(model, pstate, bucket_size=bucket_size, overlap_grad_reduce=overlap,
                                        use_distributed_optimizer=dist_opt, grad_dtype=grad_dtype)
    optimizer = build_optimizer([chunk], pstate, use_distributed_optimizer=dist_opt,
                                bf16=params_dtype == "bfloat16", fp16=params_dtype == "float16",
                                **{**OPTIM, **optim})
    return chunk, optimizer


def reference_run(family: str, micro: int, steps: int = STEPS):
    """Plain PyTorch at DP = 1: AdamW with the same weight-decay groups and clipping."""
    model = make_model(make_config(family), ParallelState.single())
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not no_weight_decay(n, p)], "weight_decay": OPTIM["weight_decay"]},
              {"params": [p for n, p in named if no_weight_decay(n, p)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=OPTIM["lr"], eps=OPTIM["adam_eps"], foreach=True)
    norms, losses = [], []
    for step in range(steps):
        optimizer.zero_grad()
        batches = micro_batches(step, 0, 1, micro)
        loss = 0.0
        for tokens, labels, mask in batches:
            micro_loss = masked_mean_loss(model(tokens, labels=labels), mask) / len(batches)
            micro_loss.backward()
            loss += micro_loss.item()
        losses.append(loss)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["clip_grad"]).item())
        optimizer.step()
    return {"params": {n: p.detach().clone() for n, p in named}, "norms": norms, "losses": losses}


def assert_replicas_identical(params: dict, pstate) -> None:
    """Every DP rank holds bitwise the same parameters."""
    if pstate.dp_size == 1:
        return
    for name, value in params.items():
        src = value.clone()
        dist.broadcast(src, group_src=0, group=pstate.dp_group)
        assert torch.equal(src, value), f"DP replicas differ in {name} on rank {pstate.rank}"


# --- the equivalence battery ----------------------------------------------------------------
# (name, layout, family, accumulation steps, options)
def _configs():
    out = []
    for dp in ("dp2a", "dp2b", "dp4"):
        dist_opts = {"dp2a": (False,), "dp2b": (True,), "dp4": (False, True)}[dp]
        for dist_opt in dist_opts:
            for overlap in (False, True):
                for accum in (1, 4):
                    opts = dict(dist_opt=dist_opt, overlap=overlap, bucket_size=8000 if overlap else None)
                    out.append((f"{dp}/dist{int(dist_opt)}/ovl{int(overlap)}/acc{accum}", dp, "gpt2", accum, opts))
    out += [
        ("dp2a/fsdp/acc1", "dp2a", "gpt2", 1, dict(fsdp=True)),
        ("dp2a/fsdp/acc4", "dp2a", "gpt2", 4, dict(fsdp=True)),
        ("dp2b/dist1/param-gather/acc4", "dp2b", "llama", 4,
         dict(dist_opt=True, overlap=True, bucket_size=8000, overlap_param_gather=True)),
        ("dp2b/dist1/cpu-offload/acc1", "dp2b", "gpt2", 1, dict(dist_opt=True, cpu_offload=True)),
        ("dp4/fsdp/acc1", "dp4", "llama", 1, dict(fsdp=True)),
        ("dp4/fsdp/acc4", "dp4", "gpt2", 4, dict(fsdp=True)),
        ("dp4/dist1/param-gather/acc1", "dp4", "gpt2", 1,
         dict(dist_opt=True, overlap=True, bucket_size=8000, overlap_param_gather=True)),
        ("tp2dp2/sp/ovl1/acc4", "tp2dp2", "gpt2", 4, dict(sp=True, overlap=True, bucket_size=8000)),
        ("tp2dp2/sp/dist1/ovl1/acc1", "tp2dp2", "gpt2", 1, dict(sp=True, dist_opt=True, overlap=True,
                                                                 bucket_size=8000)),
        ("tp2dp2/llama/sp/dist1/param-gather/acc4", "tp2dp2", "llama", 4,
         dict(sp=True, dist_opt=True, overlap=True, bucket_size=8000, overlap_param_gather=True)),
        ("tp2dp2/llama/acc1", "tp2dp2", "llama", 1, dict()),
        ("tp2dp2/llama/sp/fsdp/acc1", "tp2dp2", "llama", 1, dict(sp=True, fsdp=True)),
        ("tp2dp2/gpt2/fsdp/acc4", "tp2dp2", "gpt2", 4, dict(fsdp=True)),
    ]
    return out


def micro_size(layout: str, accum: int) -> int:
    dp = 4 if layout == "dp4" else 2
    return GLOBAL_BATCH // (dp * accum)


def _train_and_check(pstate, chunk, optimizer, layout, accum, opts) -> tuple[list, list[str]]:
    """Grad norms of the STEPS steps, and the problems dp_checks.py finds on this rank."""
    micro, problems, norms = micro_size(layout, accum), [], []
    for step in range(STEPS):
        probe = FSDPNoSyncProbe(chunk, pstate) if opts.get("fsdp") and accum > 1 and step == 0 else None
        with probe or contextlib.nullcontext():
            norms.append(train_step(chunk, optimizer, pstate, step, micro,
                                    after_backward=probe.after_backward if probe else None)[1])
        problems += probe.problems if probe else []
    if opts.get("dist_opt"):
        problems += shard_layout_problems(chunk, optimizer, pstate)
    if opts.get("overlap_param_gather"):
        problems += overlapped_gather_problems(chunk, pstate, *micro_batches(STEPS, pstate.dp_rank,
                                                                              pstate.dp_size, micro)[0])
    return norms, problems


def _battery_worker(rank, world_size):
    torch.manual_seed(0)
    states = {"pair": pair_state(rank),
              "dp4": ParallelState.create(ParallelLayout(world_size)),
              "tp2dp2": ParallelState.create(ParallelLayout(world_size, tensor=2))}
    my_pair = "dp2a" if rank < 2 else "dp2b"
    out = {"results": {}, "checked": {}}
    for name, layout, family, accum, opts in _configs():
        if layout.startswith("dp2") and layout != my_pair:
            continue
        pstate = states["pair" if layout.startswith("dp2") else layout]
        chunk, optimizer = build(pstate, family, **opts)
        norms, problems = _train_and_check(pstate, chunk, optimizer, layout, accum, opts)
        out["checked"][f"{name} @ rank {rank}"] = problems
        optimizer.finish_param_sync()
        params = full_params(chunk.module, pstate.tp_group)
        assert_replicas_identical(params, pstate)
        if pstate.dp_rank == 0 and pstate.tp_rank == 0:
            out["results"][name] = {"params": params, "norms": norms}
    return out


@pytest.fixture(scope="module")
def battery():
    merged = {"results": {}, "checked": {}}
    for result in run_distributed(_battery_worker, 4):
        for key in merged:
            merged[key].update(result[key])
    return merged


@pytest.fixture(scope="module")
def references(reference_runs):
    return lambda family, micro: reference_runs.get(reference_run, family, micro)


@pytest.mark.parametrize("name, layout, family, accum, opts", _configs(), ids=[c[0] for c in _configs()])
def test_data_parallel_matches_single_process(battery, references, name, layout, family, accum, opts):
    reference = references(family, micro_size(layout, accum))
    result = battery["results"][name]
    assert set(result["params"]) == set(reference["params"]), name
    for pname, expected in reference["params"].items():
        err = rel_error(result["params"][pname], expected)
        assert err <= TOL, f"{name}: {pname} relative error {err:.2e} > {TOL:.0e}"
    for step, (ours, ref) in enumerate(zip(result["norms"], reference["norms"])):
        assert abs(ours - ref) <= TOL * ref, f"{name}: grad norm at step {step}: {ours} vs {ref}"


def test_grad_norm_is_the_same_at_tp1_and_tp2_with_and_without_distributed_optimizer(battery, references):
    """The global norm counts TP-replicated parameters once and each DP shard once."""
    reference = references("gpt2", micro_size("tp2dp2", 1))["norms"]
    for name in ("tp2dp2/sp/dist1/ovl1/acc1", "dp2a/dist0/ovl0/acc1", "dp2b/dist1/ovl0/acc1"):
        for ours, ref in zip(battery["results"][name]["norms"], reference):
            assert abs(ours - ref) <= TOL * ref, f"{name}: {ours} vs {ref}"


def _checked(battery, option) -> dict:
    """{config @ rank: problems} for the configs with `option`; every rank of each is there."""
    names = [name for name, _, _, accum, opts in _configs() if opts.get(option) and (option != "fsdp" or accum > 1)]
    checked = {key: problems for key, problems in battery["checked"].items() if key.split(" @ ")[0] in names}
    assert len(checked) == sum(2 if name.startswith("dp2") else 4 for name in names) > 0, sorted(checked)
    return checked


def test_distributed_optimizer_owns_a_contiguous_1_over_d_of_every_bucket(battery):
    for key, problems in _checked(battery, "dist_opt").items():
        assert not problems, f"{key}: " + "; ".join(problems[:5])


def test_overlapped_param_gather_is_pending_after_step_until_the_forward_waits(battery):
    for key, problems in _checked(battery, "overlap_param_gather").items():
        assert not problems, f"{key}: " + "; ".join(problems[:5])


def test_fsdp2_reduce_scatters_only_after_the_last_micro_batch(battery):
    for key, problems in _checked(battery, "fsdp").items():
        assert not problems, f"{key}: " + "; ".join(problems[:5])
