"""The fused FP8 cast (megalite/kernels/fp8_cast_triton.py) against the torch path it replaces on
CUDA (fp8_cast.fp8_cast_reference, fp8_scaling.quantize's ops): the FP8 bytes and the amax bit for
bit, and an FP8 linear (fp8_gemm.py) whose casts go through it gives the torch path's outputs,
gradients, amax history and scales bit for bit."""

import pytest
import torch

from megalite.kernels import fp8_cast as fp8_cast_module
from megalite.kernels.fp8_cast import (fp8_amax, fp8_amax_reference, fp8_cast, fp8_cast_reference,
                                      fp8_cast_transpose, fp8_cast_transposed)
from megalite.parallel.tensor import fp8_gemm
from megalite.parallel.tensor.fp8_gemm import Fp8Gemm
from megalite.parallel.tensor.fp8_scaling import DelayedScaling, Fp8Recipe, TensorwiseScaling
from megalite.parallel.tensor.linear_function import tensor_parallel_linear
from tests.kernels.checks import EDGE_SHAPES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _assert_same_cast(x, scale, dtype, amax_before, every_path=False):
    amax, expected_amax = torch.tensor(amax_before, device=x.device), torch.tensor(amax_before)
    y = fp8_cast(x, scale, dtype, amax=amax, impl="triton")
    expected = fp8_cast_reference(x.cpu(), scale.cpu(), dtype, expected_amax)
    where = f"{tuple(x.shape)} {x.dtype} -> {dtype}"
    assert y.dtype == dtype and y.shape == x.shape, where
    mismatch = (y.cpu().view(torch.uint8) != expected.view(torch.uint8)).sum()
    assert mismatch == 0, f"{where}: {int(mismatch)} bytes differ"
    exact = dict(rtol=0, atol=0, equal_nan=True)  # NaN where torch's amax is NaN, else the same value
    torch.testing.assert_close(amax.cpu(), expected_amax, **exact, msg=f"{where}: amax {amax} vs {expected_amax}")
    amax_t = torch.tensor(amax_before, device=x.device)
    y_t = fp8_cast_transposed(x.reshape(-1, x.shape[-1]), scale, dtype, amax=amax_t, impl="triton")
    assert torch.equal(y_t.cpu().view(torch.uint8), expected.reshape(-1, x.shape[-1]).t().view(torch.uint8)), where
    torch.testing.assert_close(amax_t.cpu(), expected_amax, **exact, msg=f"{where}: transposed cast's amax")
    amax_both = torch.tensor(amax_before, device=x.device)  # cast_transpose: both layouts from one pass
    y_rows, y_cols = fp8_cast_transpose(x.reshape(-1, x.shape[-1]), scale, dtype, amax=amax_both, impl="triton")
    assert torch.equal(y_rows.cpu().view(torch.uint8), expected.reshape(-1, x.shape[-1]).view(torch.uint8)), where
    assert torch.equal(y_cols.cpu().view(torch.uint8), expected.reshape(-1, x.shape[-1]).t().view(torch.uint8)), where
    assert y_rows.is_contiguous() and y_cols.is_contiguous(), where
    torch.testing.assert_close(amax_both.cpu(), expected_amax, **exact, msg=f"{where}: cast_transpose's amax")
    if every_path:  # the amax pass alone, and the cast recording nothing (tensorwise scaling's two passes)
        torch.testing.assert_close(fp8_amax(x, impl="triton").cpu(), fp8_amax_reference(x.cpu()), **exact, msg=where)
        assert torch.equal(fp8_cast(x, scale, dtype, impl="triton").cpu().view(torch.uint8), expected.view(torch.uint8))
        both = fp8_cast_transpose(x, scale, dtype, impl="triton")  # recording nothing
        assert torch.equal(both[1].cpu().view(torch.uint8), expected.t().view(torch.uint8)), where


