"""The per-step FP8 weight cache (fp8_gemm.py's WeightCache): each FP8 weight is cast once per
optimizer step (not once per micro-batch, nor again in dgrad or a recomputed forward), and the
run's numbers are bit-identical to recasting the weight at every use: one process, fp32, SGD,
3 steps of 2 micro-batches, delayed (hybrid, history 2, max), tensorwise (e4m3) and blockwise, full
recompute of every layer, and an evaluation (no_grad) forward before the second step (the cast
it makes records no amax; the training forward that reuses it must record the weight's)."""

import pytest
import torch

from megalite.model.fp8 import enable_fp8_chunks
from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.parallel.tensor import fp8_blockwise, fp8_gemm
from megalite.parallel.tensor.fp8_gemm import Fp8Gemm
from megalite.parallel.tensor.fp8_scaling import Fp8Recipe
from tests.parallel.pipeline.pipeline_cases import INIT_SEED, make_config, microbatches
from tests.parallel.train_step import train_step

STEPS, M = 3, 2
RECIPES = {"delayed-hybrid": Fp8Recipe(format="hybrid", amax_history_len=2, amax_compute_algo="max"),
           "tensorwise-e4m3": Fp8Recipe(format="e4m3", scaling="tensorwise"),
           "blockwise-hybrid": Fp8Recipe(format="hybrid", scaling="blockwise")}
OPTIM = dict(optimizer="sgd", lr=0.5, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0)


def _run(recipe: Fp8Recipe, monkeypatch, cached: bool) -> dict:
    """Losses, gradients and weights of every step, and the weight casts made in each step."""
    pstate = ParallelState.create(ParallelLayout(1))
    config = make_config("gpt2", recompute_granularity="full", recompute_num_layers=1)
    models = build_model_chunks(config, pstate, init_seed=INIT_SEED)
    update = enable_fp8_chunks(models, recipe, config.num_layers, pstate)
    weights = {m.weight.data_ptr() for m in models[0].modules() if isinstance(getattr(m, "gemm", None), Fp8Gemm)}
    casts, real_quantize, real_lookup = [0], fp8_gemm.quantize, Fp8Gemm._cached_weight

    def counting_quantize(tensor, scale, dtype):
        casts[0] += tensor.data_ptr() in weights
        return real_quantize(tensor, scale, dtype)

    def uncached_lookup(gemm, weight, record, column_major):  # the reference: a fresh cast at every use
        gemm.drop_weight_cache()
        return real_lookup(gemm, weight, record, column_major)

    def counting_block_cast(tensor, dtype):  # blockwise: only weights are cast in 128x128 blocks
        casts[0] += 1
        return real_block_cast(tensor, dtype)

    real_block_cast = fp8_blockwise.quantize_128x128
    monkeypatch.setattr(fp8_gemm, "quantize", counting_quantize)
    monkeypatch.setattr(fp8_blockwise, "quantize_128x128", counting_block_cast)
    monkeypatch.setattr(Fp8Gemm, "_cached_weight", real_lookup if cached else uncached_lookup)
    chunks = [DistributedDataParallel(m, pstate) for m in models]
    optimizer = build_optimizer(chunks, pstate, **OPTIM)
    out = {"losses": [], "grads": [], "params": [], "casts": [], "linears": len(weights)}
    for step in range(STEPS):
        casts[0] = 0
        if step == 1:
            with torch.no_grad():
                gpt_forward_step(chunks[0], microbatches(1, seed=99)[0], None)
        optimizer.zero_grad()
        out["losses"].append(train_step(chunks, pstate, microbatches(M, seed=step), gpt_forward_step))
        out["grads"].append([p.main_grad.clone() for p in chunks[0].parameters()])
        optimizer.step()
        update.after_optimizer_step()
        out["params"].append([p.detach().clone() for p in chunks[0].parameters()])
        out["casts"].append(casts[0])
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("name", list(RECIPES))
def test_weights_cast_once_per_step_and_the_run_is_bit_identical(monkeypatch, name):
    cached = _run(RECIPES[name], monkeypatch, cached=True)
    reference = _run(RECIPES[name], monkeypatch, cached=False)
    linears = cached["linears"]
    assert linears > 0 and cached["casts"] == [linears] * STEPS
    # recasting at every use: forward, recompute and dgrad of each micro-batch (+ the evaluation forward)
    assert reference["casts"] == [3 * M * linears + (linears if step == 1 else 0) for step in range(STEPS)]
    assert cached["losses"] == reference["losses"]
    for key in ("grads", "params"):
        for step, (a, b) in enumerate(zip(cached[key], reference[key])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (key, step)


def test_a_cuda_graph_capture_casts_the_weight_at_every_use(monkeypatch):
    """--cuda-graph-impl local: a captured layer replays after optimizer steps no Python sees, so
    while a graph is captured the weight is cast inside it (every use), never read from the cache."""
    from tests.parallel.tensor.test_fp8_gemm import _fp8_linear, _operands
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    real, casts = fp8_gemm.quantize, []
    x, w, b, dy = _operands()

    def counting_quantize(tensor, scale, dtype):
        casts.append(tuple(tensor.shape) == tuple(w.shape))
        return real(tensor, scale, dtype)

    monkeypatch.setattr(fp8_gemm, "quantize", counting_quantize)
    _fp8_linear(Fp8Recipe(format="hybrid", scaling="tensorwise"), x, w, b, dy)
    assert sum(casts) == 2  # fprop and dgrad, as without the cache
