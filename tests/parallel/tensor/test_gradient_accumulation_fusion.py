"""Gradient accumulation fusion (Megatron's default, --no-gradient-accumulation-fusion): the
tensor-parallel linears add their weight gradients to the fp32 main_grad inside the
weight-gradient GEMM (megalite.parallel.tensor.gemm) instead of handing autograd a weight
gradient that DistributedDataParallel's hook then adds.

Megatron's behaviour: megatron/core/tensor_parallel/layers.py
LinearWithGradAccumulationAndAsyncCommunication.backward calls wgrad_gemm_accum_fp32 into
weight.main_grad and sets weight.grad_added_to_main_grad; distributed_data_parallel.py's hook
then skips main_grad.add_. megalite hands autograd None instead of Megatron's dummy tensor, so
no full-size weight gradient is allocated at all (the hook still runs and marks readiness).

Spawned (2 gloo processes, fp32, SGD without clipping so that the update is proportional to
the gradient): TP 2 with sequence parallelism (also with --tp-comm-overlap's split GEMMs), PP 2
with the zero-bubble schedule (the W pass fuses, the B pass must not) and with the output
layer's deferred weight gradients (fused at the drain), DP 2 with the distributed optimizer and
overlapped reduction: 4 steps fused against unfused, every gradient buffer and parameter within
1e-6, and every linear weight of every rank accumulated inside its GEMM. FSDP2 has no
main_grad: its linears keep the ordinary .grad path (run_config refuses an explicit
--gradient-accumulation-fusion there, tests/config/test_gradient_accumulation_fusion_flag.py).
"""

import pytest
import torch

from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.model.weights import gather_full_weights
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.data.fsdp import apply_fsdp2
from megalite.parallel.pipeline.executor import PipelineExecutor
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.parallel.tensor.comm_overlap import DEFAULTS, OverlapSetting, enable_tp_comm_overlap
from megalite.parallel.tensor.deferred_wgrad import defer_wgrad
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from tests.distributed import run_distributed
from tests.numerics import rel_error
from tests.parallel.pipeline.pipeline_cases import HIDDEN, INIT_SEED, MICRO_BATCH, SEQ, make_config, microbatches
from tests.parallel.train_step import train_step

STEPS, M, TOL = 4, 4, 1e-6
OPTIM = dict(optimizer="sgd", lr=0.5, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0)
# name: (layout, family, sequence parallel, schedule, distributed optimizer, overlapped reduction, extra)
CASES = {
    "tp2-sp": (dict(tensor=2), "gpt2", True, None, False, False, None),
    "tp2-sp-tp-comm-overlap": (dict(tensor=2), "llama", True, None, False, True, "tp_comm_overlap"),
    "pp2-zero-bubble": (dict(pipeline=2), "llama", False, "zb_h1", False, True, None),
    "pp2-deferred-output-wgrad": (dict(pipeline=2), "llama", False, "1f1b", False, True, "defer_wgrad"),
    "dp2-distributed-optimizer": ({}, "gpt2", False, None, True, True, None),
}
# the column-parallel input gradient both ways: bulk (qkv) and a split reduce-scatter (fc1)
TP_OVERLAP = {**DEFAULTS, "fc1_dgrad": OverlapSetting("pipeline", 2)}


def _linear_weights(module) -> list:
    return [m.weight for m in module.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None]


