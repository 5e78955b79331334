"""Mixture-of-experts MLP (Megatron's MoELayer): a router picks each token's top-k experts, a
token dispatcher moves the tokens to the EP ranks holding those experts, the experts (SwiGLU or
GeLU MLPs without biases, split over the expert-tensor-parallel group) run as one grouped
matmul, and the weighted outputs come back; an optional shared expert sees every token.

Expert e is `local_experts.e` (its global number) on whichever EP rank holds it, so
checkpoints reshard across EP and ETP sizes by name. Every TP rank routes all tokens of its TP
group alike (under sequence parallelism from the gathered router logits), so routing, capacity
and the balancing losses do not depend on TP; each TP rank then dispatches only its own share
of the tokens (its sequence-parallel slice, or without sequence parallelism a 1/TP slice of the
rows), as Megatron's dispatchers take them into the expert grid (megalite.parallel.expert).
"""

import torch
import torch.nn.functional as F
from torch import nn

from megalite import kernels
from megalite.model.mlp import MLP
from megalite.model.moe_router import TopKRouter
from megalite.model.offload import ActivationOffloader
from megalite.model.recompute import RecomputedOutput, checkpointed
from megalite.parallel import comm
from megalite.parallel.expert.collectives import gather_rows, scatter_rows
from megalite.parallel.expert.dispatch import build_dispatcher
from megalite.parallel.expert.grouped_gemm import grouped_mm
from megalite.parallel.expert.groups import ExpertState
from megalite.parallel.sharding import mark_sequence_parallel, mark_sharded, shard_of_full


class ExpertWeight(nn.Module):
    """One expert linear's weight [out(/etp), in], an ETP shard of the full weight like
    ColumnParallelLinear (partition_dim 0) or RowParallelLinear (partition_dim 1)."""

    def __init__(self, out_size, in_size, partition_dim, stride, init_std, etp_group, dtype, device):
        super().__init__()
        tp = comm.group_size(etp_group)
        self.full_shape, self.init_std, self.tp_group = (out_size, in_size), init_std, etp_group
        shape = [out_size, in_size]
        shape[partition_dim] //= tp
        self.weight = mark_sharded(nn.Parameter(torch.empty(shape, dtype=dtype, device=device)), partition_dim, stride)
        self.weight.expert_parallel = True

    def reset_parameters(self, generator: torch.Generator) -> None:
        w = self.weight
        full = torch.empty(self.full_shape, device=w.device).normal_(0.0, self.init_std, generator=generator)
        with torch.no_grad():
            w.copy_(shard_of_full(full, w.partition_dim, w.partition_stride,
                                  comm.group_rank(self.tp_group), comm.group_size(self.tp_group)))


class Expert(nn.Module):
    """One routed expert: linear_fc1 (SwiGLU's [gate; up]) and linear_fc2, no biases."""

    def __init__(self, config, ffn, etp_group, device):
        super().__init__()
        dtype = getattr(torch, config.params_dtype)
        swiglu = config.activation == "swiglu"
        self.linear_fc1 = ExpertWeight(ffn * (2 if swiglu else 1), config.hidden_size, 0, 2 if swiglu else 1,
                                       config.hidden_init_std, etp_group, dtype, device)
        self.linear_fc2 = ExpertWeight(config.hidden_size, ffn, 1, 1, config.output_proj_init_std,
                                       etp_group, dtype, device)


