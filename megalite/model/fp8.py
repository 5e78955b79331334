"""Which linears of a model run in FP8 (--fp8-format), as Megatron with Transformer Engine:
every column- and row-parallel linear of a decoder layer's attention and MLP (the shared expert
of an MoE layer included), except the first and last N layers under --first-last-layers-bf16.
The embedding, the output layer and multi-token-prediction layers stay 16-bit, and so do the
routed experts of MoE layers (their grouped GEMM has no FP8 path), the router and the
attention core (no FP8 attention: --fp8-dot-product-attention is refused).
"""

import torch

from megalite.model.transformer import TransformerLayer
from megalite.parallel.tensor.fp8_gemm import Fp8Gemm
from megalite.parallel.tensor.fp8_scaling import DelayedScaling, DelayedScalingStates, Fp8Recipe, TensorwiseScaling
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


def enable_fp8(model, recipe: Fp8Recipe, num_layers: int, tp_group=None) -> dict[str, DelayedScaling]:
    """Give each FP8 linear of `model` (one model chunk, unwrapped) an Fp8Gemm; returns the
    delayed-scaling states by parameter-path name (empty for tensorwise scaling). Layers are
    numbered globally, so the names are the same on every pipeline layout."""
    states = {}
    for layer_name, layer in model.named_modules():
        if not isinstance(layer, TransformerLayer) or not recipe.is_fp8_layer(layer.layer_number, num_layers):
            continue
        for linear_name, linear in layer.named_modules():
            if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if recipe.scaling == "delayed":
                scaling = DelayedScaling(recipe, device=linear.weight.device)
                states[f"{layer_name}.{linear_name}"] = scaling
            else:
                scaling = TensorwiseScaling(recipe, tp_group)
            linear.gemm = Fp8Gemm(recipe, scaling, "column" if isinstance(linear, ColumnParallelLinear) else "row")
            linear.register_forward_pre_hook(_record_when_training)
    return states


def _record_when_training(linear, _inputs) -> None:
    """A forward under no_grad (evaluation) quantizes with the current scales but records no amax."""
    linear.gemm.record_forward = torch.is_grad_enabled()


def fp8_linear_names(models) -> list[str]:
    """The FP8 linears of `models` (what the start-up line and tests look at)."""
    return [name for model in models for name, m in model.named_modules()
            if isinstance(getattr(m, "gemm", None), Fp8Gemm)]


def enable_fp8_chunks(models, recipe: Fp8Recipe | None, num_layers: int, pstate) -> DelayedScalingStates | None:
    """enable_fp8 on every model chunk of this rank; the delayed-scaling states (reduced over
    TP, then DP x CP, or TP and CP with --tp-only-amax-red), or None without --fp8-format."""
    if recipe is None:
        return None
    states = {}
    for model in models:
        states.update(enable_fp8(model, recipe, num_layers, pstate.tp_group))
    across = pstate.cp_group if recipe.tp_only_amax_reduction else pstate.dp_cp_group
    return DelayedScalingStates(states, (pstate.tp_group, across))


def fp8_state_tensors(model) -> list[tuple[str, object]]:
    """(name, tensor) of each delayed-scaling linear's checkpointed state: its amax history and
    scales (`<linear>.fp8_amax_history`, `<linear>.fp8_scales`); empty without FP8 or with
    tensorwise scaling (which has no state)."""
    out = []
    for name, module in model.named_modules():
        scaling = getattr(getattr(module, "gemm", None), "scaling", None)
        if isinstance(scaling, DelayedScaling):
            out += [(f"{name}.fp8_amax_history", scaling.amax_history), (f"{name}.fp8_scales", scaling.scales)]
    return out
