"""The MoE router: top-k expert choice per token, with Megatron's score functions,
group-limited routing, capacity dropping, load-balancing losses and expert bias.

Tokens are rows [T, h], in [seq, batch] order (row = s * batch + b).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel import comm

ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


class AttachLoss(torch.autograd.Function):
    """Identity on `x` whose backward also sends d(loss) = `scale` into `loss`'s graph, so an
    auxiliary loss trains the router without being added to the returned loss (Megatron's
    MoEAuxLossAutoScaler). `scale` is the main loss's backward scale (loss scale / micro-batches)."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def group_limited_topk(scores, topk: int, num_groups: int, group_topk: int):
    """Top-k over the experts of the `group_topk` groups whose best topk/group_topk scores sum
    highest (experts split into `num_groups` equal consecutive groups)."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(-1)
    chosen = group_scores.topk(group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    allowed = allowed.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1)


def topk_routing(logits, moe, expert_bias=None):
    """(probs [T, E], routing_map bool [T, E]): each token's top-k experts and their weights."""
    k = moe.router_topk

    def select(scores):
        if moe.group_topk:
            return group_limited_topk(scores, k, moe.num_groups, moe.group_topk)
        return scores.topk(k, dim=-1)

    if moe.score_function == "softmax":
        if moe.pre_softmax:
            probs, indices = select(torch.softmax(logits, dim=-1, dtype=torch.float32))
        else:
            top, indices = select(logits)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32)
    else:  # sigmoid
        scores = torch.sigmoid(logits.float())
        if expert_bias is not None:
            _, indices = select(scores + expert_bias.float())
            top = scores.gather(1, indices)
        else:
            top, indices = select(scores)
        probs = top / (top.sum(-1, keepdim=True) + 1e-20) if k > 1 else top
    if moe.topk_scaling_factor:
        probs = probs * moe.topk_scaling_factor
    probs = probs.type_as(logits)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return torch.zeros_like(logits).scatter(1, indices, probs), routing_map


def sinkhorn(cost, tol: float = 1e-4):
    """The doubly-normalised assignment exp(cost) * d0 d1^T whose rows each sum to 1/T and
    whose columns approach 1/E (Sinkhorn-Knopp, iterated until the column scales change by
    less than `tol` on average; S-BASE's balancing as Megatron-Core's moe_utils.sinkhorn)."""
    weights = torch.exp(cost)
    tokens, experts = weights.shape
    row_scale = torch.ones(tokens, dtype=weights.dtype, device=weights.device)
    col_scale = torch.ones(experts, dtype=weights.dtype, device=weights.device)
    change = math.inf
    while change > tol:
        row_scale = (1 / tokens) * 1 / (torch.sum(col_scale * weights, 1) + 1e-8)
        new_col_scale = (1 / experts) * 1 / (torch.sum(row_scale.unsqueeze(1) * weights, 0) + 1e-8)
        change = torch.mean(torch.abs(col_scale - new_col_scale))
        col_scale = new_col_scale
    return col_scale * weights * row_scale.unsqueeze(1)


def sinkhorn_routing(logits, topk: int, balance: bool, parts: int = 1):
    """(probs [T, E], routing_map [T, E]) of --moe-router-load-balancing-type sinkhorn: with
    `balance` (training) each token's top-k of the Sinkhorn-balanced fp32 logits, else of its
    scores; the probabilities are the scores (sigmoid for top-1, else softmax over all
    experts) at the chosen experts, not renormalised. Sinkhorn balances each of `parts`
    consecutive row blocks alone (Megatron routes each sequence-parallel rank's rows alone)."""
    scores = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    with torch.no_grad():
        if balance:
            balanced = torch.cat([sinkhorn(part.float()) for part in logits.detach().chunk(parts)])
            indices = balanced.topk(topk, dim=1).indices
        else:
            indices = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return scores * routing_map, routing_map


def expert_capacity(num_tokens: int, moe) -> int:
    return math.ceil(num_tokens * moe.router_topk / moe.num_experts * moe.capacity_factor)