def test_the_cast_and_amax_equal_torch_bit_for_bit(device):
    g = torch.Generator().manual_seed(0)
    # bf16, both formats, an amax below and above x's; (150, 70): programs looping over row tiles
    for i, (rows, cols) in enumerate(EDGE_SHAPES + [(150, 70)]):
        x = (torch.randn(rows, cols, generator=g) * 30).to(torch.bfloat16).to(device)
        dtype = (E4M3, E5M2)[i % 2]
        _assert_same_cast(x, torch.tensor(7.0, device=device), dtype, (0.0, 1e4)[i % 3 == 0])
    # fp32 over several blocks and programs: saturation (scaled past both maxima), ties, subnormals,
    # zeros of both signs; then a NaN, which the cast keeps and the amax reports
    x = (torch.randn(5000, generator=g) * torch.logspace(-9, 2, 5000)).reshape(50, 100)
    x[0, :6] = torch.tensor([1e6, -1e6, 0.0, -0.0, 14.0, -12.4])
    for dtype in (E4M3, E5M2):
        _assert_same_cast(x.to(device), torch.tensor(100.0, device=device), dtype, 0.0, every_path=True)
    x[7, 3] = -float("inf")  # an infinite amax (the tiled kernel's int32 max: just below every NaN)
    _assert_same_cast(x.to(device), torch.tensor(3.0, device=device), E5M2, 2.0)
    x[43, 21] = float("nan")
    _assert_same_cast(x.to(device), torch.tensor(3.0, device=device), E4M3, 2.0, every_path=True)


def _two_steps(recipe, impl, device):
    """Two forward/backward passes of one FP8 linear with a scale update between (delayed):
    outputs, gradients and the scaling state; the second accumulates its weight gradient into
    main_grad inside the GEMM (gradient accumulation fusion: wgrad_accumulate)."""
    g = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(2, 8, 48, generator=g) * 3, torch.randn(32, 48, generator=g) * 0.05,
               torch.randn(32, generator=g))
    dy = torch.randn(2, 8, 32, generator=g) * 1e-3  # 16 tokens: _scaled_mm on CUDA wants multiples of 16
    x, w, b, dy = (t.to(device) for t in (x, w, b, dy))
    scaling = DelayedScaling(recipe, device) if recipe.scaling == "delayed" else TensorwiseScaling(recipe)
    gemm = Fp8Gemm(recipe, scaling, "column", cast_impl=impl)
    out = []
    for step in range(2):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x * (step + 1), w, b))
        if step == 1:
            ws.main_grad, ws.fuse_wgrad_accumulation = torch.ones(32, 48, device=device), True
        y = tensor_parallel_linear(xs, ws, bs, gemm)
        y.backward(dy)
        out += [y.detach(), xs.grad, ws.grad if step == 0 else ws.main_grad, bs.grad]
        if isinstance(scaling, DelayedScaling):
            out += [scaling.amax_history.clone()]
            scaling.update()
            out += [scaling.scales.clone()]
    return out


