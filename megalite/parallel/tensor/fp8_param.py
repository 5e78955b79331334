"""FP8 weights all-gathered in FP8 under FSDP2 (--fp8-param-gather with --use-torch-fsdp2).

FSDP2's all-gather extension: a sharded parameter whose local tensor has the methods
fsdp_pre_all_gather / fsdp_post_all_gather all-gathers what the first returns and hands the
gathered tensors to the second, whose result is the unsharded parameter the module computes
with (torch.distributed.fsdp's _fsdp_param.py; torchao's float8 weights use it the same way).

- Fp8ShardedWeight: an FP8 linear's fp32 weight as FSDP2 shards it: a wrapper whose ops all run
  on the fp32 tensor it holds (the optimizer updates it, checkpoints save it as that plain fp32
  tensor); only the view / slice / copy ops FSDP2 builds its shard with keep the class
  (KEEPS_CLASS, as torchao's float8 weight keeps its own). Its fsdp_pre_all_gather casts the
  shard to FP8 with the weight's scale: the all-gather moves one byte per element instead of two
  (bf16) or four (fp32). The cast is the fused one (megalite/kernels/fp8_cast.py, one Triton
  pass on a contiguous CUDA shard: with delayed scaling the amax goes into the history from the
  same read; tensorwise, the amax pass of GatheredWeightScales too) where it applies, the torch
  ops elsewhere, with the same bytes, scale and amax.
- Fp8GatheredWeight: the unsharded parameter: the gathered FP8 weight and its scale, with the
  shape and dtype of the 16-bit weight (what autograd and FSDP2 see; the weight gradient is an
  ordinary 16-bit / fp32 tensor, reduce-scattered as before). Fp8Gemm multiplies its FP8 data
  directly (no second quantization); it supports no other computation.

The weight's scale (the same on every rank of the FSDP2 group, since the shards are cast before
the gather and multiplied with one scale after it):
- delayed scaling: the linear's history scale; the shard's amax goes into the history, and the
  step's MAX reduction over TP and DP x CP (the FSDP2 group) makes it the whole weight's.
- tensorwise: fp8_max / amax of the whole weight: the shards' amaxes MAX-reduced over the FSDP2
  group and TP. GatheredWeightScales computes all of a rank's weights' scales with one
  all-reduce per group after the optimizer step (torchao's
  precompute_float8_dynamic_scale_for_fsdp); a weight changed since (a checkpoint load, the
  first step: the shard's version counter tells) reduces its own amax in the hook.
"""

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from megalite.kernels.fp8_cast import fp8_amax, fp8_cast
from megalite.parallel.tensor.fp8_fused_cast import fused_quantize
from megalite.parallel.tensor.fp8_scaling import FP8_MAX, WEIGHT, DelayedScaling, scale_from_amax

# the ops FSDP2 builds and updates its shard with, which keep the class (the others: plain results)
_ATEN = torch.ops.aten
KEEPS_CLASS = {_ATEN.detach.default, _ATEN.alias.default, _ATEN.view.default, _ATEN.as_strided.default,
               _ATEN.slice.Tensor, _ATEN.split.Tensor, _ATEN.split_with_sizes.default, _ATEN.new_zeros.default,
               _ATEN.empty_like.default, _ATEN.clone.default, _ATEN.copy_.default, _ATEN._to_copy.default}


class Fp8ShardedWeight(torch.Tensor):
    """An FP8 linear's weight (`tensor`, fp32: the main parameter) whose FSDP2 all-gather is in
    FP8. A wrapper: every op runs on `tensor`, and only those in KEEPS_CLASS wrap their result."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, tensor.size(), strides=tensor.stride(),
                                                   storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                   device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __repr__(self):
        return f"Fp8ShardedWeight({self.tensor})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(cls, lambda t: t.tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in KEEPS_CLASS:
            return out
        return tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, _meta, _outer_size, _outer_stride):
        return Fp8ShardedWeight(inner["tensor"])

    def __reduce_ex__(self, protocol):
        """Saved (torch.save, checkpoints) as the plain fp32 tensor it wraps."""
        return self.tensor.__reduce_ex__(protocol)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """(the shard in FP8, padded to FSDP2's shard size), (its scale,); `module` is the linear."""
        data, scale = cast_shard(module.gemm, self.tensor, mesh.get_group())
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads every shard to the first's rows
        if data.shape[0] < rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data,), (scale,)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,), (scale,) = outputs, metadata
        if out is not None:  # later gathers land in the same buffer: only the scale is new
            out.fp8_scale = scale
            return None
        return Fp8GatheredWeight(data, scale, param_dtype), (data,)


