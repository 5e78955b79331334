"""The optimizer: loss scaling, clipping, weight-decay groups, bf16 main parameters, fp16
overflow skipping, tied embeddings over a pipeline, layout-independent state dicts, torch's
foreach Adam and SGD on the CPU (fused Adam on CUDA: test_optimizer_cuda.py) and the memory
report against formulas.md (host and device apart under CPU offload).

One spawn of 4 gloo processes runs: bf16 at DP = 2 with the distributed optimizer on and off;
fp16 at DP = 4 with an inf and a NaN planted on one rank each; PP = 2 x DP = 2 with tied
embeddings (a hand-written two-stage schedule) against the single-process reference; a state
dict saved at DP = 2 with the distributed optimizer, compared with the one saved without it,
and resumed at DP = 4 (distributed optimizer on, off, and FSDP2); and the memory figures at
DP = 2 and 4 (FSDP2 at DP = 4, CPU offload at DP = 2). Parameters are compared as in
test_data_parallel.py: max|ours - reference| / max|reference| per tensor, within 1e-6.
"""

import contextlib
import logging

import math

import pytest
import torch
import torch.distributed as dist

from megalite.model.gpt import masked_mean_loss
from megalite.model.weights import load_full_weights
from megalite.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler
from megalite.optimizer.memory_report import memory_report
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads
from megalite.parallel.spawn import pair_state
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.model.test_gpt_tp import make_config
from tests.numerics import rel_error
from tests.parallel.data.test_data_parallel import (GLOBAL_BATCH, OPTIM, SEQ, TOL, build, full_params, make_model,
                                                    micro_batches, reference_run, train_step)

SINGLE = ParallelState.single()


# --- in one process -------------------------------------------------------------------------
def test_dynamic_loss_scaler_follows_megatron():
    scaler = DynamicLossScaler(initial_scale=1024, min_scale=256, window=3, hysteresis=2)
    trace = []
    for found_inf in (False, True, False, True, True, False, False, False, True, True, True):
        scaler.update(found_inf)
        trace.append(scaler.scale)
    # hysteresis is refilled only when the scale grows; the floor is min_scale
    assert trace == [1024, 1024, 1024, 512, 256, 256, 256, 512, 512, 256, 256]
    restored = DynamicLossScaler(initial_scale=1)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    constant = ConstantLossScaler(8.0)
    constant.update(True)
    assert constant.scale == 8.0
    with pytest.raises(ValueError, match="--hysteresis"):
        DynamicLossScaler(hysteresis=0)


def test_clipping_uses_the_global_norm_and_decay_skips_1d_params():
    chunk, optimizer = build(SINGLE, "gpt2", clip_grad=0.5)
    reference = make_model(make_config("gpt2"), SINGLE)
    tokens, labels, mask = (t[:4] for t in micro_batches(0, 0, 1, GLOBAL_BATCH)[0])
    masked_mean_loss(chunk(tokens, labels=labels), mask).backward()
    masked_mean_loss(reference(tokens, labels=labels), mask).backward()
    finalize_model_grads([chunk], SINGLE)
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    ok, norm, zeros = optimizer.step()
    assert ok and abs(norm - expected) <= 1e-6 * expected and zeros is None
    clipped = torch.nn.utils.get_total_norm([p.main_grad for p in chunk.module.parameters()]).item()
    assert abs(clipped - 0.5) <= 1e-5
    decay, plain = optimizer.param_groups
    assert (decay["wd_mult"], plain["wd_mult"], plain["weight_decay"]) == (1.0, 0.0, 0.0)
    plain_ids = {id(p) for p in plain["params"]}
    names = {m.name for m in optimizer.mains if id(m.main) in plain_ids}
    assert names == {n for n, p in chunk.module.named_parameters() if p.ndim == 1}


