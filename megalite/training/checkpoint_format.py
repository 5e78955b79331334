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
import pickle
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file or tensor."""


@contextlib.contextmanager
def single_process_dcp():
    """Silence DCP's warning that it 'assumes' single-process use without torch.distributed:
    for megalite's offline tools and single-process runs that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def tp_chunks(full_shape, partition_dim: int, stride: int, tp_size: int, valid_rows: int | None = None):
    """For each TP rank, the chunks it holds: lists of (global_offsets, sizes, local_offset).

    `full_shape` is the padded full shape; `valid_rows` trims dim 0 (vocabulary padding)."""
    full_shape = list(full_shape)
    block = full_shape[partition_dim] // stride
    per_rank = block // tp_size
    chunks = []
    for t in range(tp_size):
        mine = []
        for b in range(stride):
            start, size = b * block + t * per_rank, per_rank
            if valid_rows is not None and partition_dim == 0:
                size = max(0, min(start + size, valid_rows) - start)
            if size == 0:
                continue
            offsets = [0] * len(full_shape)
            offsets[partition_dim] = start
            sizes = list(full_shape)
            sizes[partition_dim] = size
            mine.append((offsets, sizes, b * per_rank))
        chunks.append(mine)
    return chunks


def sharded_tensor(local: torch.Tensor, chunks_per_rank, replica_ranks: list[int], tp_rank: int,
                   partition_dim: int, global_shape):
    """A ShardedTensor over `local` whose chunks are this rank's entry of `chunks_per_rank`;
    the global metadata lists every TP rank of this rank's replica (`replica_ranks`)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    device = local.device
    device_str = "cpu" if device.type == "cpu" else f"{device.type}:{device.index}"
    metas, shards = [], []
    for t, chunks in enumerate(chunks_per_rank):
        for offsets, sizes, local_offset in chunks:
            meta = ShardMetadata(offsets, sizes, f"rank:{replica_ranks[t]}/{device_str}")
            metas.append(meta)
            if t == tp_rank:
                view = local.narrow(partition_dim, local_offset, sizes[partition_dim])
                if not view.is_contiguous():
                    raise CheckpointError(f"cannot describe a non-contiguous shard (dim {partition_dim})")
                shards.append(Shard(view, meta))
    props = TensorProperties(dtype=local.dtype)
    metadata = ShardedTensorMetadata(metas, torch.Size(global_shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)


def describe(local: torch.Tensor, like: torch.Tensor, name: str, pstate, vocab_size: int):
    """The object to put in a DCP state dict for `local`, a tensor laid out as parameter `like`
    (the parameter itself, or an optimizer state of it) named `name`."""
    sharded = getattr(like, "tensor_model_parallel", False) and pstate.tp_size > 1
    is_vocab = name in VOCAB_PARAMS
    if not sharded:
        return local[:vocab_size] if is_vocab else local
    dim, stride = like.partition_dim, like.partition_stride
    full_shape = list(local.shape)
    full_shape[dim] *= pstate.tp_size
    chunks = tp_chunks(full_shape, dim, stride, pstate.tp_size, vocab_size if is_vocab else None)
    global_shape = list(full_shape)
    if is_vocab:
        global_shape[0] = vocab_size
    replica = [pstate.layout.rank_of(t, pstate.dp_rank, pstate.pp_rank) for t in range(pstate.tp_size)]
    return sharded_tensor(local, chunks, replica, pstate.tp_rank, dim, global_shape)


def global_shape_of(local: torch.Tensor, like: torch.Tensor, name: str, tp_size: int, vocab_size: int) -> list[int]:
    shape = list(local.shape)
    if getattr(like, "tensor_model_parallel", False):
        shape[like.partition_dim] *= tp_size
    if name in VOCAB_PARAMS:
        shape[0] = vocab_size
    return shape


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
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(Path(path).read_bytes())).load()
    except Exception as e:  # noqa: BLE001 - any failure means the file cannot be trusted
        raise CheckpointError(f"{path}: not a valid checkpoint metadata file ({e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not a valid checkpoint metadata file (it holds a {type(metadata).__name__}, "
                              "not DCP Metadata)")
    tensor_meta = _ALLOWED_GLOBALS[("torch.distributed.checkpoint.metadata", "TensorStorageMetadata")]
    storage_info = _ALLOWED_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")]
    for field, kind in (("state_dict_metadata", tensor_meta), ("storage_data", storage_info)):
        entries = getattr(metadata, field, None)
        if not isinstance(entries, dict) or not all(isinstance(v, kind) for v in entries.values()):
            raise CheckpointError(f"{path}: not a valid checkpoint metadata file ({field} is not a table of "
                                  f"{kind.__name__})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with the metadata read through an allowlist unpickler (tensor
    data is already read with torch.load(weights_only=True) by DCP)."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata_file(Path(self.path) / ".metadata")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# --- integrity --------------------------------------------------------------------------------

def file_digest(path: Path) -> dict:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):  # small blocks: checking a file must not cost memory
            crc = zlib.crc32(block, crc)
    return {"size": path.stat().st_size, "crc32": crc}


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
