"""Point-to-point transfers between pipeline stages, one torch.distributed.batch_isend_irecv
per run of consecutive communication actions (the executor rule of actions.py).

Every message between two stages has the activation shape [s/t (with sequence parallelism)
or s, b, h], forward (activations) and backward (their gradients) alike, so a receive buffer
is allocated from the shape alone. Messages between a pair of ranks match in posting order
on both backends; the schedules guarantee that every rank's i-th send to a peer is that
peer's i-th receive from it.

Backend behaviour (torch 2.13, measured for gloo):
- gloo does not coalesce (`supports_coalescing` is False): batch_isend_irecv issues each op
  as its own isend/irecv, in list order, and returns one Work per op. A gloo isend does not
  complete until the peer has posted the matching irecv (a 16 MB and a 40-byte send alike),
  but it returns at once and the transfer proceeds on gloo's own thread, so the rank keeps
  computing. The executor therefore only polls sends (`release_finished_sends`) and waits on
  them at the end of the step. A gloo send's Work reports completion only once waited on
  (is_completed() stays False after the peer has received; measured), so on gloo the polls
  free nothing and a rank holds its step's sends, one activation message each, to the end of
  the step.
- NCCL coalesces the batch into one group and returns a single Work for it, so sends and
  receives of one batch cannot be waited on apart: a batch holding a receive is waited on
  whole. Work.wait() on CUDA makes the current stream wait; it does not block the host, and
  nothing here synchronises the device. torch requires the first batch_isend_irecv of a
  group to involve all its ranks, which a pipeline's first batch does not: `warm_up` runs one
  tiny all-reduce over the pipeline group first. Call torch.cuda.set_device beforehand.
"""

import torch
import torch.distributed as dist

from megalite.parallel.pipeline.actions import Action, peer
from megalite.parallel.state import ParallelState


class PipelineP2P:
    """Posts a rank's transfer batches and tracks their completion for one or more steps."""

    def __init__(self, pstate: ParallelState, num_chunks: int, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device):
        self.group = pstate.pp_group
        self.pipeline_size, self.pipeline_rank = pstate.pp_size, pstate.pp_rank
        self.num_chunks = num_chunks
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self._receives: dict[Action, list] = {}   # Works of receives not yet waited on
        self._sends: list[tuple] = []       # (Work, tensors it reads), kept alive until done
        self._warm = False

    def warm_up(self) -> None:
        """NCCL only: a collective over the pipeline group, so later batches may involve just
        two of its ranks. A no-op for gloo and on later calls."""
        if self._warm or self.group is None:
            return
        if dist.get_backend(self.group) == "nccl":
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
        self._warm = True

    def post(self, actions: list[Action],
             outgoing: dict[Action, torch.Tensor]) -> dict[Action, torch.Tensor]:
        """Issue `actions` (communication only) as one batch. `outgoing` holds the tensor of
        every send. Returns a receive buffer per receive action, valid after wait_receives."""
        self.warm_up()
        ops, received, sent = [], {}, []
        for action in actions:
            other_rank, _ = peer(action, self.pipeline_rank, self.pipeline_size, self.num_chunks)
            if action.is_send:
                tensor = outgoing[action]
                if tuple(tensor.shape) != self.shape:
                    raise ValueError(f"{action} on pipeline rank {self.pipeline_rank}: tensor of "
                                     f"shape {tuple(tensor.shape)}, expected {self.shape} (seq/TP "
                                     "if sequence parallel, micro-batch, hidden)")
                tensor = tensor.contiguous()
                sent.append(tensor)
                ops.append(dist.P2POp(dist.isend, tensor, group=self.group, group_peer=other_rank))
            else:
                tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                received[action] = tensor
                ops.append(dist.P2POp(dist.irecv, tensor, group=self.group, group_peer=other_rank))
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # one Work per op (gloo): sends and receives tracked apart
            for action, work, op in zip(actions, works, ops):
                if action.is_send:
                    self._sends.append((work, op.tensor))
                else:
                    self._receives[action] = [work]
        else:  # coalesced (NCCL): the batch completes as a whole
            for action in received:
                self._receives[action] = works
            self._sends.extend((work, sent) for work in works)
        return received

    def wait_receives(self, actions=None) -> None:
        """Wait for the receives `actions` (those posted so far that are among them), or for
        every receive posted so far when `actions` is None."""
        keys = (list(self._receives) if actions is None
                else [a for a in actions if a in self._receives])
        for key in keys:
            for work in self._receives.pop(key):
                work.wait()

    def release_finished_sends(self) -> None:
        """Drop the tensors of sends that have completed (their storage may then be freed)."""
        self._sends = [(work, tensors) for work, tensors in self._sends if not work.is_completed()]

    def wait_sends(self) -> None:
        """Wait for every send posted so far and release its tensors."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