@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_a_nan_gradient_skips_the_step_without_touching_the_parameters(params_dtype):
    """No loss scaler (bf16, fp32): a NaN gradient made the global norm NaN, the clipping factor
    NaN, and every parameter NaN with `ok` True. The step is now skipped (the loop stops the run
    unless --no-check-for-nan-in-loss-and-grad) and nothing changes."""
    chunk, optimizer = build(SINGLE, "gpt2", clip_grad=1.0, params_dtype=params_dtype)
    before = {n: p.detach().clone() for n, p in chunk.module.named_parameters()}
    mains = [m.main.detach().clone() for m in optimizer.mains]
    tokens, labels, mask = (t[:4] for t in micro_batches(0, 0, 1, GLOBAL_BATCH)[0])
    masked_mean_loss(chunk(tokens, labels=labels), mask).backward()
    finalize_model_grads([chunk], SINGLE)
    next(p for p in chunk.module.parameters() if p.ndim == 2).main_grad.view(-1)[3] = float("nan")
    ok, norm, zeros = optimizer.step(iteration=1)
    assert not ok and math.isnan(norm) and zeros is None
    assert all(torch.equal(p, before[n]) for n, p in chunk.module.named_parameters())
    assert all(torch.equal(m.main, old) for m, old in zip(optimizer.mains, mains))


@pytest.mark.parametrize("loss_scale, reason", [(None, "non-finite"), (None, "overflow"), (128.0, "non-finite")],
                         ids=["fp32", "fp16-dynamic", "fp16-static"])
def test_a_skipped_step_says_why(loss_scale, reason):
    """fp16's dynamic loss scale skips an overflowing step as part of its work ("overflow");
    a static --loss-scale cannot react, so there, as without loss scaling, NaN / Inf gradients
    are a fault ("non-finite"), which the loop stops on as Megatron's check does."""
    fp16 = reason == "overflow" or loss_scale is not None
    options = dict(params_dtype="float16", grad_dtype=torch.float16, loss_scale=loss_scale,
                   initial_loss_scale=128.0) if fp16 else {}
    chunk, optimizer = build(SINGLE, "gpt2", clip_grad=1.0, **options)
    tokens, labels, mask = (t[:4] for t in micro_batches(0, 0, 1, GLOBAL_BATCH)[0])
    for poisoned in (False, True, False):
        optimizer.zero_grad()
        optimizer.scale_loss(masked_mean_loss(chunk(tokens, labels=labels), mask)).backward()
        finalize_model_grads([chunk], SINGLE)
        if poisoned:
            next(p for p in chunk.module.parameters() if p.ndim == 2).main_grad.view(-1)[3] = float("nan")
        ok, _, _ = optimizer.step(iteration=1)
        assert (ok, optimizer.skip_reason) == ((False, reason) if poisoned else (True, None))


def test_sgd_matches_torch_sgd_and_counts_zero_gradients():
    chunk, optimizer = build(SINGLE, "gpt2", optimizer="sgd", clip_grad=0.0, log_num_zeros_in_grad=True)
    reference = make_model(make_config("gpt2"), SINGLE)
    named = list(reference.named_parameters())
    torch_sgd = torch.optim.SGD([{"params": [p for n, p in named if p.ndim > 1], "weight_decay": OPTIM["weight_decay"]},
                                 {"params": [p for n, p in named if p.ndim == 1], "weight_decay": 0.0}],
                                lr=OPTIM["lr"], momentum=0.9)
    for step in range(3):
        ok, _, zeros = train_step(chunk, optimizer, SINGLE, step, 16)
        torch_sgd.zero_grad()
        tokens, labels, mask = micro_batches(step, 0, 1, 16)[0]
        masked_mean_loss(reference(tokens, labels=labels), mask).backward()
        assert ok and zeros == sum(int((p.grad == 0).sum()) for p in reference.parameters())
        torch_sgd.step()
    for (name, p), q in zip(chunk.module.named_parameters(), reference.parameters()):
        assert rel_error(p, q) <= TOL, name
    state = optimizer.state_dict()["params"]["final_layernorm.weight"]
    assert set(state) == {"param", "momentum_buffer"}


