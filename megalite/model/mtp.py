"""Multi-token prediction (DeepSeek-V3 section 2.2; Megatron-Core's MultiTokenPredictionBlock):
after the last layer's final norm, depth k = 1..D predicts the token k + 1 places ahead.

    h_k = final_norm_k(Layer_k(eh_proj([enorm(Emb(t shifted by k)); hnorm(h_{k-1})])))

with h_0 the model's final-normed output. The embedding and the output layer are the model's
own (on the last pipeline stage a copy of the embedding, kept equal to the first stage's by the
embedding group's gradient all-reduce). Depth k's loss is the masked mean of the cross-entropy
of labels and loss mask shifted by k; mtp_loss_scaling_factor / D times each trains the model
through an AttachLoss on the output (not added to the returned lm loss, which stays the plain
next-token loss) and is logged as 'mtp_k loss'. Shifting under context parallelism takes the
first token of the next sequence chunk from the CP rank holding it; losses count tokens over the
whole CP group, so every layout computes the unsplit sequence's losses.

Each depth's transformer layer is numbered num_layers + k - 1 (after the decoder's): it has
experts when the last layer has, and routes, logs and checkpoints under that number.
"""

import torch
from torch import nn

from megalite.model.moe import reduce_logged_losses
from megalite.model.norms import build_norm
from megalite.model.moe_router import AttachLoss
from megalite.model.recompute import checkpointed
from megalite.model.transformer import TransformerLayer
from megalite.parallel import comm
from megalite.parallel.context.loss import cp_masked_mean
from megalite.parallel.context.split import chunk_ids
from megalite.parallel.tensor.layers import ColumnParallelLinear


def roll_left(t: torch.Tensor, cp_group=None) -> torch.Tensor:
    """[b, s] shifted one place left along the sequence, the last place 0. Under context
    parallelism `t` is this rank's two chunks (split.py) and each chunk's new last element is
    the first of the sequence chunk after it."""
    n = comm.group_size(cp_group)
    rolled = torch.roll(t, -1, dims=1)
    if n == 1:
        rolled[:, -1] = 0
        return rolled
    c = t.shape[1] // 2
    firsts = comm.gather_dim(torch.stack((t[:, 0], t[:, c]))[None].contiguous(), 0, cp_group)  # [n, 2, b]
    where = {chunk: (rank, half) for rank in range(n) for half, chunk in enumerate(chunk_ids(n, rank))}
    for half, chunk in enumerate(chunk_ids(n, comm.group_rank(cp_group))):
        last = (half + 1) * c - 1
        if chunk + 1 == 2 * n:
            rolled[:, last] = 0
        else:
            rank, other_half = where[chunk + 1]
            rolled[:, last] = firsts[rank, other_half]
    return rolled


class MTPLayer(nn.Module):
    """One prediction depth: enorm, hnorm, eh_proj [h, 2h] (column-parallel, its output gathered),
    a transformer layer and its own final norm."""

    def __init__(self, config, depth: int, tp_group=None, rng_tracker=None, device=None, expert_state=None,
                 cp_group=None):
        super().__init__()
        self.config, self.tp_group, self.rng_tracker = config, tp_group, rng_tracker
        self.enorm = build_norm(config, device=device)
        self.hnorm = build_norm(config, device=device)
        self.eh_proj = ColumnParallelLinear(
            2 * config.hidden_size, config.hidden_size, tp_group=tp_group, bias=False,
            sequence_parallel=config.sequence_parallel, init_std=config.hidden_init_std,
            params_dtype=getattr(torch, config.params_dtype), device=device)
        self.mtp_model_layer = TransformerLayer(config, config.num_layers + depth, tp_group, rng_tracker, device,
                                                expert_state, cp_group)
        self.final_layernorm = build_norm(config, device=device)

    def _forward(self, hidden, embedded, rotary, attention_mask):
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))  # [s, b, h/t]
        x = comm.gather_from_tensor_parallel_region(x, self.tp_group)
        if self.config.sequence_parallel:
            x = comm.scatter_to_sequence_parallel_region(x, self.tp_group)
        return self.final_layernorm(self.mtp_model_layer(x, rotary, attention_mask))

    def forward(self, hidden, embedded, rotary=None, attention_mask=None):
        if self.config.recompute_granularity == "full" and self.training:
            fn = lambda h, e: self._forward(h, e, rotary, attention_mask)  # noqa: E731
            return checkpointed(fn, self.rng_tracker, hidden, embedded)
        return self._forward(hidden, embedded, rotary, attention_mask)


