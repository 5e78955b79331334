"""One training step's forward, backward and gradient finalisation as the layout harnesses
(mla_harness.py, expert/ep_harness.py) run it, before their optimizer step."""

import contextlib

import torch

from megalite.model.moe import set_loss_backward_scale
from megalite.parallel import comm
from megalite.parallel.data.ddp import finalize_model_grads
from megalite.training.per_token_loss import scale_main_grads, token_factor


def train_step(chunks, pstate, batches: list[dict], forward_step, executor=None, per_token: bool = False):
    """Forward and backward of this rank's micro-batches `batches` on its data-parallel
    `chunks`: the pipeline `executor`'s schedule, or without one each micro-batch on chunks[0]
    (gradient sync on the last only), each loss over the micro-batch count; then
    finalize_model_grads. `per_token` (--calculate-per-token-loss, `forward_step` a
    PerTokenLoss): the gradients and the loss take the step's per-token factor, the loss summed
    over CP. Returns the step's loss, None on pipeline ranks without the loss."""
    m = len(batches)
    set_loss_backward_scale(chunks, 1.0 / m, per_token_loss=per_token)
    if per_token:
        forward_step.tokens = 0
    if executor is not None:
        loss = executor.run(batches)
    else:
        loss = 0.0
        for i, batch in enumerate(batches):
            with contextlib.nullcontext() if i == m - 1 else chunks[0].no_sync():
                micro_loss = forward_step(chunks[0], batch, None) / m
                micro_loss.backward()
            loss += float(micro_loss.detach())
    finalize_model_grads(chunks, pstate)
    if per_token:
        factor = token_factor(forward_step, pstate, m, torch.device("cpu"))
        scale_main_grads(chunks, factor)
        if loss is not None:  # each CP rank's is the sum over its own tokens
            loss = float(comm.all_reduce(torch.tensor(loss * factor, dtype=torch.float64), pstate.cp_group))
    return None if loss is None else float(loss)
