"""How megalite describes its tensors to torch.distributed.checkpoint (DCP), and how it reads
DCP checkpoints without unpickling arbitrary objects.

Every tensor is saved under its full (TP=1, unpadded) shape. A TP shard is described as one or
more chunks of that full tensor with global offsets, so a checkpoint written at any TP size is
read at any other: DCP assembles each reader's chunks from the stored ones.
  - a parameter split along `partition_dim` in `partition_stride` blocks holds one chunk per
    block (the SwiGLU [gate; up] projection holds two);
  - vocabulary-sized tensors are saved without their padding rows, whose number depends on TP.
Replicas (DP ranks, the tied output copy) describe the same chunks; DCP writes each once.
"""

import contextlib
import io
import math
import pickle
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.model.fp8 import fp8_state_tensors
from megalite.model.weights import persistent_buffers, source_name
from megalite.optimizer.distributed import FlatShard, dtensor_dp_ranges, rank_layout
from megalite.parallel.expert.groups import holder_rank, reduction_index, tensor_split_of

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file or tensor."""


@contextlib.contextmanager
def single_process_dcp():
    """Silence two DCP warnings megalite has taken into account: that DCP 'assumes'
    single-process use without torch.distributed (for offline tools and single-process runs
    that is the intent), and that ShardedTensor, through which megalite describes its chunks of
    a full tensor, is deprecated in favour of DTensor (which cannot describe strided or trimmed
    chunks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def tp_chunks(full_shape, partition_dim: int, stride, tp_size: int, valid_rows: int | None = None):
    """For each TP rank, the chunks it holds: lists of (global_offsets, sizes, local_offset).

    `full_shape` is the padded full shape; `valid_rows` trims dim 0 (vocabulary padding);
    `stride` is a number of equal blocks or a tuple of block sizes (see sharding.shard_of_full)."""
    full_shape = list(full_shape)
    if isinstance(stride, tuple):
        blocks = list(stride)
    else:
        blocks = [full_shape[partition_dim] // stride] * stride
    chunks = []
    for t in range(tp_size):
        mine, block_start, local = [], 0, 0
        for block in blocks:
            per_rank = block // tp_size
            start, size = block_start + t * per_rank, per_rank
            block_start += block
            if valid_rows is not None and partition_dim == 0:
                size = max(0, min(start + size, valid_rows) - start)
            if size > 0:
                offsets = [0] * len(full_shape)
                offsets[partition_dim] = start
                sizes = list(full_shape)
                sizes[partition_dim] = size
                mine.append((offsets, sizes, local))
            local += per_rank
        chunks.append(mine)
    return chunks


def flat_boxes(lo: int, hi: int, shape) -> list[tuple[list[int], list[int]]]:
    """Elements [lo, hi) of a row-major tensor of `shape` as boxes (offsets, sizes), in order,
    each a contiguous run of the range: for 2-D the end of the first row, the whole rows, the
    start of the last row (at most three)."""
    if lo >= hi:
        return []
    shape = list(shape)
    if len(shape) <= 1:
        return [([lo], [hi - lo])] if shape else [([], [])]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner

    def in_row(row, a, b):
        return [([row, *o], [1, *s]) for o, s in flat_boxes(a, b, shape[1:])]

    if first == last:
        return in_row(first, lo - first * inner, hi - first * inner)
    boxes = []
    if lo % inner:
        boxes += in_row(first, lo % inner, inner)
        first += 1
    whole_end = hi // inner
    if whole_end > first:
        boxes.append(([first] + [0] * (len(shape) - 1), [whole_end - first, *shape[1:]]))
    if hi % inner:
        boxes += in_row(whole_end, 0, hi % inner)
    return boxes


def _full_boxes(local_boxes, chunks, partition_dim: int):
    """Map boxes of a TP-local tensor to boxes of the full one through the rank's TP chunks:
    (global offsets, sizes, index of the local box, offset within it along partition_dim)."""
    out = []
    for i, (offsets, sizes) in enumerate(local_boxes):
        a, b = offsets[partition_dim], offsets[partition_dim] + sizes[partition_dim]
        for global_offsets, chunk_sizes, local_offset in chunks:
            x0, x1 = max(a, local_offset), min(b, local_offset + chunk_sizes[partition_dim])
            if x0 >= x1:
                continue
            g_offsets, g_sizes = list(offsets), list(sizes)
            g_offsets[partition_dim] = global_offsets[partition_dim] + x0 - local_offset
            g_sizes[partition_dim] = x1 - x0
            out.append((g_offsets, g_sizes, i, x0 - a))
    return out


def _sharded_tensor(local_shards, metas, global_shape, dtype):
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    metadata = ShardedTensorMetadata(metas, torch.Size(global_shape), TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata)


def describe(local, like: torch.Tensor, name: str, pstate, vocab_size: int):
    """The object to put in a DCP state dict for `local`: a tensor laid out as parameter `like`
    (the parameter itself, or an optimizer state of it) named `name`, or a FlatShard of one.

    Tensors replicated over TP, DP and CP go to DCP as they are. Otherwise this rank's elements
    become boxes of the full tensor, described as a ShardedTensor whose global metadata covers
    the full tensor once: every (TP rank, DP x CP rank) holder's boxes for a TP-sharded tensor, this
    TP rank's for a replicated one (the other TP ranks describe identical boxes; DCP writes
    each once)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard

    _, tp_size, tp_rank = tensor_split_of(pstate, like)  # expert weights: over ETP
    own_index = reduction_index(pstate, like)  # expert weights: over the expert-data-parallel group
    tp_sharded = getattr(like, "tensor_model_parallel", False) and tp_size > 1
    is_vocab = name in VOCAB_PARAMS
    if hasattr(local, "to_local"):  # an FSDP2 parameter: this DP x CP rank's rows of the TP-local tensor
        lo, hi, ranges = rank_layout(dtensor_dp_ranges(local), pstate, like, local.numel())
        local = FlatShard(local.to_local().reshape(-1), lo, hi, local.shape, ranges)
    if isinstance(local, torch.Tensor):
        if not tp_sharded:
            return local[:vocab_size] if is_vocab else local
        if not local.is_contiguous():
            raise CheckpointError(f"{name}: cannot describe a non-contiguous tensor")
        local = FlatShard(local.view(-1), 0, local.numel(), local.shape)
    shape = list(local.shape)
    if local.dp_ranges is None and not tp_sharded:  # every rank holds all of it
        view = local.values.view(shape)
        return view[:vocab_size] if is_vocab else view
    full_shape = list(shape)
    if tp_sharded:
        dim = like.partition_dim
        full_shape[dim] *= tp_size
        chunks = tp_chunks(full_shape, dim, like.partition_stride, tp_size, vocab_size if is_vocab else None)
        holders_tp = range(tp_size)
    else:
        dim = 0
        trimmed = [min(shape[0], vocab_size) if is_vocab else shape[0], *shape[1:]]
        chunks = {tp_rank: [([0] * len(shape), trimmed, 0)]}
        holders_tp = [tp_rank]
    # reduction-group index and elements of every holder; CP ranks without sharding hold
    # identical replicas: each describes its own (DCP writes one copy of each shard)
    holders_dp = list(enumerate(local.dp_ranges)) if local.dp_ranges else [(own_index, (local.lo, local.hi))]
    global_shape = list(full_shape)
    if is_vocab:
        global_shape[0] = vocab_size
    device = local.values.device
    device_str = "cpu" if device.type == "cpu" else f"{device.type}:{device.index}"
    metas, shards = [], []
    for d, (lo, hi) in holders_dp:
        boxes = flat_boxes(lo, hi, shape)
        starts = [0]
        for _, sizes in boxes:
            starts.append(starts[-1] + math.prod(sizes))
        for t in holders_tp:
            placement = f"rank:{holder_rank(pstate, like, t, d)}/{device_str}"
            for offsets, sizes, i, shift in _full_boxes(boxes, chunks[t], dim):
                meta = ShardMetadata(offsets, sizes, placement)
                metas.append(meta)
                if (t, d) != (tp_rank, own_index):
                    continue
                box = local.values[starts[i]:starts[i + 1]].view(boxes[i][1]).narrow(dim, shift, sizes[dim])
                if not box.is_contiguous():
                    raise CheckpointError(f"{name}: cannot describe a non-contiguous shard (dim {dim})")
                shards.append(Shard(box, meta))
    return _sharded_tensor(shards, metas, global_shape, local.values.dtype)


def global_shape_of(local, like: torch.Tensor, name: str, tp_size: int, vocab_size: int) -> list[int]:
    """The full (TP=1, unpadded) shape of `local`, a tensor or FlatShard laid out as `like`."""
    shape = list(local.shape)
    if getattr(like, "tensor_model_parallel", False):
        shape[like.partition_dim] *= tp_size
    if name in VOCAB_PARAMS:
        shape[0] = vocab_size
    return shape


def tensor_entries(chunks, opt_states: dict, pstate, for_load: bool):
    """(key, local tensor, like-parameter, name) for every tensor this rank saves or loads.
    `opt_states` maps parameter names to their optimizer states in the parameter's layout."""
    vocab = chunks[0].config.vocab_size
    entries = []
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            src = source_name(chunk, name)
            if src != name and not for_load:
                continue  # a tied copy: its first-stage twin is saved
            entries.append((f"model/{src}", param.data, param, src))
            for state_name, tensor in opt_states.get(name, {}).items():
                if src != name and not for_load:
                    continue
                entries.append((f"optimizer/{state_name}/{src}", tensor, param, src))
        # the routers' expert biases: model state, replicated
        entries += [(f"model/{name}", buf, buf, name) for name, buf in persistent_buffers(chunk)]
        # --fp8-format with delayed scaling: each linear's amax history and scales (replicated
        # over the amax reduction group, so saved once)
        entries += [(f"fp8/{name}", t, t, name) for name, t in fp8_state_tensors(chunk)]
    return entries, vocab


def dcp_state_dict(entries, pstate, vocab):
    """What DCP saves or loads for `entries` (see describe)."""
    return {key: describe(local, like, name, pstate, vocab) for key, local, like, name in entries}


def check_shapes(metadata, entries, pstate, vocab, path: Path):
    known = metadata.state_dict_metadata
    for key, local, like, name in entries:
        expected = global_shape_of(local, like, name, tensor_split_of(pstate, like)[1], vocab)
        if key not in known:
            hint = " (use --no-load-optim or --finetune to skip optimizer state)" if key.startswith("optimizer/") else ""
            raise CheckpointError(f"{path}: checkpoint has no tensor {key} (expected shape {expected}){hint}")
        stored = list(getattr(known[key], "size", []))
        if stored != expected:
            raise CheckpointError(f"{path}: tensor {key} has shape {stored} in the checkpoint but the "
                                  f"model expects {expected}")


# --- safe reading -----------------------------------------------------------------------------

def _allowed_globals() -> dict:
    """Every global DCP's `.metadata` may name, by exact (module, name), resolved here once: the
    unpickler looks names up in this table and never imports or getattrs what a file names.

    What torch 2.13 writes for megalite: DCP's metadata dataclasses, _StorageInfo, torch.Size,
    dtypes, layouts (through torch.serialization._get_layout, a lookup by name), the
    memory-format enum and the checkpoint path. BytesStorageMetadata is left out on purpose:
    megalite saves no pickled objects, and DCP would torch.load such an entry unrestricted."""
    import collections
    import pathlib

    import torch.distributed.checkpoint.filesystem as dcp_filesystem
    import torch.distributed.checkpoint.metadata as dcp_metadata

    classes = [dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.ChunkStorageMetadata,
               dcp_metadata.TensorStorageMetadata, dcp_metadata.TensorProperties, dcp_metadata.StorageMeta,
               dcp_metadata._MEM_FORMAT_ENCODING, dcp_filesystem._StorageInfo, collections.OrderedDict,
               pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath]
    allowed = {(c.__module__, c.__qualname__): c for c in classes}
    allowed.update({("pathlib", c.__name__): c for c in classes if c.__name__.startswith(("Posix", "Pure", "Windows"))})
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    return allowed


_ALLOWED_GLOBALS = _allowed_globals()


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes, torch dtypes and nothing else (see _allowed_globals)."""

    def find_class(self, module, name):
        found = _ALLOWED_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return found


def read_metadata_file(path: Path):
    """DCP's Metadata from `path`, unpickled through the allowlist; anything else, or a global
    outside the allowlist, is a CheckpointError naming the file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(Path(path).read_bytes())).load()
    except Exception as e:  # noqa: BLE001 - any failure means the file cannot be trusted
        raise CheckpointError(f"{path}: not a valid checkpoint metadata file ({e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not a valid checkpoint metadata file (it holds a {type(metadata).__name__}, "
                              "not DCP Metadata)")
    for field, kind in (("state_dict_metadata", TensorStorageMetadata), ("storage_data", _StorageInfo)):
        entries = getattr(metadata, field, None)
        if not isinstance(entries, dict) or not all(isinstance(v, kind) for v in entries.values()):
            raise CheckpointError(f"{path}: not a valid checkpoint metadata file ({field} is not a table of "
                                  f"{kind.__name__})")
    return metadata


# --- integrity --------------------------------------------------------------------------------

def file_digest(path: Path) -> dict:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):  # small blocks: checking a file must not cost memory
            crc = zlib.crc32(block, crc)
    return {"size": path.stat().st_size, "crc32": crc}


def and_more(items) -> str:
    """' (and N more)' after a message about items[0], or '' when it is the only one."""
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def verify_files(directory: Path, expected: dict[str, dict], rank: int = 0, world: int = 1) -> list[str]:
    """Problems with the files this rank checks (every `world`-th, from `rank`)."""
    problems = []
    for i, (name, digest) in enumerate(sorted(expected.items())):
        if i % world != rank:
            continue
        path = directory / name
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != digest["size"]:
            problems.append(f"{path}: truncated or altered ({size} bytes, expected {digest['size']})")
        elif file_digest(path)["crc32"] != digest["crc32"]:
            problems.append(f"{path}: corrupted (checksum mismatch)")
    return problems


def all_problems(problems: list[str]) -> list[str]:
    """Every rank's problems, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problems
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    return sorted({p for ps in gathered for p in ps})
