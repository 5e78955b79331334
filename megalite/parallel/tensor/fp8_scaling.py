"""FP8 scaling: the recipe of a run, per-tensor quantization, and the scales of each linear.

Transformer Engine's conventions (which Megatron's --fp8-* flags configure): a tensor is
quantized as fp8(clamp(t * scale, -fp8_max, fp8_max)) and the GEMM multiplies its result by
1 / scale; fp8_max is 448 for e4m3 and 57344 for e5m2. --fp8-format e4m3 uses e4m3 for every
operand, hybrid uses e4m3 for inputs and weights and e5m2 for gradients (more range, less
precision).

Two recipes:
- tensorwise ("current" scaling): each operand's scale is computed from its own amax at the
  moment it is quantized, scale = fp8_max / amax. A tensor split over the tensor-parallel group
  (a weight shard, a column-parallel layer's output gradient) takes the amax of the whole tensor
  (a MAX all-reduce over the group), so that every rank, and a one-process run, uses the same
  scale.
- delayed: each linear keeps an amax history [history_len, 3] (input, weight, output gradient)
  and quantizes with scales computed from past steps. During a step, history[0] holds the
  running max of the amaxes seen (all micro-batches); after the optimizer step the current row
  is all-reduced (MAX) over the amax reduction group, then, per operand:
      amax  = history[0] (most_recent) or max over the history (max)
      scale = fp8_max / amax / 2**margin     (kept when amax is 0 or not finite)
  and the history is rolled by one (torch.roll(-1) along the steps) with its new row 0 zeroed:
  Transformer Engine's _default_get_amax_and_update_history / _update_amax_history. The first
  step quantizes with scale 1. (Transformer Engine updates at the end of every forward /
  backward pass, i.e. per micro-batch; megalite updates once per optimizer step: one
  collective per step, and the step's micro-batches share their scales.)
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

INPUT, WEIGHT, GRAD = 0, 1, 2
OPERANDS = ("input", "weight", "grad_output")
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@dataclass(frozen=True)
class Fp8Recipe:
    """What --fp8-format, --fp8-recipe, --fp8-margin, --fp8-amax-history-len,
    --fp8-amax-compute-algo, --no-fp8-wgrad, --tp-only-amax-red, --first-last-layers-bf16 and
    --fp8-param-gather (under FSDP2) ask."""

    format: str = "e4m3"  # e4m3 | hybrid
    scaling: str = "delayed"  # delayed | tensorwise | blockwise (fp8_blockwise.py)
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"  # most_recent | max
    wgrad: bool = True  # the weight-gradient GEMM in FP8 (False: 16-bit)
    tp_only_amax_reduction: bool = False
    bf16_layers_at_start: int = 0
    bf16_layers_at_end: int = 0
    param_gather: bool = False  # --fp8-param-gather under FSDP2: weights cast to FP8, then all-gathered

    def dtype(self, operand: int) -> torch.dtype:
        if operand == GRAD and self.format == "hybrid":
            return torch.float8_e5m2
        return torch.float8_e4m3fn

    def is_fp8_layer(self, layer_number: int, num_layers: int) -> bool:
        """Whether decoder layer `layer_number` (global, from 0) runs its linears in FP8."""
        return self.bf16_layers_at_start <= layer_number < num_layers - self.bf16_layers_at_end


def quantize(tensor: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(tensor * scale)): saturating, as Transformer Engine's cast."""
    limit = FP8_MAX[dtype]
    return (tensor.float() * scale).clamp_(-limit, limit).to(dtype)


def amax_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().abs().amax().float()


def scale_from_amax(amax: torch.Tensor, fp8_max: float, margin: int, previous: torch.Tensor) -> torch.Tensor:
    """fp8_max / amax / 2**margin, or `previous` where amax is 0 or not finite."""
    fresh = fp8_max / amax / (2.0 ** margin)
    return torch.where((amax > 0) & torch.isfinite(amax), fresh, previous)


