"""--calculate-per-token-loss: the step's loss is the mean over every non-masked token of the
global batch, sum over (micro-batches, replicas) of sum(loss * mask) / total tokens, instead of
Megatron's default mean over micro-batches (and replicas) of each micro-batch's token mean. With
micro-batches holding different numbers of loss tokens (--eod-mask-loss, masked padding) the
two differ.

The executor backpropagates each micro-batch's loss scaled by 1/m and DistributedDataParallel
averages over the DP replicas, so the gradient it leaves is (1 / (m x DP)) x d(sum of summed
losses); `token_factor` = m x DP / N turns that into d(sum)/N, and the executor's loss (mean over
micro-batches, then over replicas) times the same factor is the per-token loss.
"""

import torch
import torch.distributed as dist

from megalite.parallel.data.fsdp import FSDPChunk
from megalite.parallel.pipeline.executor import unwrap


class PerTokenLoss:
    """A forward_step (see PipelineExecutor) whose last-stage result is the micro-batch's summed
    token loss; it counts the loss tokens it saw in `tokens` (reset it each step)."""

    def __init__(self):
        self.tokens = 0

    def __call__(self, chunk, batch, hidden_states):
        model = unwrap(chunk)
        batch = batch or {}
        if model.post_process and batch.get("labels") is None:
            raise ValueError("micro-batch has no 'labels', which the chunk holding the output layer needs")
        if model.needs_tokens and batch.get("tokens") is None:
            raise ValueError("micro-batch has no 'tokens', which the chunk holding the embedding (or multi-token "
                             "prediction) needs")
        out = chunk(tokens=batch.get("tokens") if model.needs_tokens else None,
                    position_ids=batch.get("position_ids"), attention_mask=batch.get("attention_mask"),
                    labels=batch.get("labels") if model.post_process else None, hidden_states=hidden_states,
                    loss_mask=batch.get("loss_mask") if model.mtp is not None else None)
        if not model.post_process:
            return out
        mask = batch.get("loss_mask")
        if mask is None:
            self.tokens += out.numel()
            return out.sum()
        mask = mask.to(out.dtype)
        self.tokens += int(mask.sum().item())
        return (out * mask).sum()


def token_factor(counter: PerTokenLoss, pstate, num_microbatches: int, device) -> float:
    """m x DP / N, N the loss tokens of the whole global batch (a collective over all ranks:
    the last stage's first TP rank of each replica contributes its count)."""
    counts = counter.tokens if pstate.is_last_stage and pstate.tp_rank == 0 else 0
    total = torch.tensor([float(counts)], dtype=torch.float64, device=device)
    if pstate.world_size > 1:
        dist.all_reduce(total)
    tokens = total.item()
    if tokens == 0:
        raise ValueError("--calculate-per-token-loss: the global batch has no loss tokens (every loss_mask is 0)")
    return num_microbatches * pstate.dp_size / tokens


def scale_main_grads(chunks, factor: float) -> None:
    """Multiply the step's reduced gradients by `factor`: the gradient buffers of megalite's
    DistributedDataParallel chunks, FSDP2's sharded gradients."""
    for chunk in chunks:
        if isinstance(chunk, FSDPChunk):
            for param in chunk.module.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor)
            continue
        for buffer in chunk.buffers_:
            buffer.grad_data.mul_(factor)


DECOUPLED_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""The parameters Megatron marks is_embedding_or_output_parameter (--decoupled-lr)."""


def apply_decoupled_lr(optimizer, decoupled_lr: float, decoupled_min_lr: float | None) -> int:
    """Move the word embedding and output layer (fp32 main copies) into param groups of their
    own whose schedule peaks at `decoupled_lr` and ends at `decoupled_min_lr` (None: --min-lr),
    keeping their weight-decay setting. Returns how many parameters moved. Call before the
    learning-rate scheduler is built."""
    decoupled = {id(m.main) for m in optimizer.mains if m.name.endswith(DECOUPLED_PARAMETERS)}
    inner, moved_groups = optimizer.inner, []
    for group in inner.param_groups:
        moved = [p for p in group["params"] if id(p) in decoupled]
        if moved:
            group["params"] = [p for p in group["params"] if id(p) not in decoupled]
            settings = {k: v for k, v in group.items() if k != "params"}
            moved_groups.append({**settings, "params": moved, "max_lr": decoupled_lr, "min_lr": decoupled_min_lr})
    for group in moved_groups:
        inner.add_param_group(group)
    return sum(len(g["params"]) for g in moved_groups)