@pytest.mark.parametrize("save_dist, load_dist", [(False, True), (True, False)])
def test_state_dict_resumes_across_distributed_optimizer_setting(save_dist, load_dist):
    saved, optimizer = build(SINGLE, "gpt2", dist_opt=save_dist, params_dtype="bfloat16")
    for step in range(2):
        train_step(saved, optimizer, SINGLE, step, 8)
    state = optimizer.state_dict()
    entry = state["params"]["layers.0.mlp.linear_fc1.weight"]
    assert set(entry) == {"param", "exp_avg", "exp_avg_sq"} and entry["param"].dtype == torch.float32
    assert entry["param"].shape == saved.module.layers["0"].mlp.linear_fc1.weight.shape and state["step"] == 2
    resumed, resumed_opt = build(SINGLE, "gpt2", dist_opt=load_dist, params_dtype="bfloat16")
    resumed_opt.load_state_dict(state)
    for name, p in resumed.module.named_parameters():
        assert torch.equal(p, state["params"][name]["param"].to(p.dtype)), name
    train_step(saved, optimizer, SINGLE, 2, 8)
    train_step(resumed, resumed_opt, SINGLE, 2, 8)
    for (name, p), q in zip(saved.module.named_parameters(), resumed.module.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="shape"):
        bad = {**state, "params": {**state["params"], "final_layernorm.weight": {
            k: torch.zeros(3) for k in entry}}}
        resumed_opt.load_state_dict(bad)


# (model dtype, distributed optimizer, total B/param = formula, optimizer B/param): the optimizer
# holds fp32 main parameters + Adam's two moments = 12, or only the moments (8) when the fp32
# model parameters are the main parameters.
@pytest.mark.parametrize("dtype, dist_opt, expected, optimizer_expected", [
    ("bfloat16", True, 18.0, 12.0), ("bfloat16", False, 18.0, 12.0), ("float32", False, 16.0, 8.0),
    ("float32", True, 16.0, 8.0)])
def test_memory_report_at_dp1_matches_formula(dtype, dist_opt, expected, optimizer_expected):
    chunk, optimizer = build(SINGLE, "gpt2", dist_opt=dist_opt, params_dtype=dtype)
    before, line = memory_report([chunk], optimizer, SINGLE)
    train_step(chunk, optimizer, SINGLE, 0, 16)
    after, _ = memory_report([chunk], optimizer, SINGLE)
    assert before == after, "the start-up estimate of Adam's state differs from what the step allocated"
    assert abs(after["bytes_per_param"] - expected) / expected < 0.01, line
    assert abs(after["optimizer_bytes_per_param"] - optimizer_expected) / optimizer_expected < 0.01, line
    assert after["formula_bytes_per_param"] == expected and "B/param" in line
    assert (after["host_bytes"], after["device_bytes"], after["cpu_offload"]) == (0, after["total_bytes"], False)


def check_offload_memory(info: dict, line: str, d: int) -> None:
    """bf16 weights (2) + fp32 gradient buffer (4) on the device; on the host fp32 main
    parameters, Adam's moments and fp32 gradient copies, 16/d; no formula."""
    assert info["cpu_offload"] and info["formula_bytes_per_param"] is None and "n/a" in line, line
    assert abs(info["device_bytes_per_param"] / 6 - 1) < 0.01, line
    assert abs(info["host_bytes_per_param"] / (16 / d) - 1) < 0.01, line
    assert info["host_bytes"] + info["device_bytes"] == info["total_bytes"] and "host (cpu)" in line, line


def test_memory_report_separates_host_and_device_under_cpu_offload():
    chunk, optimizer = build(SINGLE, "gpt2", dist_opt=True, params_dtype="bfloat16", cpu_offload=True)
    train_step(chunk, optimizer, SINGLE, 0, 16)
    check_offload_memory(*memory_report([chunk], optimizer, SINGLE), d=1)


