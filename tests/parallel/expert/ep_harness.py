"""Train a tiny MoE GPT for a few steps at any TP / PP / DP / EP layout and return what the
expert-parallel tests compare with the single-process EP = 1 run: per-step losses, the first
step's full gradients, the final full parameters (and expert biases) and eval logits."""

import torch

from megalite.model.config import GPTConfig
from megalite.model.gpt import masked_mean_loss
from megalite.model.moe import update_expert_bias
from megalite.model.moe_config import MoEConfig
from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.optimizer.memory_report import memory_report
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel import comm
from megalite.parallel.context import gather_sequence, split_sequence
from megalite.parallel.context.split import local_positions
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.data.fsdp import FSDPChunk, apply_fsdp2
from megalite.parallel.expert.groups import ExpertState, tensor_split_of
from megalite.parallel.pipeline.executor import PipelineExecutor
from megalite.parallel.sharding import gather_tp_full
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.training.per_token_loss import PerTokenLoss
from tests.numerics import rel_error
from tests.parallel.train_step import train_step

VOCAB, SEQ, MICRO, GLOBAL, HIDDEN, STEPS = 64, 8, 2, 8, 16, 2
OPTIM = dict(lr=1e-2, adam_eps=1e-3, weight_decay=0.1, clip_grad=1.0)

# Two routers: softmax with the auxiliary and z-losses and a gated shared expert; sigmoid with
# expert bias, the sequence auxiliary loss and group-limited routing.
ROUTERS = {
    "softmax": dict(aux_loss_coeff=1e-2, z_loss_coeff=1e-3, shared_expert_intermediate_size=12,
                    shared_expert_gate=True),
    "sigmoid": dict(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=1e-2,
                    load_balancing_type="seq_aux_loss", aux_loss_coeff=1e-2, num_groups=4, group_topk=2),
}


def moe_model_config(dispatcher: str, router: str, sequence_parallel=False, **moe) -> GPTConfig:
    moe = MoEConfig(num_experts=8, ffn_hidden_size=24, router_topk=2, token_dispatcher_type=dispatcher,
                    **{**ROUTERS[router], **moe})
    return GPTConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, vocab_size=VOCAB,
                     max_position_embeddings=SEQ, ffn_hidden_size=32, activation="swiglu",
                     normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                     untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0,
                     sequence_parallel=sequence_parallel, moe=moe)


