"""The FP8 GEMMs of a linear layer (--fp8-format): the Gemm strategy of gemm.py with each GEMM's
operands quantized per tensor (fp8_scaling.py) and multiplied by torch._scaled_mm, which
applies the inverse scales and writes a 16-bit or fp32 result.

    y     = x W^T     fprop:  x (e4m3) and W (e4m3)
    dgrad = dy W      dgrad:  dy (e4m3, or e5m2 with --fp8-format hybrid) and W
    wgrad = dy^T x    wgrad:  dy and x, unless --no-fp8-wgrad (then the 16-bit GEMM)

_scaled_mm takes its first operand row-major and its second column-major (cuBLASLt's FP8
layout, "TN"), hence the transposed copies below. The operands are quantized again in backward
rather than kept in FP8 from forward (the saved tensors are the 16-bit ones the layer already
keeps): with delayed scaling the scales cannot change within a step, and with tensorwise
scaling the same tensor gives the same amax, so backward quantizes exactly as forward did.

A backward that runs both dgrad and wgrad casts dy once (shared_grad: one pass writing dy
row-major for dgrad and transposed for wgrad, the amax recorded once; Transformer Engine's
cast_transpose); a zero-bubble B pass (dgrad alone) and W pass (wgrad alone) each cast the
layout they need.

The weight is the exception (Transformer Engine's is_first_microbatch cache): its FP8 copy, and
the column-major copy dgrad needs, are cast once and reused by every later micro-batch, the
backward and a recomputed forward, until the weight changes; a cache filled by dgrad writes both
copies in the one pass that reads the weight, one filled by a forward only the first (the first
dgrad then copies it: _cached_weight says why). WeightCache says when: the same
weight (or a detached alias of it) at the same version counter (an optimizer step or a
checkpoint load writes it in place) and, with delayed scaling, the same scales version (their
update after each step and a checkpoint load write them in place); Fp8StepUpdate
(model/fp8.py) also drops every cache after the optimizer step, freeing it. Not while a CUDA
graph is captured (_capturing_cuda_graph). The numbers are the ones an uncached cast gives: the
same weight with the same scale casts to the same bytes.

Which operands are split over the tensor-parallel group decides whose amax a tensorwise scale
needs reduced: the weight always; a column-parallel layer's output gradient (its columns); a
row-parallel layer's input (its features). The other operands are whole on every rank.
"""

import weakref
from dataclasses import dataclass

import torch

from megalite.parallel.tensor.fp8_param import Fp8GatheredWeight
from megalite.parallel.tensor.fp8_fused_cast import fused_quantize
from megalite.parallel.tensor.fp8_scaling import GRAD, INPUT, WEIGHT, DelayedScaling, Fp8Recipe, quantize
from megalite.parallel.tensor.gemm import Gemm


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _capturing_cuda_graph() -> bool:
    """Whether a CUDA graph is being captured (--cuda-graph-impl local): a captured layer must
    cast its weight inside the graph, not read a cast made before the capture (its replays come
    after optimizer steps that no Python code sees), so the weight cache is bypassed then."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a / a_scale) @ (b / b_scale) for FP8 `a` [m, k] and `b` [k, n], accumulated in fp32."""
    return torch._scaled_mm(a.contiguous(), _column_major(b), scale_a=a_scale.reciprocal(),
                            scale_b=b_scale.reciprocal(), out_dtype=out_dtype)


@dataclass
class SharedGrad:
    """The output gradient cast once for a backward's dgrad and wgrad: `rows` [tokens, out] for
    dgrad (dropped once used), `transposed` [out, tokens] for wgrad, and their scale."""

    rows: torch.Tensor | None
    transposed: torch.Tensor
    scale: torch.Tensor