def test_adam_and_sgd_use_torchs_foreach_implementation_on_cpu():
    for options in (dict(), dict(dist_opt=True, cpu_offload=True), dict(optimizer="sgd")):
        _, optimizer = build(SINGLE, "gpt2", **options)
        defaults = optimizer.inner.defaults
        assert defaults["foreach"] is True and not defaults.get("fused"), (options, defaults)


# --- spawned --------------------------------------------------------------------------------
def _bf16_check(pstate, dist_opt):
    chunk, optimizer = build(pstate, "gpt2", dist_opt=dist_opt, params_dtype="bfloat16")
    initial = {n: p.detach().float() for n, p in chunk.module.named_parameters()}
    for step in range(2):
        assert train_step(chunk, optimizer, pstate, step, 8)[0]
    mains_fp32 = all(m.main.dtype == torch.float32 for m in optimizer.mains)
    state = optimizer.state_dict()["params"]
    rounded = all(torch.equal(p, state[n]["param"].to(torch.bfloat16)) for n, p in chunk.module.named_parameters())
    # Norm weights move by 2e-3 from 1.0: kept in the fp32 main values, lost in bf16 (spacing 2^-7).
    moved = all(not torch.equal(state[n]["param"], initial[n]) for n in initial)
    return {"mains_fp32": mains_fp32, "model_is_rounded_main": rounded, "all_mains_moved": moved,
            "bf16": all(p.dtype == torch.bfloat16 for p in chunk.module.parameters())}


def _fp16_overflow(pstate):
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("megalite.optimizer.mixed_precision").addHandler(handler)
    chunk, optimizer = build(pstate, "gpt2", params_dtype="float16", grad_dtype=torch.float16, dist_opt=True,
                             initial_loss_scale=1024.0, loss_scale_window=3, hysteresis=2)
    plant = {1: (1, float("inf")), 2: (3, float("nan"))}  # step -> (rank, value)

    def poison(step):
        def before_step():  # into an element this rank's shard owns
            if step in plant and pstate.rank == plant[step][0]:
                owned = optimizer.mains[0]
                owned.param.main_grad.view(-1)[owned.lo] = plant[step][1]
        return before_step
    trace = []
    for step in range(6):
        before = [p.detach().clone() for p in chunk.module.parameters()]
        ok, norm, _ = train_step(chunk, optimizer, pstate, step, 4, before_step=poison(step))
        unchanged = all(torch.equal(a, p) for a, p in zip(before, chunk.module.parameters()))
        trace.append((ok, norm is None, unchanged, optimizer.loss_scale))
    return {"trace": trace, "messages": messages}


def _pipeline_run(pstate, dist_opt, accum=2):
    """PP = 2 with tied embeddings: stage 0 holds the embedding and layer 0, stage 1 layer 1
    and the output layer's tied copy. Activations and their gradients go by send/recv."""
    stage = pstate.pp_rank
    model = make_model(make_config("gpt2"), pstate, layer_numbers=[stage])
    chunk = DistributedDataParallel(model, pstate, use_distributed_optimizer=dist_opt, overlap_grad_reduce=True,
                                    bucket_size=8000)
    optimizer = build_optimizer([chunk], pstate, use_distributed_optimizer=dist_opt, **OPTIM)
    micro = GLOBAL_BATCH // (pstate.dp_size * accum)
    norms = []
    for step in range(3):
        optimizer.zero_grad()
        batches = micro_batches(step, pstate.dp_rank, pstate.dp_size, micro)
        for i, (tokens, labels, mask) in enumerate(batches):
            with chunk.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                if stage == 0:
                    hidden = chunk(tokens)
                    dist.send(hidden.detach().contiguous(), pstate.next_rank)
                    grad = torch.empty_like(hidden)
                    dist.recv(grad, pstate.next_rank)
                    hidden.backward(grad)
                else:
                    hidden = torch.empty(SEQ, micro, model.config.hidden_size)
                    dist.recv(hidden, pstate.prev_rank)
                    hidden.requires_grad_()
                    loss = masked_mean_loss(chunk(hidden_states=hidden, labels=labels), mask) / len(batches)
                    loss.backward()
                    dist.send(hidden.grad.contiguous(), pstate.prev_rank)
        finalize_model_grads([chunk], pstate)
        norms.append(optimizer.step()[1])
    return {"params": full_params(model, None), "norms": norms}