def _run(name: str, fused: bool, world: int) -> dict:
    layout, family, sp, schedule, dist_opt, overlap, extra = CASES[name]
    pstate = ParallelState.create(ParallelLayout(world, **layout))
    models = build_model_chunks(make_config(family, sequence_parallel=sp), pstate, init_seed=INIT_SEED)
    for model in models:
        if extra == "tp_comm_overlap":
            assert enable_tp_comm_overlap(model, TP_OVERLAP)
        if extra == "defer_wgrad" and model.post_process:
            defer_wgrad(model.output_layer, limit=2)
    chunks = [DistributedDataParallel(m, pstate, use_distributed_optimizer=dist_opt, overlap_grad_reduce=overlap,
                                      bucket_size=4000 if overlap else None, gradient_accumulation_fusion=fused)
              for m in models]
    optimizer = build_optimizer(chunks, pstate, use_distributed_optimizer=dist_opt, **OPTIM)
    executor = None
    if pstate.pp_size > 1:
        executor = PipelineExecutor(chunks, pstate, schedule, num_microbatches=M, seq_length=SEQ,
                                    micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN, sequence_parallel=sp,
                                    forward_step=gpt_forward_step)
    out = {"buffers": [], "params": [], "fused_weights": [], "weights": 0, "grads_left": []}
    for step in range(STEPS):
        optimizer.zero_grad()
        batches = microbatches(M, seed=10 * step + pstate.dp_rank)
        train_step(chunks, pstate, batches, gpt_forward_step, executor)
        weights = [w for c in chunks for w in _linear_weights(c.module)]
        out["weights"] = len(weights)
        out["fused_weights"].append(sum(bool(w.grad_added_to_main_grad) for w in weights))
        out["grads_left"].append(sum(w.grad is not None for w in weights))
        out["buffers"].append([b.grad_data.clone() for c in chunks for b in c.buffers_])
        optimizer.step()
        out["params"].append({k: v for c in chunks for k, v in gather_full_weights(c.module).items()})
    return out


def _fsdp2_run(world: int) -> dict:
    """FSDP2 has no main_grad: the linears' weight gradients arrive as .grad (sharded DTensors)."""
    pstate = ParallelState.create(ParallelLayout(world))
    model = build_model_chunks(make_config("gpt2"), pstate, init_seed=INIT_SEED)[0]
    chunk = apply_fsdp2(model, pstate)
    weights = _linear_weights(chunk.module)
    gpt_forward_step(chunk, microbatches(1)[0], None).backward()
    return {"weights": len(weights), "with_grad": sum(w.grad is not None for w in weights),
            "marked": sum(getattr(w, "fuse_wgrad_accumulation", False) for w in weights),
            "main_grad": sum(hasattr(w, "main_grad") for w in weights)}


def _worker(rank, world_size):
    results = {name: {fused: _run(name, fused, world_size) for fused in (False, True)} for name in CASES}
    results["fsdp2"] = _fsdp2_run(world_size)
    return results


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_worker, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_accumulation_equals_the_unfused_path_over_four_steps(spawned, name):
    for rank, result in enumerate(spawned):
        unfused, fused = result[name][False], result[name][True]
        for step in range(STEPS):
            for i, (a, b) in enumerate(zip(fused["buffers"][step], unfused["buffers"][step])):
                assert rel_error(a, b) <= TOL, (name, rank, step, f"buffer {i}", rel_error(a, b))
            for key, value in unfused["params"][step].items():
                assert rel_error(fused["params"][step][key], value) <= TOL, (name, rank, step, key)


@pytest.mark.parametrize("name", list(CASES))
def test_the_fused_path_ran_and_left_no_weight_gradient(spawned, name):
    for result in spawned:
        unfused, fused = result[name][False], result[name][True]
        assert fused["weights"] > 0
        # every linear weight of the rank was accumulated inside its GEMM, in every step
        assert fused["fused_weights"] == [fused["weights"]] * STEPS, fused["fused_weights"]
        assert fused["grads_left"] == [0] * STEPS and unfused["fused_weights"] == [0] * STEPS


def test_fsdp2_keeps_the_ordinary_weight_gradient(spawned):
    for result in spawned:
        fsdp2 = result["fsdp2"]
        assert fsdp2["weights"] > 0 and fsdp2["with_grad"] == fsdp2["weights"], fsdp2
        assert fsdp2["marked"] == 0 and fsdp2["main_grad"] == 0, fsdp2