def drop_over_capacity(probs, routing_map, moe):
    """Keep at most capacity tokens per expert: the highest-probability ones ('probs') or the
    first routed ones ('position'). With pad_to_capacity every expert gets exactly capacity
    rows: the kept tokens plus unrouted ones with weight 0."""
    capacity = expert_capacity(probs.shape[0], moe)
    if capacity >= probs.shape[0]:
        keep = torch.ones_like(routing_map)
    else:
        key = probs if moe.token_drop_policy == "probs" else routing_map.to(torch.int32)
        # Equal keys: topk keeps the lower token index first, stable=True makes that a promise.
        order = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]
        keep = torch.zeros_like(routing_map).scatter(0, order, True)
    final_map = keep if moe.pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


def aux_loss_scores(logits, moe):
    """Scores over all experts and their plain top-k map, as the balancing losses use them."""
    if moe.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:  # in fp32 at least: fp64 logits (--moe-router-dtype fp64) keep fp64, as Megatron's
        scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    indices = scores.topk(moe.router_topk, dim=-1).indices
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices, True)


def switch_aux_loss(scores, tokens_per_expert, total_tokens: int, topk: int, coeff: float):
    """E * sum_i f_i * P_i * coeff with f_i the fraction of routed (token, expert) pairs and P_i
    the mean score of expert i (Switch Transformer). `scores` may be one rank's part of the
    tokens: with `tokens_per_expert` and `total_tokens` counted over all of them, the parts'
    losses sum to the whole's (Megatron's switch_load_balancing_loss_func)."""
    experts = scores.shape[-1]
    return (scores.sum(0) * tokens_per_expert).sum() * (experts * coeff / (topk * total_tokens * total_tokens))


def seq_aux_loss(scores, tokens_per_expert, seq_length: int, topk: int, coeff: float):
    """The Switch loss of each sequence alone, averaged over the batch: `scores` [s, b, E]
    (one rank's positions of each sequence), `tokens_per_expert` [b, E] over all positions,
    `seq_length` the full length."""
    batch = scores.shape[1]
    return (scores.sum(0) * tokens_per_expert).sum() * (
        scores.shape[-1] * coeff / (topk * seq_length * seq_length)) / batch


def z_loss(logits, coeff: float):
    return torch.logsumexp(logits.float(), dim=-1).square().mean() * coeff


