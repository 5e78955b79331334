"""A torch.distributed.checkpoint (DCP) directory written one tensor at a time, offline.

The files are those DCP's FileSystemWriter produces when every rank of a run saves: rank r's
chunks go to `__r_0.distcp`, each chunk serialised with torch.save at an offset recorded in
the `.metadata` file (DCP's Metadata, pickled), so DCP (and megalite's SafeFileSystemReader)
load and reshard it like any other checkpoint. Only the tensor being added is in memory.
"""

import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
)

from megalite.convert.publish import ConversionError

DCP_VERSION = "1.0.0"


class StreamingDCPWriter:
    """Write chunks of full tensors into per-rank files; `close()` writes .metadata."""

    def __init__(self, directory):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files: dict[int, object] = {}
        self.tensors: dict[str, TensorStorageMetadata] = {}
        self.storage: dict[MetadataIndex, _StorageInfo] = {}
        self.bytes_written = 0

    def _file(self, rank: int):
        if rank not in self.files:
            self.files[rank] = open(self.dir / self.file_name(rank), "wb")
        return self.files[rank]

    @staticmethod
    def file_name(rank: int) -> str:
        return f"__{rank}_0.distcp"

    def add(self, key: str, tensor: torch.Tensor, chunks) -> None:
        """Store `tensor` (the full tensor) as `key`, cut into `chunks`: (rank, offsets, sizes)."""
        if key in self.tensors:
            raise ConversionError(f"tensor {key} written twice")
        tensor = tensor.detach()
        metas = []
        for index, (rank, offsets, sizes) in enumerate(chunks):
            piece = tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            if not piece.is_contiguous() or piece.untyped_storage().nbytes() != piece.nbytes:
                piece = piece.clone(memory_format=torch.contiguous_format)  # torch.save writes whole storages
            stream = self._file(rank)
            start = stream.tell()
            torch.save(piece, stream)
            length = stream.tell() - start
            self.bytes_written += length
            self.storage[MetadataIndex(key, torch.Size(offsets), index)] = _StorageInfo(self.file_name(rank), start, length)
            metas.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        self.tensors[key] = TensorStorageMetadata(properties=TensorProperties(dtype=tensor.dtype),
                                                  size=torch.Size(tensor.shape), chunks=metas)

    def close(self) -> list[str]:
        """Flush every file and write .metadata; returns the names of the files written."""
        names = []
        for rank, stream in sorted(self.files.items()):
            stream.flush()
            os.fsync(stream.fileno())
            stream.close()
            names.append(self.file_name(rank))
        metadata = Metadata(state_dict_metadata=self.tensors, planner_data={k: (k,) for k in self.tensors},
                            storage_data=self.storage, storage_meta=StorageMeta(checkpoint_id=str(self.dir)),
                            version=DCP_VERSION)
        tmp = self.dir / ".metadata.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / ".metadata")
        return names + [".metadata"]

    def abort(self) -> None:
        for stream in self.files.values():
            stream.close()