class _TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = ColumnParallelLinear(6, 8, bias=True)
        self.fc2 = RowParallelLinear(8, 5, bias=False)
        generator = torch.Generator().manual_seed(3)
        for layer in (self.fc1, self.fc2):
            layer.reset_parameters(generator)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _hooked_ddp(fused: bool):
    """A DDP-wrapped two-linear model and a record of each post-accumulate hook call (param, .grad
    set?), taken by a hook registered before DDP's, i.e. what DDP's hook is about to add."""
    model, seen = _TwoLinears(), []
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: seen.append((p, p.grad is not None)))
    return DistributedDataParallel(model, ParallelState.single(), gradient_accumulation_fusion=fused), seen


def test_fused_backward_accumulates_into_main_grad_without_a_weight_gradient():
    inputs = [torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    fused, seen = _hooked_ddp(True)
    unfused, seen_unfused = _hooked_ddp(False)
    weights = [fused.module.fc1.weight, fused.module.fc2.weight]
    for i, x in enumerate(inputs):
        for ddp in (fused, unfused):
            ddp(x).square().sum().backward()
        for param, had_grad in seen:  # the hook still ran (readiness) but had nothing to add
            assert had_grad == (param is fused.module.fc1.bias), param.shape
        assert all(had_grad for _, had_grad in seen_unfused)
        assert len(seen) == len(seen_unfused) == 3 * (i + 1)
        for w in weights:
            assert w.grad is None and w.grad_added_to_main_grad
        # accumulated across micro-batches: the running sum of every micro-batch's gradient
        for a, b in zip(fused.module.parameters(), unfused.module.parameters()):
            assert rel_error(a.main_grad, b.main_grad) <= TOL and a.main_grad.abs().sum() > 0
    fused.zero_grad_buffer()
    assert not any(w.grad_added_to_main_grad for w in weights) and all(w.main_grad.abs().sum() == 0 for w in weights)


def test_an_autograd_grad_that_asks_for_the_weight_gets_it_and_main_grad_stays():
    ddp, _ = _hooked_ddp(True)
    weight = ddp.module.fc2.weight
    (grad,) = torch.autograd.grad(ddp(torch.randn(2, 6)).sum(), [weight])
    assert grad is not None and grad.abs().sum() > 0 and weight.main_grad.abs().sum() == 0


def test_bf16_on_cpu_accumulates_the_fp32_product_of_the_bf16_operands():
    """The fused GPU GEMM's precision: no bf16 rounding of the weight gradient (the unfused
    path rounds dy^T x to bf16 before adding it to main_grad)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 32, generator=g).bfloat16()
    dy = torch.randn(64, 16, generator=g).bfloat16()
    main_grads = {}
    for fused in (True, False):
        layer = RowParallelLinear(32, 16, bias=False, params_dtype=torch.bfloat16)
        ddp = DistributedDataParallel(layer, ParallelState.single(), gradient_accumulation_fusion=fused)
        for _ in range(2):
            ddp(x).backward(dy)
        main_grads[fused] = layer.weight.main_grad
    exact = 2 * dy.float().t().mm(x.float())
    assert rel_error(main_grads[True], exact) <= TOL
    assert rel_error(main_grads[False], exact) > 10 * TOL  # bf16-rounded, so the check can tell them apart


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_recompute_fuses_the_same_gradients(granularity):
    """Recomputed layers (non-reentrant checkpoints) run the fused backward once per micro-batch."""
    main_grads = {}
    for fused in (True, False):
        config = make_config("llama", recompute_granularity=granularity)
        model = build_model_chunks(config, ParallelState.single(), init_seed=INIT_SEED)[0]
        ddp = DistributedDataParallel(model, ParallelState.single(), gradient_accumulation_fusion=fused)
        for batch in microbatches(2):
            gpt_forward_step(ddp, batch, None).backward()
        assert all(w.grad_added_to_main_grad == fused for w in _linear_weights(model))
        main_grads[fused] = [p.main_grad.clone() for p in model.parameters()]
    for a, b in zip(main_grads[True], main_grads[False]):
        assert rel_error(a, b) <= TOL