class TensorwiseScaling:
    """Current scaling: a scale from each tensor's own amax (over `group` when it is split)."""

    def __init__(self, recipe: Fp8Recipe, group=None):
        self.recipe, self.group = recipe, group

    def scale(self, operand: int, tensor: torch.Tensor, split: bool, record: bool = True) -> torch.Tensor:
        return self.scale_for_amax(operand, amax_of(tensor), split)

    def scale_for_amax(self, operand: int, amax: torch.Tensor, split: bool) -> torch.Tensor:
        """The scale of a tensor whose own amax (fp32, one element) is `amax`, reduced in place
        over the group when the tensor is split."""
        if split and self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        return scale_from_amax(amax, FP8_MAX[self.recipe.dtype(operand)], 0, torch.ones_like(amax))


def delayed_state_bytes(history_len: int) -> int:
    """Bytes of one linear's delayed-scaling state: the fp32 amax history [len, 3] and scales [3]."""
    return 4 * (3 * history_len + 3)


class DelayedScaling:
    """One linear's delayed-scaling state: amax history [history_len, 3] and scales [3]."""

    def __init__(self, recipe: Fp8Recipe, device=None):
        self.recipe = recipe
        self.amax_history = torch.zeros(recipe.amax_history_len, 3, dtype=torch.float32, device=device)
        self.scales = torch.ones(3, dtype=torch.float32, device=device)

    def scale(self, operand: int, tensor: torch.Tensor, split: bool, record: bool = True) -> torch.Tensor:
        """The scale to quantize `tensor` with now; with `record`, its amax goes into the current
        row (the reduction over the group happens once, after the optimizer step)."""
        if record:
            row = self.amax_history[0]
            row[operand] = torch.maximum(row[operand], amax_of(tensor).to(row.device))
        return self.scales[operand].to(tensor.device)

    def update(self) -> None:
        """New scales from the (already reduced) history, then roll it: Transformer Engine's order."""
        history, recipe = self.amax_history, self.recipe
        amax = history[0].clone() if recipe.amax_compute_algo == "most_recent" else history.amax(0)
        fp8_max = torch.tensor([FP8_MAX[recipe.dtype(op)] for op in range(3)], device=amax.device)
        self.scales.copy_(scale_from_amax(amax, fp8_max, recipe.margin, self.scales))
        if history.shape[0] > 1:
            history.copy_(torch.roll(history, -1, 0))
        history[0].zero_()


class DelayedScalingStates:
    """Every delayed-scaling linear of this rank's model chunks, by name: the per-step update
    (all current amaxes, one tensor, MAX-all-reduced over the amax reduction group) and the
    checkpointed state (amax histories and scales). `amax_groups`: process groups whose product
    is the amax reduction group (Megatron's TP x CP x DP, or TP x CP with --tp-only-amax-red),
    reduced one after the other (MAX composes), so no group of its own is needed."""

    def __init__(self, states: dict[str, DelayedScaling], amax_groups=()):
        self.states, self.amax_groups = states, tuple(g for g in amax_groups if g is not None)

    def after_optimizer_step(self) -> None:
        if not self.states:
            return
        current = torch.stack([s.amax_history[0] for s in self.states.values()])
        for group in self.amax_groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(current, op=dist.ReduceOp.MAX, group=group)
        for state, row in zip(self.states.values(), current):
            state.amax_history[0].copy_(row)
            state.update()

    def state_dict(self) -> dict:
        return {name: {"amax_history": s.amax_history.clone(), "scales": s.scales.clone()}
                for name, s in self.states.items()}

    def load_state_dict(self, saved: dict) -> None:
        missing = sorted(set(self.states) - set(saved))
        if missing:
            raise ValueError(f"FP8 delayed-scaling state: no saved amax history for {missing[0]} "
                             f"({len(missing)} linears missing)")
        for name, state in self.states.items():
            history = saved[name]["amax_history"]
            if history.shape != state.amax_history.shape:
                raise ValueError(f"FP8 delayed-scaling state of {name}: saved amax history "
                                 f"{tuple(history.shape)}, this run's {tuple(state.amax_history.shape)} "
                                 "(--fp8-amax-history-len differs)")
            state.amax_history.copy_(history)
            state.scales.copy_(saved[name]["scales"])