class MultiTokenPrediction(nn.Module):
    """The D prediction depths on the chunk holding the output layer."""

    def __init__(self, config, tp_group=None, rng_tracker=None, device=None, expert_state=None, cp_group=None):
        super().__init__()
        self.config, self.cp_group = config, cp_group
        self.layers = nn.ModuleList(MTPLayer(config, k, tp_group, rng_tracker, device, expert_state, cp_group)
                                    for k in range(config.mtp_num_layers))
        self.loss_backward_scale = 1.0
        """The main loss's backward scale (set_loss_backward_scale), given to each depth's loss."""
        self.per_token_loss = False
        """--calculate-per-token-loss: each depth's loss counts as a sum over the micro-batch's tokens."""
        self.logged = [[0.0, 0] for _ in range(config.mtp_num_layers)]
        """Per depth, [sum over forward calls, calls] of its loss (for logging)."""

    def forward(self, output, tokens, positions, labels, loss_mask, embedding, token_losses, rotary=None,
                attention_mask=None):
        """`output` (the final-normed last layer's output, [s(/t), b, h]) with every depth's loss
        attached. tokens, positions, labels, loss_mask: [b, s(/cp)]; embedding(tokens, positions)
        the model's; token_losses(hidden, labels) its per-token cross-entropy [b, s]."""
        cfg, cp = self.config, self.cp_group
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        tokens_in_batch = comm.all_reduce(mask.sum(), cp) if self.per_token_loss else None
        weight = cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers
        hidden = output
        for depth, layer in enumerate(self.layers):
            tokens, positions = roll_left(tokens, cp), roll_left(positions, cp)
            labels, mask = roll_left(labels, cp), roll_left(mask, cp)
            hidden = layer(hidden, embedding(tokens, positions), rotary, attention_mask)
            loss = cp_masked_mean(token_losses(hidden, labels), mask, cp)
            total = self.logged[depth]
            total[0] += float(loss.detach())
            total[1] += 1
            if tokens_in_batch is not None:  # Megatron: the shifted mean times the unshifted tokens
                loss = loss * tokens_in_batch
            output = AttachLoss.apply(output, weight * loss, self.loss_backward_scale)
        return output


def mtp_blocks(chunks) -> list[MultiTokenPrediction]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MultiTokenPrediction)]


def reduce_mtp_losses(chunks, mtp_num_layers: int, group) -> dict[str, float]:
    """{'mtp_k loss': mean since the last call over the ranks holding the MTP block} (Megatron's
    names); a collective over `group` (the world: the block lives on the last pipeline stage)."""
    sums = torch.zeros(2, mtp_num_layers, dtype=torch.float64)
    for block in mtp_blocks(chunks):
        for depth, (total, calls) in enumerate(block.logged):
            if calls:
                sums[0, depth] += total / calls
                sums[1, depth] += 1
        block.logged = [[0.0, 0] for _ in block.logged]
    device = next(p for c in chunks for p in c.parameters()).device
    sums = comm.all_reduce(sums.to(device), group).cpu()
    return {f"mtp_{k + 1} loss": float(sums[0, k] / sums[1, k]) for k in range(mtp_num_layers) if sums[1, k] > 0}


def auxiliary_losses(chunks, config, group) -> dict[str, float] | None:
    """What a training log line shows beside the lm loss since the last call: the MoE auxiliary
    losses (every layer's, the MTP depths' included) and each MTP depth's loss; None without
    either. A collective over `group` (the world)."""
    if config.moe is None and not config.mtp_num_layers:
        return None
    out = {}
    if config.moe is not None:
        out.update(reduce_logged_losses(chunks, config.num_layers + (config.mtp_num_layers or 0), group))
    if config.mtp_num_layers:
        out.update(reduce_mtp_losses(chunks, config.mtp_num_layers, group))
    return out
