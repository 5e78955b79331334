"""Micro-batches for one rank: a resumable data-parallel sampler, loaded where needed.

Megatron's pretraining sampler: the sample stream is consumed in chunks of
micro_batch_size x dp_size consecutive samples (a global batch is num_micro_batches such
chunks); data-parallel rank r takes the r-th micro_batch_size slice of each chunk. Starting
from consumed_samples continues the stream exactly where a previous run stopped.

Only the first and last pipeline stages need data (tokens in, labels and loss mask out).
Within a tensor-parallel group only TP rank 0 reads; it broadcasts every tensor to the group.
With context parallelism every CP rank reads the same samples and keeps its two chunks of
each sequence (megalite.parallel.context.split), position ids included.
"""

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from megalite.parallel.context import split_sequence
from megalite.parallel.context.split import split_attention_mask

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
BATCH_DTYPES = (torch.int64, torch.int64, torch.float32, torch.int64, torch.bool)


class PretrainingSampler:
    """Yields this DP rank's index lists, one per micro-batch, from consumed_samples on."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} outside [0, {data_parallel_size})")
        if total_samples <= 0:
            raise ValueError(f"the dataset has no samples (total {total_samples})")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be non-negative, got {consumed_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank, self.size = data_parallel_rank, data_parallel_size
        self.chunk = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return max(0, (self.total_samples - self.consumed_samples) // self.chunk)

    def __iter__(self):
        lo = self.rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - self.chunk + 1, self.chunk):
            yield list(range(start + lo, start + lo + self.micro_batch_size))


def build_data_iterator(dataset, *, consumed_samples: int, micro_batch_size: int, global_batch_size: int,
                        pstate, num_workers: int = 2, seed: int = 1234, device=None):
    """Iterator over this rank's micro-batches (dicts of tensors with a leading batch dim),
    or None where no data is needed (no dataset, or a middle pipeline stage).

    global_batch_size must be a multiple of micro_batch_size x DP size; consumed_samples a
    multiple of micro_batch_size x DP size. `seed` seeds the DataLoader's generator (the
    sample order itself is fixed by the dataset). With TP > 1 the batches are broadcast
    from TP rank 0 on `device` (default: the current CUDA device for NCCL, else CPU).
    """
    if dataset is None or not (pstate.is_first_stage or pstate.is_last_stage):
        return None
    per_step = micro_batch_size * pstate.dp_size
    if global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size "
                         f"{micro_batch_size} x data-parallel size {pstate.dp_size}")
    if consumed_samples % per_step:
        raise ValueError(f"consumed_samples {consumed_samples} is not a multiple of --micro-batch-size "
                         f"{micro_batch_size} x data-parallel size {pstate.dp_size}")
    loader_iter = None
    if pstate.tp_rank == 0:
        sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, pstate.dp_rank,
                                     pstate.dp_size)
        generator = torch.Generator()
        generator.manual_seed(seed)
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=False,
                            persistent_workers=num_workers > 0, generator=generator)
        loader_iter = iter(loader)
        if pstate.cp_size > 1:
            loader_iter = _cp_split_iterator(loader_iter, pstate)
    if pstate.tp_group is None or pstate.tp_size == 1:
        return loader_iter
    return _tp_broadcast_iterator(loader_iter, pstate, device)


def _cp_split_iterator(loader_iter, pstate):
    """This CP rank's chunks of every [batch, seq] tensor of each micro-batch, and its query
    rows of the attention mask ([batch, 1, seq / cp, seq]: keys anywhere in the sequence)."""
    for batch in loader_iter:
        yield {key: split_attention_mask(value, pstate.cp_size, pstate.cp_rank) if key == "attention_mask"
               else split_sequence(value, 1, pstate.cp_size, pstate.cp_rank) for key, value in batch.items()}


def _broadcast_device(group, device):
    if device is not None:
        return torch.device(device)
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tp_broadcast_iterator(loader_iter, pstate, device):
    """TP rank 0 sends a header (has batch, batch size, seq length, attention mask's key length
    or 0 without one: the whole sequence's under context parallelism), then
    each tensor; the other TP ranks receive. An empty header ends the stream everywhere."""
    group, src = pstate.tp_group, pstate.tp_src_rank
    device = _broadcast_device(group, device)
    while True:
        header = torch.zeros(4, dtype=torch.int64, device=device)
        batch = None
        if loader_iter is not None:
            batch = next(loader_iter, None)
            if batch is not None:
                b, s = batch["tokens"].shape
                keys = batch["attention_mask"].shape[-1] if "attention_mask" in batch else 0
                header = torch.tensor([1, b, s, keys], dtype=torch.int64, device=device)
        dist.broadcast(header, src=src, group=group)
        has_batch, b, s, mask_keys = header.tolist()
        if not has_batch:
            return
        out = {}
        for key, dtype in zip(BATCH_KEYS, BATCH_DTYPES):
            if key == "attention_mask" and not mask_keys:
                continue
            shape = (b, 1, s, mask_keys) if key == "attention_mask" else (b, s)
            wire = torch.uint8 if dtype == torch.bool else dtype  # gloo has no bool broadcast
            if batch is not None:
                tensor = batch[key].to(device=device, dtype=wire).contiguous()
            else:
                tensor = torch.empty(shape, dtype=wire, device=device)
            dist.broadcast(tensor, src=src, group=group)
            out[key] = tensor.to(dtype) if wire != dtype else tensor
        yield out