@dataclass
class WeightCache:
    """A weight's FP8 cast (`data` = fp8(weight * scale)) and its column-major copy (written by the
    same cast when dgrad filled the cache, else copied once dgrad asks);
    valid while the weight is `weight` (or an alias of it) at `version` and the scales at
    `scales_version`. `recorded`: whether the weight's amax went into the delayed history (not
    when the cast was made by an evaluation forward)."""

    weight: weakref.ref
    version: int
    scales_version: int | None
    data: torch.Tensor
    scale: torch.Tensor
    recorded: bool
    column_major: torch.Tensor | None = None

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is the cached weight or an alias of it (a recomputed forward's and a
        checkpointed backward's weight is a detached alias: same storage, same version counter),
        unchanged since the cast."""
        cached = self.weight()
        return (cached is not None and weight._version == self.version
                and weight.untyped_storage()._cdata == cached.untyped_storage()._cdata
                and weight.storage_offset() == cached.storage_offset()
                and weight.shape == cached.shape and weight.stride() == cached.stride())


class Fp8Gemm(Gemm):
    """One linear's FP8 GEMMs. `scaling`: a TensorwiseScaling or this layer's DelayedScaling;
    `parallel_mode`: "column" or "row" (which operands are split over tensor parallelism)."""

    name = "fp8"

    def __init__(self, recipe: Fp8Recipe, scaling, parallel_mode: str, cast_impl: str = "auto"):
        self.recipe, self.scaling = recipe, scaling
        self.cast_impl = cast_impl  # megalite.kernels impl of the casts (fp8_fused_cast.py)
        # whether forward records amaxes: set before each forward by the layer's pre-hook
        # (model/fp8.py) to the caller's grad mode, so that evaluation (no_grad) does not move
        # training's scales; inside the autograd Function grad mode is always off
        self.record_forward = True
        self.split = {INPUT: parallel_mode == "row", WEIGHT: True, GRAD: parallel_mode == "column"}
        # --fp8-param-gather under FSDP2, tensorwise: (the weight shard's version, the scale it is
        # cast with before the all-gather), set by fp8_param.py
        self.gathered_weight_scale = (None, None)
        self.weight_cache: WeightCache | None = None

    def drop_weight_cache(self) -> None:
        self.weight_cache = None

    def _scales_version(self):
        return self.scaling.scales._version if isinstance(self.scaling, DelayedScaling) else None

    def _cached_weight(self, weight, record: bool, column_major: bool) -> WeightCache:
        """The weight's cache, filled anew when stale: with its column-major copy from the same
        pass when `column_major` (dgrad asks). A forward's fill leaves the copy to the first dgrad:
        made then, it is not held through a pipeline's warm-up forwards, where a stage's peak is
        (1 byte per weight element; the pass would save only about as much traffic per step)."""
        cache = self.weight_cache
        if cache is None or not cache.holds(weight) or cache.scales_version != self._scales_version():
            data, data_column_major, scale = self._cast_weight(weight, record, column_major)
            cache = WeightCache(weakref.ref(weight), weight._version, self._scales_version(), data, scale,
                                recorded=record or not isinstance(self.scaling, DelayedScaling),
                                column_major=data_column_major)
            self.weight_cache = cache
        elif record and not cache.recorded:  # cast by an evaluation forward: record its amax now
            self.scaling.scale(WEIGHT, weight, self.split[WEIGHT], record=True)
            cache.recorded = True
        return cache

    def _cast_weight(self, weight, record: bool, column_major: bool):
        """(FP8 weight, its column-major copy when asked else None, scale)."""
        if not column_major:
            data, scale = self._quantized(WEIGHT, weight, record)
            return data, None, scale
        (data, data_t), scale = self._quantized(WEIGHT, weight, record, layout="both")
        return data, data_t.t(), scale

    def _quantized(self, operand: int, tensor: torch.Tensor, record: bool, layout: str = "rows"):
        """The FP8 copy and its scale; `layout` "transposed": of 2-D `tensor` transposed
        (contiguous); "both": (row-major copy, transposed copy) from one cast."""
        dtype = self.recipe.dtype(operand)
        fused = fused_quantize(self.scaling, operand, tensor, self.split[operand], record, dtype, self.cast_impl,
                               layout)
        if fused is not None:  # the Triton cast (CUDA): the same bytes, scale and amax as below
            return fused
        scale = self.scaling.scale(operand, tensor, self.split[operand], record)
        data = quantize(tensor, scale, dtype)
        if layout == "rows":
            return data, scale
        transposed = data.t().contiguous()
        return ((data, transposed) if layout == "both" else transposed), scale

    def _weight(self, weight, record: bool, column_major: bool = False):
        """The FP8 weight (column-major if asked) and its scale: as all-gathered
        (--fp8-param-gather under FSDP2, cast and recorded before the gather: fp8_param.py; not
        cached), or this step's cached cast."""
        if isinstance(weight, Fp8GatheredWeight):
            return weight.fp8_data, weight.fp8_scale
        if _capturing_cuda_graph():  # the graph must hold the cast: its replays follow weight updates
            return self._quantized(WEIGHT, weight, record)
        cache = self._cached_weight(weight, record, column_major)
        if not column_major:
            return cache.data, cache.scale
        if cache.column_major is None:
            cache.column_major = _column_major(cache.data)
        return cache.column_major, cache.scale

    def fprop(self, x, weight, bias):
        """Records the input's and weight's amaxes when `record_forward` (not in evaluation)."""
        x2d = x.reshape(-1, x.shape[-1])
        xq, x_scale = self._quantized(INPUT, x2d, record=self.record_forward)
        wq, w_scale = self._weight(weight, record=self.record_forward)
        y = scaled_mm(xq, x_scale, wq.t(), w_scale, x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    def shared_grad(self, grad2d) -> SharedGrad | None:
        """dy cast once, row-major and transposed (None with --no-fp8-wgrad: wgrad takes dy itself)."""
        if not self.recipe.wgrad:
            return None
        (rows, transposed), scale = self._quantized(GRAD, grad2d, record=True, layout="both")
        return SharedGrad(rows, transposed, scale)

    def dgrad(self, grad, weight, shared: SharedGrad | None = None):
        if shared is None:
            gq, g_scale = self._quantized(GRAD, grad.reshape(-1, grad.shape[-1]), record=True)
        else:  # wgrad needs only the transposed copy: this one is freed with dgrad's operands
            gq, g_scale, shared.rows = shared.rows, shared.scale, None
        wq, w_scale = self._weight(weight, record=False, column_major=True)  # as in forward
        return scaled_mm(gq, g_scale, wq, w_scale, grad.dtype).reshape(*grad.shape[:-1], weight.shape[1])

    def _fp8_wgrad(self, grad2d, x2d, out_dtype, shared: SharedGrad | None):
        # dy^T row-major and x column-major, as _scaled_mm takes them: cast transposed
        if shared is None:
            gq_t, g_scale = self._quantized(GRAD, grad2d, record=True, layout="transposed")
        else:
            gq_t, g_scale = shared.transposed, shared.scale
        xq_t, x_scale = self._quantized(INPUT, x2d, record=False, layout="transposed")  # as in forward
        return scaled_mm(gq_t, g_scale, xq_t.t(), x_scale, out_dtype)

    def wgrad(self, grad2d, x2d, shared: SharedGrad | None = None):
        if not self.recipe.wgrad:
            return super().wgrad(grad2d, x2d)
        return self._fp8_wgrad(grad2d, x2d, x2d.dtype, shared)

    def wgrad_accumulate(self, main_grad, grad2d, x2d, shared: SharedGrad | None = None):
        """_scaled_mm has no accumulate input (torch 2.13): an fp32 result, then added."""
        if not self.recipe.wgrad:
            return super().wgrad_accumulate(main_grad, grad2d, x2d)
        main_grad.add_(self._fp8_wgrad(grad2d, x2d, torch.float32, shared))