@pytest.mark.parametrize("scaling", ["delayed", "tensorwise"])
def test_an_fp8_linear_casts_through_the_fused_kernel(device, monkeypatch, scaling):
    """With impl "auto" on CUDA (dispatch's choice for CUDA tensors stood in for by making it pick
    Triton here), every cast of the linear is the fused kernel's: delayed scaling one pass per
    cast, recording where the torch path records; tensorwise an amax pass then a cast pass.
    Backward casts dy once, row-major and transposed in one pass (the old code cast it twice),
    and the weight's cast is one pass (its column-major copy for dgrad a copy of that cast, made
    by the first dgrad, not held through pipeline warm-up forwards). No torch
    quantize runs, and the numbers are the torch path's."""
    from megalite.kernels import fp8_cast_triton

    recipe = Fp8Recipe(format="hybrid", scaling=scaling)
    reference = _two_steps(recipe, "torch", device)
    launches, torch_casts = [], []
    real_launch, real_transposed = fp8_cast_triton._launch, fp8_cast_triton._launch_transposed
    real_quantize = fp8_gemm.quantize

    def launch(x, scale, y, amax, cast, record_amax, *rest):
        launches.append((tuple(x.shape), "rows" if cast else "amax", record_amax))
        return real_launch(x, scale, y, amax, cast, record_amax, *rest)

    def launch_transposed(x2d, scale, yt, y, amax, record_amax, *rest):
        launches.append((tuple(x2d.shape), "transposed" if y is None else "both", record_amax))
        return real_transposed(x2d, scale, yt, y, amax, record_amax, *rest)

    monkeypatch.setattr(fp8_cast_triton, "_launch", launch)
    monkeypatch.setattr(fp8_cast_triton, "_launch_transposed", launch_transposed)
    monkeypatch.setattr(fp8_gemm, "quantize", lambda *args: torch_casts.append(1) or real_quantize(*args))
    monkeypatch.setattr(fp8_cast_module, "use_triton", lambda op, impl, *tensors: impl == "auto")
    fused = _two_steps(recipe, "auto", device)
    assert not torch_casts
    # per step: fprop x; W (each step's weight is a new tensor: cast anew); dy once for dgrad and
    # wgrad; wgrad's x transposed (_scaled_mm's layout)
    x, w, dy = (16, 48), (32, 48), (16, 32)
    casts = [(x, "rows"), (w, "rows"), (dy, "both"), (x, "transposed")]
    records = [True, True, True, False]  # delayed: what the torch path records (x in backward: as in forward)
    if scaling == "delayed":  # one pass a cast
        assert launches == 2 * [(shape, kind, r) for (shape, kind), r in zip(casts, records)]
    else:  # an amax pass, then the cast
        assert launches == 2 * [pair for shape, kind in casts for pair in ((shape, "amax", True), (shape, kind, False))]
    assert sum(shape == dy and kind != "amax" for shape, kind, _ in launches) == 2  # one cast of dy a step
    for i, (a, b) in enumerate(zip(fused, reference)):
        assert torch.equal(a, b), f"result {i} differs"


class _Mesh:  # what Fp8ShardedWeight's all-gather hook asks of FSDP2's mesh (one process: no group)
    def size(self):
        return 2

    def get_group(self):
        return None


def _cast_shard_twice(recipe, impl, shard):
    """--fp8-param-gather: the shard's FP8 bytes, scale and scaling state of two all-gathers."""
    from torch import nn

    from megalite.parallel.tensor.fp8_param import Fp8ShardedWeight

    linear = nn.Module()
    scaling = DelayedScaling(recipe, shard.device) if recipe.scaling == "delayed" else TensorwiseScaling(recipe)
    linear.gemm = Fp8Gemm(recipe, scaling, "column", cast_impl=impl)
    out = []
    for _ in range(2):
        (data,), (scale,) = Fp8ShardedWeight(shard).fsdp_pre_all_gather(
            _Mesh(), torch.Size([2 * shard.shape[0], shard.shape[1]]), (shard.shape[1], 1), linear, None)
        out += [data.view(torch.uint8), scale]
        if recipe.scaling == "delayed":
            out += [scaling.amax_history.clone()]
    return out


@pytest.mark.parametrize("scaling", ["delayed", "tensorwise"])
def test_fp8_param_gather_casts_the_shard_through_the_fused_kernel(device, monkeypatch, scaling):
    """--fp8-param-gather under FSDP2: the fp32 shard (odd shape) is cast by the fused kernel where
    it applies (delayed: one pass, its amax into the history; tensorwise: the amax pass once,
    while the weight is unchanged, then a cast per gather), with the torch path's bytes, scale
    and amax history."""
    from megalite.kernels import fp8_cast_triton

    recipe = Fp8Recipe(format="hybrid", scaling=scaling)
    shard = (torch.randn(5, 7, generator=torch.Generator().manual_seed(2)) * 3).to(device)
    reference = _cast_shard_twice(recipe, "torch", shard)
    launches, real_launch = [], fp8_cast_triton._launch
    monkeypatch.setattr(fp8_cast_triton, "_launch", lambda *args: launches.append(args[4:6]) or real_launch(*args))
    monkeypatch.setattr(fp8_cast_module, "use_triton", lambda op, impl, *tensors: impl == "auto")
    fused = _cast_shard_twice(recipe, "auto", shard)
    cast, amax_pass, record = (True, False), (False, True), (True, True)
    assert launches == ([record, record] if scaling == "delayed" else [amax_pass, cast, cast])
    for i, (a, b) in enumerate(zip(fused, reference)):
        assert torch.equal(a, b), f"result {i} differs"