def _resharding(rank, pair, world):
    """Save at DP = 2 with and without the distributed optimizer, resume at DP = 4."""
    dist_opt = rank < 2
    chunk, optimizer = build(pair, "llama", dist_opt=dist_opt)
    for step in range(2):
        train_step(chunk, optimizer, pair, step, 4)
    saved = [optimizer.state_dict(), full_params(chunk.module, None)]
    train_step(chunk, optimizer, pair, 2, 4)
    finished = full_params(chunk.module, None)
    from_dist, from_plain = [None, None], [None, None]
    dist.broadcast_object_list(from_dist if rank else saved, src=0)
    dist.broadcast_object_list(from_plain if rank != 2 else saved, src=2)
    from_dist = saved if rank == 0 else from_dist
    out = {"finished_dp2": finished}
    for load_dist in (True, False):
        resumed, resumed_opt = build(world, "llama", dist_opt=load_dist)
        load_full_weights(resumed.module, from_dist[1].__getitem__)
        resumed_opt.load_state_dict(from_dist[0])
        train_step(resumed, resumed_opt, world, 2, 4)
        out[f"resumed_dp4_dist{int(load_dist)}"] = full_params(resumed.module, None)
    resumed, resumed_opt = build(world, "llama", fsdp=True)
    resumed_opt.load_state_dict(from_dist[0])
    reloaded = resumed_opt.state_dict()
    out["fsdp_state_roundtrip"] = all(torch.equal(reloaded["params"][n][k], v)
                                      for n, entry in from_dist[0]["params"].items() for k, v in entry.items())
    train_step(resumed, resumed_opt, world, 2, 4)
    out["resumed_dp4_fsdp"] = full_params(resumed.module, None)
    if rank == 0:
        out["state_dist"], out["state_plain"] = from_dist[0], from_plain[0]
    return out


def _memory(pstate, fsdp=False, cpu_offload=False):
    chunk, optimizer = build(pstate, "gpt2", dist_opt=not fsdp, fsdp=fsdp, cpu_offload=cpu_offload,
                             params_dtype="float32" if fsdp else "bfloat16")
    train_step(chunk, optimizer, pstate, 0, 4)
    return memory_report([chunk], optimizer, pstate)


def _optimizer_worker(rank, world_size):
    pair = pair_state(rank)
    world = ParallelState.create(ParallelLayout(world_size))
    pipeline = ParallelState.create(ParallelLayout(world_size, pipeline=2))
    out = {"bf16": _bf16_check(pair, dist_opt=rank >= 2), "fp16": _fp16_overflow(world),
           "memory_dp2": _memory(pair), "memory_dp4": _memory(world), "memory_fsdp_dp4": _memory(world, fsdp=True),
           "memory_offload_dp2": _memory(pair, cpu_offload=True)}
    for dist_opt in (False, True):
        result = _pipeline_run(pipeline, dist_opt)
        out[f"pipeline_dist{int(dist_opt)}_stage{pipeline.pp_rank}"] = result if pipeline.dp_rank == 0 else None
    out.update(_resharding(rank, pair, world))
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_optimizer_worker, 4)


def test_bf16_keeps_fp32_main_params_and_rounds_model_params(spawned):
    for rank, result in enumerate(spawned):
        assert result["bf16"] == {"mains_fp32": True, "model_is_rounded_main": True, "all_mains_moved": True,
                                  "bf16": True}, f"rank {rank} (distributed optimizer: {rank >= 2})"