def rank_batches(step: int, dp_rank: int, dp_size: int, cp_size: int = 1, cp_rank: int = 0,
                 full_masks: bool = False) -> list[dict]:
    """This DP rank's micro-batches of the step, each sequence cut to this CP rank's chunks."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    mask = (torch.rand(GLOBAL, SEQ, generator=g) > 0.2).float()
    if full_masks:
        mask = torch.ones_like(mask)
    per_rank = GLOBAL // dp_size
    lo = dp_rank * per_rank
    cut = lambda t: split_sequence(t, 1, cp_size, cp_rank)  # noqa: E731
    positions = local_positions(SEQ, cp_size, cp_rank).expand(MICRO, -1)
    return [dict(tokens=cut(tokens[i:i + MICRO]), labels=cut(labels[i:i + MICRO]), loss_mask=cut(mask[i:i + MICRO]),
                 position_ids=positions) for i in range(lo, lo + per_rank, MICRO)]


def eval_tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))


def eval_logits(model, pstate) -> torch.Tensor:
    """Logits of eval_tokens() over the whole sequence and vocabulary."""
    cp, cp_rank = pstate.cp_size, pstate.cp_rank
    tokens = split_sequence(eval_tokens(), 1, cp, cp_rank)
    with torch.no_grad():
        logits = model(tokens, position_ids=local_positions(SEQ, cp, cp_rank).expand(tokens.shape[0], -1))
    logits = comm.gather_dim(logits, 2, pstate.tp_group)[..., :VOCAB]
    return gather_sequence(logits, 1, pstate.cp_group).clone()


def full_state(chunks, pstate, grads=False) -> dict:
    out = {}
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            value = (param.grad if isinstance(chunk, FSDPChunk) else param.main_grad) if grads else param.detach()
            value = value.full_tensor() if hasattr(value, "full_tensor") else value  # FSDP2's shards
            out[name] = gather_tp_full(param, value.float(), tensor_split_of(pstate, param)[0]).clone()
        if not grads:
            out.update({n: b.clone() for n, b in chunk.module.named_buffers() if n.endswith("expert_bias")})
    return out


def train(pstate: ParallelState, config: GPTConfig, dist_opt=False, steps=STEPS, fsdp=False, per_token=False,
          full_masks=False) -> dict:
    """Train `steps` steps; fsdp: FSDP2 in place of DistributedDataParallel; per_token:
    --calculate-per-token-loss; full_masks: every token counts in the loss."""
    models = build_model_chunks(config, pstate, init_seed=7)
    chunks = [apply_fsdp2(c, pstate) if fsdp else DistributedDataParallel(c, pstate, use_distributed_optimizer=dist_opt)
              for c in models]
    optimizer = build_optimizer(chunks, pstate, use_distributed_optimizer=dist_opt, **OPTIM)
    batches_of = lambda step: rank_batches(step, pstate.dp_rank, pstate.dp_size, pstate.cp_size,  # noqa: E731
                                           pstate.cp_rank, full_masks)
    m = len(batches_of(0))
    forward_step = PerTokenLoss() if per_token else gpt_forward_step
    executor = None
    if pstate.pp_size > 1:
        executor = PipelineExecutor(chunks, pstate, "1f1b", num_microbatches=m, seq_length=SEQ,
                                    micro_batch_size=MICRO, hidden_size=HIDDEN,
                                    sequence_parallel=config.sequence_parallel, forward_step=forward_step)
    result = {"losses": []}
    for step in range(steps):
        optimizer.zero_grad()
        result["losses"].append(train_step(chunks, pstate, batches_of(step), forward_step, executor, per_token))
        if step == 0 and not dist_opt:
            result["grads"] = full_state(chunks, pstate, grads=True)
        optimizer.step()
        update_expert_bias(models, pstate.dp_cp_group)
    result["params"] = full_state(chunks, pstate)
    result["memory"] = memory_report(chunks, optimizer, pstate)[0]
    if pstate.pp_size == 1:
        result["logits"] = eval_logits(chunks[0].module.eval(), pstate)
    return result


def expert_state(tp=1, pp=1, ep=1, etp=None, cp=1, world=None) -> ParallelState:
    """A ParallelState (collective) with its ExpertState attached."""
    world = world or torch.distributed.get_world_size()
    pstate = ParallelState.create(ParallelLayout(world, tensor=tp, pipeline=pp, context=cp))
    pstate.expert = ExpertState.create(pstate, ep, num_experts=8, expert_tensor_size=etp)
    return pstate


def reference(config: GPTConfig, **options) -> dict:
    pstate = ParallelState.single()
    pstate.expert = ExpertState.single()
    return train(pstate, config, **options)


GRID = ("tp", "pp", "cp", "ep", "etp")


def layout_config(spec: dict, dispatcher: str, router: str) -> GPTConfig:
    return moe_model_config(dispatcher, router, sequence_parallel=spec.get("sp", False))


def train_runs(rank: int, world_size: int, layouts: dict, runs) -> dict:
    """A run_distributed worker: train every run (layout name, dispatcher, router), `layouts`
    mapping a name to its grid sizes (tp, pp, cp, ep, etp), sp (sequence parallelism) and
    options of train(); {'layout/dispatcher/router': train()'s result}."""
    out, states = {}, {}
    for layout, dispatcher, router in runs:
        spec = layouts[layout]
        if layout not in states:
            states[layout] = expert_state(**{k: v for k, v in spec.items() if k in GRID})
        options = {k: v for k, v in spec.items() if k not in (*GRID, "sp")}
        out[f"{layout}/{dispatcher}/{router}"] = train(states[layout], layout_config(spec, dispatcher, router), **options)
    return out


def compare(per_rank: list[dict], ref: dict, tol: float = 1e-5) -> list[str]:
    """What differs by more than `tol` relative between every rank's results and the reference:
    the mean loss over the ranks that report one, full gradients and parameters, logits."""
    problems = []
    losses = [r["losses"] for r in per_rank if r["losses"][0] is not None]
    mean = torch.tensor(losses).mean(0)
    if rel_error(mean, torch.tensor(ref["losses"])) > tol:
        problems.append(f"losses {mean.tolist()} vs {ref['losses']}")
    for key in ("grads", "params"):
        seen = set()
        for r in per_rank:
            for name, value in r.get(key, {}).items():
                seen.add(name)
                want = ref[key][name]
                err = rel_error(value[:want.shape[0]], want)  # the vocabulary padding grows with TP
                if err > tol:
                    problems.append(f"{key} {name}: rel error {err:.2e}")
        if key in per_rank[0] and seen != set(ref[key]):
            problems.append(f"{key}: missing {sorted(set(ref[key]) - seen)[:3]}")
    for r in per_rank:
        if "logits" in r and rel_error(r["logits"], ref["logits"]) > tol:
            problems.append(f"logits: rel error {rel_error(r['logits'], ref['logits']):.2e}")
    return problems


def check_run(results: list[dict], layouts: dict, run, reference_runs) -> None:
    """Assert that `run` (of train_runs, on every rank) equals the single-process EP = 1 run
    (from `reference_runs`, tests/reference_runs.py: the runs of one dispatcher and router share it)."""
    layout, dispatcher, router = run
    spec = layouts[layout]
    ref = reference_runs.get(reference, layout_config(spec, dispatcher, router).replace(sequence_parallel=False),
                             per_token=spec.get("per_token", False))
    assert ref["losses"][1] < ref["losses"][0] + 0.5  # the reference trains at all
    assert compare([r[f"{layout}/{dispatcher}/{router}"] for r in results], ref) == []


def layer_errors(pstate: ParallelState, dispatcher: str, expert_bias: list[float] | None = None, **moe) -> dict:
    """One MoE layer at this EP size against the EP = 1 layer on the same tokens, a different
    number of tokens on each rank (3 + rank sequences positions): relative errors of the output,
    the input gradient, the router gradient and each local expert's gradient (the EP = 1
    gradients summed over the EP group, as every rank's tokens reach the expert).
    `expert_bias`: both routers' (with moe enable_expert_bias), to steer tokens off experts."""
    from megalite.model.moe import MoELayer
    from tests.model.moe_reference import tiny_config

    config = tiny_config(token_dispatcher_type=dispatcher, **moe)
    reference, layer = MoELayer(config), MoELayer(config, expert_state=pstate.expert)
    for model in (reference, layer):
        for name, module in model.named_modules():
            if hasattr(module, "reset_parameters") and module is not model:
                module.reset_parameters(torch.Generator().manual_seed(len(name) * 7919 + sum(map(ord, name))))
        if expert_bias is not None:
            model.router.expert_bias.copy_(torch.tensor(expert_bias))
    g = torch.Generator().manual_seed(pstate.rank)
    x = torch.randn(3 + pstate.rank, 2, HIDDEN, generator=g)
    grad = torch.randn(x.shape, generator=g)
    outs, grads = [], []
    for model in (reference, layer):
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.backward(grad)
        outs.append(out.detach())
        grads.append(xi.grad)
    errors = {"output": rel_error(outs[1], outs[0]), "input grad": rel_error(grads[1], grads[0])}
    wanted = {name: p.grad.clone() for name, p in reference.named_parameters()}
    for name, grad in wanted.items():  # every expert, in the same order on every rank
        if name.startswith("local_experts."):
            comm.all_reduce(grad, pstate.expert.ep_group)
    for name, param in layer.named_parameters():
        errors[name] = rel_error(param.grad, wanted[name])
    errors["counts"] = layer.last_tokens_per_expert
    return errors