class LocalExperts(nn.ModuleDict):
    """This rank's routed experts, keyed by global expert number, run as one grouped matmul per
    linear (a module of its own so that FSDP2 can shard it over the expert-data-parallel group)."""

    def __init__(self, config, expert_ids, etp_group, device):
        super().__init__({str(e): Expert(config, config.moe.ffn_hidden_size, etp_group, device) for e in expert_ids})
        self.config = config
        self.offloader = ActivationOffloader()  # its TransformerLayer's (--offload-modules)

    def _stacked(self, which: str) -> torch.Tensor:
        """[local experts, in, out(/etp)] weights of linear_fc1 or linear_fc2."""
        return torch.stack([getattr(expert, which).weight for expert in self.values()]).transpose(1, 2)

    def forward(self, rows, counts):
        """The experts on their rows (counts[i] rows for the i-th local expert): this rank's ETP
        share of each output, summed over the ETP group by the dispatcher's combine."""
        grouped = self.config.moe.grouped_gemm
        fc1 = self._stacked("linear_fc1")
        with self.offloader.region("expert_fc1", rows, keep=[fc1]) as region:  # --offload-modules expert_fc1
            hidden = grouped_mm(region.input, fc1, counts, grouped)
        with self.offloader.region("moe_act", hidden) as region:  # --offload-modules moe_act
            if not (self.config.recomputes("moe_act") and self.training and torch.is_grad_enabled()):
                activated = self._activation(region.input)
            else:  # --recompute-modules moe_act: kept is the activation's input, not its output
                activated = RecomputedOutput(self._activation, region.input, store=region)
        if not isinstance(activated, RecomputedOutput):
            return grouped_mm(activated, self._stacked("linear_fc2"), counts, grouped)
        with activated.consumers() as h:
            return grouped_mm(h, self._stacked("linear_fc2"), counts, grouped)

    def _activation(self, hidden):
        if self.config.activation == "swiglu":
            return kernels.swiglu(hidden, impl=self.config.kernel_impl)
        return F.gelu(hidden, approximate="tanh" if self.config.activation == "openai_gelu" else "none")