def test_fp16_overflow_skips_that_step_everywhere_and_lowers_the_scale(spawned):
    # (step succeeded, no grad norm returned, params unchanged, loss scale after the step)
    expected = [(True, False, False, 1024.0), (False, True, True, 1024.0), (False, True, True, 512.0),
                (True, False, False, 512.0), (True, False, False, 512.0), (True, False, False, 1024.0)]
    for rank, result in enumerate(spawned):
        assert result["fp16"]["trace"] == expected, f"rank {rank}"
        skips = [m for m in result["fp16"]["messages"] if "skipping" in m]
        assert len(skips) == 2 and "iteration 2" in skips[0] and "iteration 3" in skips[1] and "512" in skips[1], skips


@pytest.mark.parametrize("dist_opt", [0, 1])
def test_pipeline_tied_embeddings_match_single_process(spawned, reference_runs, dist_opt):
    stage0, stage1 = spawned[0][f"pipeline_dist{dist_opt}_stage0"], spawned[2][f"pipeline_dist{dist_opt}_stage1"]
    reference = reference_runs.get(reference_run, "gpt2", 4)
    assert torch.equal(stage1["params"]["output_layer.weight"], stage0["params"]["embedding.word_embeddings.weight"])
    merged = {**stage0["params"], **{k: v for k, v in stage1["params"].items() if k != "output_layer.weight"}}
    assert set(merged) == set(reference["params"])
    for name, expected in reference["params"].items():
        err = rel_error(merged[name], expected)
        assert err <= TOL, f"{name}: {err:.2e}"
    for ours, theirs, ref in zip(stage0["norms"], stage1["norms"], reference["norms"]):
        assert ours == theirs and abs(ours - ref) <= TOL * ref, (ours, ref)


def test_state_dict_is_the_same_with_and_without_distributed_optimizer(spawned):
    with_dist, without = spawned[0]["state_dist"], spawned[0]["state_plain"]
    assert with_dist["step"] == without["step"] == 2 and set(with_dist["params"]) == set(without["params"])
    for name, entry in without["params"].items():
        for key, value in entry.items():
            assert rel_error(with_dist["params"][name][key], value) <= TOL, f"{name}.{key}"


def test_state_dict_saved_at_dp2_resumes_at_dp4_with_either_optimizer_or_fsdp2(spawned):
    finished = spawned[0]["finished_dp2"]
    for rank, result in enumerate(spawned):
        assert result["fsdp_state_roundtrip"], f"rank {rank}: FSDP2 state dict differs from the one it loaded"
        for key in ("resumed_dp4_dist1", "resumed_dp4_dist0", "resumed_dp4_fsdp"):
            for name, expected in finished.items():
                assert rel_error(result[key][name], expected) <= TOL, f"rank {rank} {key} {name}"


@pytest.mark.parametrize("dp", [2, 4])
def test_distributed_optimizer_memory_per_rank_matches_formula(spawned, dp):
    info = spawned[0][f"memory_dp{dp}"][0]
    assert abs(info["optimizer_bytes_per_param"] / (12 / dp) - 1) < 0.01, info
    assert abs(info["bytes_per_param"] / (6 + 12 / dp) - 1) < 0.01, info
    assert info["formula_bytes_per_param"] == 6 + 12 / dp


def test_fsdp2_memory_per_rank_matches_formula(spawned):
    info = spawned[0]["memory_fsdp_dp4"][0]
    assert info["formula_bytes_per_param"] == 16 / 4
    assert abs(info["bytes_per_param"] / (16 / 4) - 1) < 0.01, info


def test_distributed_optimizer_memory_under_cpu_offload_at_dp2(spawned):
    check_offload_memory(*spawned[0]["memory_offload_dp2"], d=2)
