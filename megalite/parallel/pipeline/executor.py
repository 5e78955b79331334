"""Run one training step's pipeline schedule with the model chunks this rank owns.

The schedule is data (schedules.py): this rank's ordered actions. The executor walks them as
actions.py prescribes: each run of consecutive transfers is one batch_isend_irecv
(p2p.py); sends are only polled, and waited on when the step ends. Before a compute action it
waits on the receive that action reads (its input activation for F, its output gradient for
B), not on every receive posted so far as the rule allows: waiting on less never deadlocks,
and an interleaved step's forward then starts while the gradient its backward needs is still
in flight (Megatron's overlap_p2p_comm). Under NCCL a batch completes as a whole, so there the
wait covers the receive's whole batch. On gloo, whose transfers never hold the rank, sends are
also posted right after the compute that produced them and receives one compute early
(`eager_order`); on NCCL the schedule's batches run as listed.

    F  forward of micro-batch k through local chunk c. On the last virtual stage the result is
       the micro-batch's loss (masked mean over its tokens); it is scaled by 1/m so the summed
       gradients equal a single-device run's over the m micro-batches.
    B  backward: torch.autograd.backward(output, received gradient), or, where the schedule
       also lists W (ZB-H1), only the input gradient (split_backward.py).
    W  the deferred weight gradient.

Memory: a stage's output activation is sent as a detached alias and the output's own storage
is dropped at once (Megatron's deallocate_output_tensor); the alias keeps the bytes alive only
until the send completes. Backward needs the output's graph, not its values (the last op of a
chunk is the residual add, which saves nothing).

Data parallelism: with DistributedDataParallel chunks, every backward runs under the chunk's
no_sync() except the last one that produces weight gradients for that chunk (its last B, or
last W when split), so the gradient all-reduce starts once per chunk and step, overlapping
the remaining pipeline work; finalize_model_grads completes it after the step.

How the training loop runs it (check the configuration first with
stage_layout.validate_pipeline; build_model_chunks and PipelineExecutor repeat those checks):

    chunks = [DistributedDataParallel(c, pstate, overlap_grad_reduce=True)
              for c in build_model_chunks(config, pstate, num_layers_first=f, num_layers_last=l)]
    executor = PipelineExecutor(chunks, pstate, schedule, num_microbatches=m,
                                seq_length=s, micro_batch_size=b, hidden_size=config.hidden_size,
                                sequence_parallel=config.sequence_parallel, dtype=activation_dtype,
                                forward_step=gpt_forward_step)
    for each step:
        for chunk in chunks: chunk.zero_grad_buffer()
        has_data = pstate.is_first_stage or pstate.is_last_stage
        loss = executor.run(data_iterator if has_data else None)
        finalize_model_grads(chunks, pstate)     # DP, sequence-parallel and tied-embedding sums
        optimizer.step()
    # loss: mean over the m micro-batches on the last stage (None elsewhere); average it over
    # the data-parallel group for logging.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist

from megalite.parallel.pipeline.actions import (B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action,
                                                comm_batches, virtual_stage)
from megalite.parallel.pipeline.p2p import PipelineP2P
from megalite.parallel.pipeline.schedules import schedule_actions
from megalite.parallel.pipeline.split_backward import SplitBackward
from megalite.parallel.state import ParallelState


def unwrap(chunk):
    """The model inside a data-parallel wrapper (the chunk itself when not wrapped)."""
    return getattr(chunk, "module", chunk)


def deallocate_output(tensor: torch.Tensor) -> None:
    """Drop `tensor`'s storage, keeping its shape and autograd graph: .data becomes a
    stride-0 view of one element, so torch.autograd.backward(tensor, grad) still accepts a
    gradient of the original shape. Only for tensors whose values backward does not read."""
    if tensor._base is not None:
        return  # a view shares its base's storage; freeing it would free nothing
    tensor.data = torch.empty(1, dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)


def eager_order(actions: list[Action], receive_lookahead: int = 1) -> list[Action]:
    """The same actions with every send moved to right after the compute that produced it and
    every receive posted `receive_lookahead` compute actions before the schedule lists it.

    Sends keep their relative order, and so do receives, so every peer still gets this rank's
    i-th message as its i-th receive from it. Meant for backends where a posted transfer never
    holds the rank (gloo, whose transfers run on its own thread). A gloo send waits until the
    peer has posted the matching receive (measured), so a receive posted a step ahead lets the
    data arrive while the rank computes rather than after it asks; and a send reaches its peer
    up to a schedule step earlier, which matters for interleaved 1F1B, whose schedule batches a
    step's sends after its backward so that it also runs where transfers do hold the rank
    (NCCL). Cost: the receive buffers of `receive_lookahead` more compute actions."""
    sends = {(a.kind, a.chunk, a.microbatch) for a in actions if a.is_send}
    produced_by = {F: SEND_F, B: SEND_B}
    computes = [a for a in actions if a.is_compute]
    receives_before = [[] for _ in computes]   # receives to post before compute j
    index = 0
    for action in actions:
        if action.is_compute:
            index += 1
        elif not action.is_send:
            receives_before[max(index - receive_lookahead, 0)].append(action)
    order = []
    for j, action in enumerate(computes):
        order += receives_before[j]
        order.append(action)
        send = (produced_by.get(action.kind), action.chunk, action.microbatch)
        if send in sends:
            order.append(Action(*send))
    return order


class _Step:
    """Everything one step keeps between actions, keyed by (chunk, micro-batch)."""

    def __init__(self, microbatches, num_chunks: int, num_microbatches: int):
        self.data = iter(microbatches) if microbatches is not None else None
        self.num_chunks, self.num_microbatches = num_chunks, num_microbatches
        self.batches: dict[int, dict] = {}
        self.fetched = 0
        self.forwards_done: dict[int, int] = {}
        self.inputs, self.outputs, self.records = {}, {}, {}
        self.received: dict[Action, torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []
        self.forward_only = False

    def batch(self, microbatch: int):
        """Micro-batch `microbatch` from the iterator (read in order, kept until every chunk of
        this rank has run its forward)."""
        if self.data is None:
            return None
        while self.fetched <= microbatch:
            try:
                self.batches[self.fetched] = next(self.data)
            except StopIteration:
                raise ValueError(f"the micro-batch iterator ended after {self.fetched} of "
                                 f"{self.num_microbatches} micro-batches") from None
            self.fetched += 1
        return self.batches[microbatch]

    def forward_done(self, microbatch: int) -> None:
        self.forwards_done[microbatch] = self.forwards_done.get(microbatch, 0) + 1
        if self.forwards_done[microbatch] == self.num_chunks:
            self.batches.pop(microbatch, None)


class PipelineExecutor:
    """Runs `schedule` on this rank's `chunks` (local chunk c = virtual stage c*p + rank), once
    per training step. Build it once; call `run` every step.

    Args:
        chunks: this rank's model chunks, raw or wrapped in DistributedDataParallel.
        pstate: the parallel state (pipeline rank and group).
        schedule: a --pipeline-schedule value ("none", "gpipe", "1f1b", "interleaved_1f1b",
            "zb_h1").
        num_microbatches: m, micro-batches per step and pipeline.
        seq_length, micro_batch_size, hidden_size: the activation shape sent between stages,
            [seq_length / cp / tp (with sequence_parallel), micro_batch_size, hidden_size]
            (seq_length is the full sequence; each context-parallel rank holds 1/cp of it).
        dtype, device: of those activations.
        forward_step: forward_step(chunk, batch, hidden_states) -> hidden states, or the
            micro-batch loss on the last virtual stage (GPTModel chunks:
            megalite.model.pipeline_chunks.gpt_forward_step).
        loss_scale: multiplies the loss before backward (fp16 loss scaling).
        deallocate_outputs: free each output activation's storage once sent.
        eager_sends: post each send right after the compute that produced it and each receive
            a compute action early, instead of where the schedule lists them (`eager_order`).
            None: on for gloo, whose transfers never hold the rank; off otherwise (NCCL runs
            the schedule's batches as listed).
        microbatch_group_size: the interleaved schedule's micro-batches per group on each
            chunk (--microbatch-group-size-per-virtual-pipeline-stage; None: the pipeline size).
    """

    def __init__(self, chunks, pstate: ParallelState, schedule: str, *, num_microbatches: int,
                 seq_length: int, micro_batch_size: int, hidden_size: int,
                 sequence_parallel: bool = False, dtype: torch.dtype = torch.float32, device=None,
                 forward_step, loss_scale: float = 1.0,
                 deallocate_outputs: bool = True, eager_sends: bool | None = None,
                 microbatch_group_size: int | None = None):
        self.chunks = list(chunks)
        self.pstate, self.num_microbatches = pstate, num_microbatches
        self.p, self.rank, self.v = pstate.pp_size, pstate.pp_rank, len(self.chunks)
        if self.v != pstate.vp_size:
            raise ValueError(f"pipeline rank {self.rank} got {self.v} model chunks but "
                             f"--num-virtual-stages-per-pipeline-rank is {pstate.vp_size}")
        self.actions = schedule_actions(schedule, self.p, self.rank, num_microbatches, self.v,
                                        microbatch_group_size)
        self._check_chunk_roles()
        tp = pstate.tp_size if sequence_parallel else 1
        if seq_length % (tp * pstate.cp_size):
            cp = f"--context-parallel-size {pstate.cp_size} x " if pstate.cp_size > 1 else ""
            raise ValueError(f"--seq-length {seq_length} is not divisible by {cp}"
                             f"--tensor-model-parallel-size {tp} (sequence parallelism)")
        device = torch.device(device) if device is not None else next(
            unwrap(self.chunks[0]).parameters()).device
        self.p2p = (PipelineP2P(pstate, self.v, (seq_length // (tp * pstate.cp_size), micro_batch_size, hidden_size),
                                dtype, device) if self.p > 1 else None)
        self.forward_step, self.loss_scale = forward_step, loss_scale
        self.deallocate_outputs = deallocate_outputs
        if eager_sends is None:
            eager_sends = (pstate.pp_group is not None
                           and dist.get_backend(pstate.pp_group) == "gloo")
        order = eager_order(self.actions) if eager_sends else self.actions
        self.groups = comm_batches(order)
        # Evaluation: the schedule's forwards and activation transfers alone (every schedule's
        # forward part runs deadlock-free under either transfer rule; simulated in the tests).
        self.forward_groups = comm_batches([a for a in order if a.kind in (F, SEND_F, RECV_F)])
        self.split = self._split_backward()
        self.sync_points = self._sync_points()

    # --- set-up -----------------------------------------------------------------------------

    def _is_first(self, chunk: int) -> bool:
        return virtual_stage(self.rank, chunk, self.p) == 0

    def _is_last(self, chunk: int) -> bool:
        return virtual_stage(self.rank, chunk, self.p) == self.p * self.v - 1

    def _check_chunk_roles(self) -> None:
        for c, chunk in enumerate(self.chunks):
            model = unwrap(chunk)
            for attr, expected in (("pre_process", self._is_first(c)),
                                   ("post_process", self._is_last(c))):
                if hasattr(model, attr) and getattr(model, attr) != expected:
                    raise ValueError(f"chunk {c} of pipeline rank {self.rank} has {attr}="
                                     f"{getattr(model, attr)}, expected {expected} (virtual stage "
                                     f"{virtual_stage(self.rank, c, self.p)} of "
                                     f"{self.p * self.v}); "
                                     "build the chunks with build_model_chunks")

    def _split_backward(self) -> dict[int, SplitBackward]:
        """Chunks whose backward runs as B then W: those the schedule lists W for, unless they
        recompute whole layers (then B is the full backward and W does nothing)."""
        chunks = {a.chunk for a in self.actions if a.kind == W}
        return {c: SplitBackward(unwrap(self.chunks[c])) for c in chunks
                if getattr(getattr(unwrap(self.chunks[c]), "config", None),
                           "recompute_granularity", None) != "full"}

    def _sync_points(self) -> set[int]:
        """Indices (in self.groups) of each chunk's last action producing weight gradients."""
        last = {}
        for index, group in enumerate(self.groups):
            action = group[0]
            weight_grad_kind = W if action.chunk in self.split else B
            if action.kind == weight_grad_kind:
                last[action.chunk] = index
        return set(last.values())

    # --- one step ---------------------------------------------------------------------------

    def run(self, microbatches=None, forward_only: bool = False) -> torch.Tensor | None:
        """One step over `num_microbatches` micro-batches from the iterable `microbatches`
        (dicts). Only ranks holding the first or last virtual stage need data; a rank given data
        passes each micro-batch to all its chunks. Gradients accumulate into the chunks'
        parameters. Returns the mean micro-batch loss on the rank holding the last virtual
        stage, None elsewhere. `forward_only` (evaluation, under torch.no_grad()) runs the
        forwards and their transfers alone."""
        needs_data = any(self._is_first(c) or self._is_last(c) for c in range(self.v))
        if needs_data and microbatches is None:
            raise ValueError(f"pipeline rank {self.rank} holds the first or last stage and needs "
                             "an iterator of micro-batches")
        step = _Step(microbatches, self.v, self.num_microbatches)
        step.forward_only = forward_only
        run_compute = {F: self._forward, B: self._backward, W: self._weight_backward}
        for index, group in enumerate(self.forward_groups if forward_only else self.groups):
            if group[0].is_comm:
                self._communicate(step, group)
                continue
            if self.p2p is not None:
                self.p2p.wait_receives(self._consumed(group[0]))
                self.p2p.release_finished_sends()
            run_compute[group[0].kind](step, group[0], index in self.sync_points)
        if self.p2p is not None:
            self.p2p.wait_receives()
            self.p2p.wait_sends()
        if any(self._is_last(c) for c in range(self.v)):
            return torch.stack(step.losses).sum() / self.num_microbatches
        return None

    def _consumed(self, action: Action) -> list[Action]:
        """The receive a compute action reads: F its input, B its output gradient."""
        if action.kind == F and not self._is_first(action.chunk):
            return [Action(RECV_F, action.chunk, action.microbatch)]
        if action.kind == B and not self._is_last(action.chunk):
            return [Action(RECV_B, action.chunk, action.microbatch)]
        return []

    def _communicate(self, step: _Step, group: list[Action]) -> None:
        outgoing = {}
        for action in group:
            key = (action.chunk, action.microbatch)
            if action.kind == SEND_F:
                outgoing[action] = step.outputs[key].detach()
            elif action.kind == SEND_B:
                outgoing[action] = step.input_grads.pop(key)
        step.received.update(self.p2p.post(group, outgoing))
        for action in group:
            if action.kind == SEND_F and step.forward_only:
                del step.outputs[(action.chunk, action.microbatch)]  # no backward will need it
            elif action.kind == SEND_F and self.deallocate_outputs:
                deallocate_output(step.outputs[(action.chunk, action.microbatch)])

    def _backward_context(self, chunk: int, sync: bool):
        """The chunk's no_sync() for every backward but its last (data-parallel chunks)."""
        no_sync = getattr(self.chunks[chunk], "no_sync", None)
        return nullcontext() if sync or no_sync is None else no_sync()

    def _forward(self, step: _Step, action: Action, sync: bool) -> None:
        c, k = action.chunk, action.microbatch
        hidden = None
        if not self._is_first(c):
            hidden = step.received.pop(Action(RECV_F, c, k))
            if not step.forward_only:
                hidden.requires_grad_()
        batch = step.batch(k)
        split = c in self.split and not step.forward_only
        record = self.split[c].record() if split else nullcontext()
        with record as recorded:
            out = self.forward_step(self.chunks[c], batch, hidden)
        step.forward_done(k)
        if self._is_last(c):
            if out.numel() != 1:
                raise ValueError(f"forward_step returned a tensor of shape {tuple(out.shape)} on "
                                 "the last pipeline stage; expected the micro-batch's scalar loss")
            step.losses.append(out.detach().reshape(()))
            out = out * (self.loss_scale / self.num_microbatches)
        if step.forward_only:
            if not self._is_last(c):
                step.outputs[(c, k)] = out  # until sent
            return
        step.inputs[(c, k)], step.outputs[(c, k)] = hidden, out
        if recorded is not None:
            step.records[(c, k)] = recorded

    def _backward(self, step: _Step, action: Action, sync: bool) -> None:
        c, k = action.chunk, action.microbatch
        grad = None if self._is_last(c) else step.received.pop(Action(RECV_B, c, k))
        out, hidden = step.outputs.pop((c, k)), step.inputs.pop((c, k))
        if c in self.split:
            input_grad = self.split[c].input_backward(step.records[(c, k)], out, grad, hidden)
        else:
            with self._backward_context(c, sync):
                torch.autograd.backward(out, grad_tensors=grad)
            input_grad = hidden.grad if hidden is not None else None
        if not self._is_first(c):
            if input_grad is None:
                raise RuntimeError(f"backward of chunk {c}, micro-batch {k} produced no gradient "
                                   "for the chunk's input; does the forward use hidden_states?")
            step.input_grads[(c, k)] = input_grad

    def _weight_backward(self, step: _Step, action: Action, sync: bool) -> None:
        c, k = action.chunk, action.microbatch
        if c not in self.split:
            return  # full recompute: B already did the whole backward
        with self._backward_context(c, sync):
            self.split[c].weight_backward(step.records.pop((c, k)))


def run_pipeline_step(chunks, pstate: ParallelState, schedule: str, microbatches, **kwargs):
    """One-off form of PipelineExecutor(chunks, pstate, schedule, **kwargs).run(microbatches)."""
    return PipelineExecutor(chunks, pstate, schedule, **kwargs).run(microbatches)