class Fp8GatheredWeight(torch.Tensor):
    """The all-gathered FP8 weight (`fp8_data`, `fp8_scale`: data = fp8(weight * scale)) in the
    shape and dtype of the 16-bit weight; only Fp8Gemm computes with it."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.fp8_data, self.fp8_scale = data, scale

    def __repr__(self):
        return f"Fp8GatheredWeight({tuple(self.shape)}, {self.fp8_data.dtype}, scale={self.fp8_scale.item():g})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        weight = args[0]
        whole_view = func in (_ATEN.view.default, _ATEN.as_strided.default) and tuple(args[1]) == tuple(weight.shape)
        if func in (_ATEN.detach.default, _ATEN.alias.default) or whole_view:  # nn.Parameter, FSDP2, autograd
            return cls(weight.fp8_data, weight.fp8_scale, weight.dtype)
        raise NotImplementedError(f"{func}: a weight all-gathered in FP8 (--fp8-param-gather) is only "
                                  "multiplied by its FP8 linear's GEMMs")


def cast_shard(gemm, shard: torch.Tensor, fsdp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """(`shard` in FP8, its scale): delayed scaling in one fused pass where it applies (the cast
    and the amax into the history); else the scale (gathered_weight_scale), then the cast."""
    dtype = gemm.recipe.dtype(WEIGHT)
    if isinstance(gemm.scaling, DelayedScaling):
        fused = fused_quantize(gemm.scaling, WEIGHT, shard, True, True, dtype, gemm.cast_impl)
        if fused is not None:
            return fused
    scale = gathered_weight_scale(gemm, shard, fsdp_group)
    return fp8_cast(shard, scale, dtype, impl=gemm.cast_impl), scale


def gathered_weight_scale(gemm, shard: torch.Tensor, fsdp_group) -> torch.Tensor:
    """The scale `gemm`'s weight is cast to FP8 with before its all-gather."""
    if isinstance(gemm.scaling, DelayedScaling):
        return gemm.scaling.scale(WEIGHT, shard, split=True, record=True)
    version, scale = gemm.gathered_weight_scale
    if version != shard._version:
        scale = tensorwise_scales([gemm], [shard], (fsdp_group, gemm.scaling.group))[0]
        gemm.gathered_weight_scale = (shard._version, scale)
    return scale


def tensorwise_scales(gemms, shards, groups) -> torch.Tensor:
    """fp8_max / amax of each whole weight: the shards' amaxes (one tensor) MAX-reduced over `groups`."""
    amax = torch.stack([fp8_amax(s, impl=g.cast_impl) for g, s in zip(gemms, shards)])
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    fp8_max = torch.tensor([FP8_MAX[g.recipe.dtype(WEIGHT)] for g in gemms], device=amax.device)
    return scale_from_amax(amax, fp8_max, 0, torch.ones_like(amax))


class GatheredWeightScales:
    """The tensorwise scales of a rank's FP8-gathered weights, all computed after the optimizer
    step with one all-reduce per group (FSDP2's, then TP's). `linears`: (linear, its gemm)."""

    def __init__(self, linears, fsdp_group, tp_group):
        self.linears, self.groups = list(linears), (fsdp_group, tp_group)

    def after_optimizer_step(self) -> None:
        if not self.linears:
            return
        shards = [linear.weight.to_local().tensor for linear, _ in self.linears]
        gemms = [gemm for _, gemm in self.linears]
        for gemm, shard, scale in zip(gemms, shards, tensorwise_scales(gemms, shards, self.groups)):
            gemm.gathered_weight_scale = (shard._version, scale)