class TopKRouter(nn.Module):
    """Router weights [E, h] (replicated over TP) and, with expert bias, the bias and the token
    counts it is updated from (buffers: saved in checkpoints, never trained by the optimizer).

    Under context parallelism each CP rank routes its part of every sequence; the balancing
    losses count tokens over the whole CP group, as Megatron's do over its sequence partition
    group, so that the CP ranks' losses sum to the unsplit sequence's (the z-loss, a mean,
    takes 1/CP of its coefficient on each). Gradients are summed over CP (megalite.parallel.data).

    global_aux_loss (Megatron-Core's _apply_global_aux_loss) counts over `dp_cp_group`, every rank
    routing other tokens (TP ranks route the same rows here; GPTModel sets it), and over the
    step's micro-batches so far: the buffers global_tokens_per_expert and global_batches, which
    moe.reset_global_aux_loss_counts zeroes before each step's forward-backward."""

    def __init__(self, hidden_size: int, moe, init_std: float, dtype=torch.float32, device=None, cp_group=None,
                 dp_cp_group=None):
        super().__init__()
        self.moe, self.init_std, self.cp_group, self.dp_cp_group = moe, init_std, cp_group, dp_cp_group
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=dtype, device=device))
        if moe.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32, device=device))
            self.register_buffer("tokens_per_expert", torch.zeros(moe.num_experts, dtype=torch.float32,
                                                                  device=device), persistent=False)
        else:
            self.expert_bias = None
        if moe.load_balancing_type == "global_aux_loss":
            self.register_buffer("global_tokens_per_expert", torch.zeros(moe.num_experts, dtype=torch.float32,
                                                                         device=device), persistent=False)
            self.register_buffer("global_batches", torch.zeros((), dtype=torch.float32, device=device),
                                 persistent=False)
        self.loss_backward_scale = 1.0
        self.per_token_loss = False
        """Weight each auxiliary loss by the micro-batch's routed tokens (see set_loss_backward_scale)."""
        self.logged = {}
        """Per loss name, [sum over forward calls, calls] of the unscaled losses (for logging;
        the mean over the CP ranks is the whole sequence's loss)."""

    def reset_parameters(self, generator: torch.Generator) -> None:
        with torch.no_grad():
            full = torch.empty(self.weight.shape, device=self.weight.device).normal_(0.0, self.init_std, generator=generator)
            self.weight.copy_(full)

    def _log(self, name, value):
        total = self.logged.setdefault(name, [0.0, 0])
        total[0] += float(value.detach())
        total[1] += 1

    def gating(self, tokens):
        """Router logits [T, E] of tokens [T, h] (in the router's dtype)."""
        dtype = ROUTER_DTYPES[self.moe.router_dtype] or tokens.dtype
        return F.linear(tokens.to(dtype), self.weight.to(dtype))

    def forward(self, tokens, seq_length: int, batch: int):
        return self.route(self.gating(tokens), seq_length, batch)

    def _balancing_loss(self, logits, seq_length: int, batch: int):
        """(log name, loss of this CP rank's part) of the configured balancing loss."""
        moe, cp = self.moe, comm.group_size(self.cp_group)
        scores, top_map = aux_loss_scores(logits, moe)
        if moe.load_balancing_type == "aux_loss":
            counts = comm.all_reduce(top_map.sum(0).to(scores.dtype), self.cp_group)
            return "load_balancing_loss", switch_aux_loss(scores, counts, logits.shape[0] * cp, moe.router_topk,
                                                          moe.aux_loss_coeff)
        if moe.load_balancing_type == "global_aux_loss":
            self.global_tokens_per_expert += comm.all_reduce(top_map.sum(0).float(), self.dp_cp_group)
            self.global_batches += 1
            total = logits.shape[0] * comm.group_size(self.dp_cp_group)  # one micro-batch's, as Megatron's
            return "global_load_balancing_loss", switch_aux_loss(
                scores, self.global_tokens_per_expert / self.global_batches, total, moe.router_topk, moe.aux_loss_coeff)
        per_seq = top_map.view(seq_length, batch, -1)
        counts = comm.all_reduce(per_seq.sum(0).to(scores.dtype), self.cp_group)
        return "seq_load_balancing_loss", seq_aux_loss(scores.view(seq_length, batch, -1), counts,
                                                       seq_length * cp, moe.router_topk, moe.aux_loss_coeff)

    def route(self, logits, seq_length: int, batch: int, sequence_parts: int = 1):
        """(probs [T, E], routing_map bool [T, E]) of logits [T, E] for tokens in [seq, batch]
        order, attaching the auxiliary losses to the graph when training. `sequence_parts`:
        the sequence-parallel ranks whose rows the logits concatenate (sinkhorn balances each
        rank's rows alone, as Megatron routes them)."""
        moe, cp = self.moe, comm.group_size(self.cp_group)
        training = self.training and torch.is_grad_enabled()
        # Megatron's per-token mode: x the micro-batch's tokens (on one model replica, all CP ranks')
        scale = self.loss_backward_scale * (logits.shape[0] * cp if self.per_token_loss else 1)
        if training and moe.z_loss_coeff:
            loss = z_loss(logits, moe.z_loss_coeff)
            self._log("z_loss", loss / moe.z_loss_coeff)
            logits = AttachLoss.apply(logits, loss / cp, scale)
        if moe.load_balancing_type == "sinkhorn":  # Megatron balances in training mode, grad or not
            probs, routing_map = sinkhorn_routing(logits, moe.router_topk, self.training, sequence_parts)
        else:
            probs, routing_map = topk_routing(logits, moe, self.expert_bias)
        if moe.capacity_factor is not None:
            probs, routing_map = drop_over_capacity(probs, routing_map, moe)
        if training and moe.load_balancing_type in ("aux_loss", "seq_aux_loss", "global_aux_loss") \
                and moe.aux_loss_coeff:
            name, loss = self._balancing_loss(logits, seq_length, batch)
            # logged x the ranks whose parts sum to the loss: their mean is the whole loss (Megatron's sum)
            parts = comm.group_size(self.dp_cp_group) if name == "global_load_balancing_loss" else cp
            self._log(name, loss * parts / moe.aux_loss_coeff)
            probs = AttachLoss.apply(probs, loss, scale)
        if training and self.expert_bias is not None:
            self.tokens_per_expert += routing_map.sum(0)
        return probs, routing_map