class SharedExpert(MLP):
    """The dense MLP every token passes through, optionally scaled by sigmoid(x . gate_weight)."""

    def __init__(self, config, tp_group, device):
        moe = config.moe
        super().__init__(config.replace(ffn_hidden_size=moe.shared_expert_intermediate_size), tp_group, device)
        self.gate_weight = None
        if moe.shared_expert_gate:
            dtype = getattr(torch, config.params_dtype)
            self.gate_weight = mark_sequence_parallel(
                nn.Parameter(torch.empty(1, config.hidden_size, dtype=dtype, device=device)), config.sequence_parallel)

    def reset_parameters(self, generator: torch.Generator) -> None:
        if self.gate_weight is not None:
            with torch.no_grad():
                self.gate_weight.copy_(torch.empty(self.gate_weight.shape, device=self.gate_weight.device)
                                       .normal_(0.0, self.config.hidden_init_std, generator=generator))

    def forward(self, x):
        out = super().forward(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out


class MoELayer(nn.Module):
    """The MoE MLP of one transformer layer; input and output [s(/tp), b, h]."""

    def __init__(self, config, tp_group=None, expert_state: ExpertState | None = None, device=None, cp_group=None):
        super().__init__()
        moe = config.moe
        self.config, self.moe, self.tp_group = config, moe, tp_group
        expert_state = expert_state or ExpertState.single()
        if config.add_bias_linear:
            raise ValueError("--num-experts needs --disable-bias-linear: megalite's experts have no biases")
        self.router = TopKRouter(config.hidden_size, moe, config.hidden_init_std,
                                 getattr(torch, config.params_dtype), device, cp_group)
        # Under sequence parallelism each TP rank's router weight sees only its own tokens' logits.
        mark_sequence_parallel(self.router.weight, config.sequence_parallel)
        self.dispatcher = build_dispatcher(moe.token_dispatcher_type, moe.num_experts, expert_state)
        start, count = self.dispatcher.local_start, self.dispatcher.num_local
        self.local_expert_ids = list(range(start, start + count))
        self.local_experts = LocalExperts(config, self.local_expert_ids, expert_state.etp_group, device)
        self.shared_experts = (SharedExpert(config, tp_group, device)
                               if moe.shared_expert_intermediate_size else None)
        self.last_tokens_per_expert = None
        """Rows each local expert received in the last forward (padding included)."""
        self.layer_number = 0
        """The global number of the layer holding it (its TransformerLayer sets it)."""

    def forward(self, x):
        tp_group, tp = self.tp_group, comm.group_size(self.tp_group)
        sequence_parallel = self.config.sequence_parallel and tp > 1
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        logits = self.router.gating(tokens)
        if sequence_parallel:
            logits = gather_rows(logits, [s * b] * tp, tp_group, grad_is_partial=False)
        probs, routing_map = self.router.route(logits, logits.shape[0] // b, b, tp if sequence_parallel else 1)
        if tp > 1:  # this rank's share of the TP group's rows (its own under sequence parallelism)
            sizes = [logits.shape[0] // tp + (r < logits.shape[0] % tp) for r in range(tp)]
            start = sum(sizes[:comm.group_rank(tp_group)])
            probs = scatter_rows(probs, sizes, tp_group)
            routing_map = routing_map[start:start + probs.shape[0]]
            if not sequence_parallel:
                tokens = scatter_rows(tokens, sizes, tp_group)
        rows, counts = self.dispatcher.dispatch(tokens, probs, routing_map)
        self.last_tokens_per_expert = counts
        out = self.dispatcher.combine(self.local_experts(rows, counts))
        if tp > 1 and not sequence_parallel:
            out = gather_rows(out, sizes, tp_group, grad_is_partial=False)
        out = out.view(s, b, h)
        if self.shared_experts is not None:
            shared = self.config.recomputes("shared_experts") and self.training and torch.is_grad_enabled()
            out = out + (checkpointed(self.shared_experts, None, x) if shared else self.shared_experts(x))
        return out


def moe_layers(chunks) -> list[MoELayer]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]


def set_loss_backward_scale(chunks, scale: float, per_token_loss: bool = False) -> None:
    """The gradient the auxiliary losses send back: the main loss's (loss scale / micro-batches).
    With per_token_loss (--calculate-per-token-loss, whose gradients end up divided by the global
    batch's loss tokens instead of averaged over micro-batches and replicas) each auxiliary loss
    also counts as many times as its micro-batch routes tokens, as Megatron scales it. The
    multi-token prediction block (model/mtp.py), which attaches its losses the same way, too."""
    for module in (m for chunk in chunks for m in chunk.modules()):
        if hasattr(module, "loss_backward_scale"):
            module.loss_backward_scale = scale
            module.per_token_loss = per_token_loss


@torch.no_grad()
def update_expert_bias(chunks, dp_cp_group) -> None:
    """After each optimizer step: move each expert's bias by rate toward balance (up for experts
    below the mean token count over the data- and context-parallel group, down above it)."""
    for layer in moe_layers(chunks):
        router = layer.router
        if router.expert_bias is None:
            continue
        counts = comm.all_reduce(router.tokens_per_expert, dp_cp_group)
        router.expert_bias += torch.sign(counts.mean() - counts) * layer.moe.bias_update_rate
        counts.zero_()


@torch.no_grad()
def reset_global_aux_loss_counts(chunks) -> None:
    """Before each step's forward-backward: global_aux_loss counts the global batch afresh (Megatron-Core
    zeroes its counts as it finalizes each step's gradients, reset_model_temporary_tensors)."""
    for layer in moe_layers(chunks):
        if layer.moe.load_balancing_type == "global_aux_loss":
            layer.router.global_tokens_per_expert.zero_()
            layer.router.global_batches.zero_()


def pop_logged_losses(chunks) -> dict[str, dict[int, float]]:
    """{loss name: {layer number: mean since the last call}} of this rank's MoE layers."""
    out = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                layer_number = module.layer_number  # set by its TransformerLayer
                for loss, (total, calls) in module.router.logged.items():
                    out.setdefault(loss, {})[layer_number] = total / calls
                module.router.logged = {}
    return out


LOGGED_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


def reduce_logged_losses(chunks, num_layers: int, group) -> dict[str, float]:
    """The auxiliary losses (unscaled by their coefficients) since the last call, averaged over
    the ranks holding each layer: {name: mean over MoE layers, 'name/layer_N': layer N's}.
    A collective over `group` (the world: layers live on different pipeline stages)."""
    logged = pop_logged_losses(chunks)
    sums = torch.zeros(len(LOGGED_LOSSES), num_layers, dtype=torch.float64)
    counts = torch.zeros_like(sums)
    for i, name in enumerate(LOGGED_LOSSES):
        for layer_number, value in logged.get(name, {}).items():
            sums[i, layer_number], counts[i, layer_number] = value, 1
    device = next(p for c in chunks for p in c.parameters()).device
    both = comm.all_reduce(torch.stack([sums, counts]).to(device), group).cpu()
    out = {}
    for i, name in enumerate(LOGGED_LOSSES):
        seen = both[1, i] > 0
        if seen.any():
            per_layer = both[0, i][seen] / both[1, i][seen]
            out[name] = float(per_layer.mean())
            out.update({f"{name}/layer_{n}": float(v) for n, v in zip(seen.nonzero().flatten().tolist(), per_layer)})
    return out
