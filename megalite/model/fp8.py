"""Which linears of a model run in FP8 (--fp8-format), as Megatron with Transformer Engine:
every column- and row-parallel linear of a decoder layer's attention and MLP (the shared expert
of an MoE layer included), except the first and last N layers under --first-last-layers-bf16.
The embedding, the output layer and multi-token-prediction layers stay 16-bit, and so do the
routed experts of MoE layers (their grouped GEMM has no FP8 path), the router and the
attention core (no FP8 attention: --fp8-dot-product-attention is refused).
"""

import torch
from torch import nn

from megalite.model.transformer import TransformerLayer
from megalite.parallel.tensor.fp8_blockwise import BlockwiseFp8Gemm
from megalite.parallel.tensor.fp8_gemm import Fp8Gemm
from megalite.parallel.tensor.fp8_param import Fp8ShardedWeight, GatheredWeightScales
from megalite.parallel.tensor.fp8_scaling import DelayedScaling, DelayedScalingStates, Fp8Recipe, TensorwiseScaling
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


def enable_fp8(model, recipe: Fp8Recipe, num_layers: int, tp_group=None) -> dict[str, DelayedScaling]:
    """Give each FP8 linear of `model` (one model chunk, unwrapped) an Fp8Gemm; returns the
    delayed-scaling states by parameter-path name (empty for tensorwise and blockwise scaling,
    which keep no state: fp8_blockwise.py's BlockwiseFp8Gemm for the latter). Layers are
    numbered globally, so the names are the same on every pipeline layout."""
    states = {}
    for layer_name, layer in model.named_modules():
        if not isinstance(layer, TransformerLayer) or not recipe.is_fp8_layer(layer.layer_number, num_layers):
            continue
        for linear_name, linear in layer.named_modules():
            if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                continue
            mode = "column" if isinstance(linear, ColumnParallelLinear) else "row"
            if recipe.scaling == "blockwise":
                linear.gemm = BlockwiseFp8Gemm(recipe, mode)
            elif recipe.scaling == "delayed":
                states[f"{layer_name}.{linear_name}"] = DelayedScaling(recipe, device=linear.weight.device)
                linear.gemm = Fp8Gemm(recipe, states[f"{layer_name}.{linear_name}"], mode,
                                      cast_impl=layer.config.kernel_impl)
            else:
                linear.gemm = Fp8Gemm(recipe, TensorwiseScaling(recipe, tp_group), mode, cast_impl=layer.config.kernel_impl)
            linear.register_forward_pre_hook(_record_when_training)
            if recipe.param_gather:
                _gather_in_fp8(linear)
    return states


def _gather_in_fp8(linear) -> None:
    """--fp8-param-gather under FSDP2: the weight (same storage, same attributes) becomes an
    Fp8ShardedWeight, which FSDP2 (applied next) all-gathers in FP8."""
    weight = linear.weight
    attributes = dict(vars(weight))
    linear.weight = nn.Parameter(Fp8ShardedWeight(weight.detach()), requires_grad=weight.requires_grad)
    for name, value in attributes.items():
        setattr(linear.weight, name, value)


def _record_when_training(linear, _inputs) -> None:
    """A forward under no_grad (evaluation) quantizes with the current scales but records no amax."""
    linear.gemm.record_forward = torch.is_grad_enabled()


def fp8_linear_names(models) -> list[str]:
    """The FP8 linears of `models` (what the start-up line and tests look at)."""
    return [name for model in models for name, m in model.named_modules()
            if isinstance(getattr(m, "gemm", None), Fp8Gemm)]


class Fp8StepUpdate:
    """What an FP8 run updates after each optimizer step: the delayed-scaling states (`states`,
    by linear name), then, with --fp8-param-gather under FSDP2 and tensorwise scaling, the
    scales of the weights cast to FP8 before their all-gather; and it drops every FP8 linear's
    cached weight cast (`gemms`: fp8_gemm.py's WeightCache; its version checks would refuse the
    stale cast anyway: dropping frees it)."""

    def __init__(self, delayed: DelayedScalingStates, gathered: GatheredWeightScales, gemms=()):
        self.delayed, self.gathered, self.gemms = delayed, gathered, list(gemms)

    @property
    def states(self):
        return self.delayed.states

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        self.delayed.after_optimizer_step()
        self.gathered.after_optimizer_step()
        for gemm in self.gemms:
            gemm.drop_weight_cache()


def enable_fp8_chunks(models, recipe: Fp8Recipe | None, num_layers: int, pstate) -> Fp8StepUpdate | None:
    """enable_fp8 on every model chunk of this rank; its after-step update (delayed states
    reduced over TP, then DP x CP, or TP and CP with --tp-only-amax-red), or None without
    --fp8-format."""
    if recipe is None:
        return None
    states = {}
    for model in models:
        states.update(enable_fp8(model, recipe, num_layers, pstate.tp_group))
    across = pstate.cp_group if recipe.tp_only_amax_reduction else pstate.dp_cp_group
    gathered = [] if recipe.scaling == "delayed" else [
        (m, m.gemm) for model in models for m in model.modules()
        if isinstance(getattr(m, "weight", None), Fp8ShardedWeight)]
    gemms = [m.gemm for model in models for m in model.modules() if isinstance(getattr(m, "gemm", None), Fp8Gemm)]
    return Fp8StepUpdate(DelayedScalingStates(states, (pstate.tp_group, across)),
                         GatheredWeightScales(gathered, pstate.dp_cp_group, pstate.tp_group), gemms)


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
