"""A torch.distributed.checkpoint (DCP) directory written one tensor at a time, offline.

The files are those DCP's FileSystemWriter produces when every rank of a run saves: rank r's
chunks go to `__r_0.distcp`, each chunk serialised with torch.save at an offset recorded in
the `.metadata` file (DCP's Metadata, pickled), so DCP (and megalite's SafeFileSystemReader)
load and reshard it like any other checkpoint. Only the tensor being added is in memory.
"""

import os
import pickle
import zlib
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
)

from megalite.checkpoint.publish import ConversionError

DCP_VERSION = "1.0.0"


class _DigestingFile:
    """An append-only file that keeps the size and CRC32 of what was written (the digests
    common.json lists), so nothing is read back."""

    def __init__(self, path: Path):
        self.file = open(path, "wb")
        self.size, self.crc = 0, 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.file.write(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"size": self.size, "crc32": self.crc}


class StreamingDCPWriter:
    """Write chunks of full tensors into per-rank files; `close()` writes .metadata."""

    def __init__(self, directory):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.files: dict[int, object] = {}
        self.tensors: dict[str, TensorStorageMetadata] = {}
        self.storage: dict[MetadataIndex, _StorageInfo] = {}
        self.bytes_written = 0

    def _file(self, rank: int) -> _DigestingFile:
        if rank not in self.files:
            self.files[rank] = _DigestingFile(self.dir / self.file_name(rank))
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
            info = _StorageInfo(self.file_name(rank), start, length)
            self.storage[MetadataIndex(key, torch.Size(offsets), index)] = info
            metas.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        self.tensors[key] = TensorStorageMetadata(properties=TensorProperties(dtype=tensor.dtype),
                                                  size=torch.Size(tensor.shape), chunks=metas)

    def close(self) -> dict[str, dict]:
        """Flush every file and write .metadata; returns {file name: {size, crc32}}."""
        digests = {self.file_name(rank): stream.close() for rank, stream in sorted(self.files.items())}
        metadata = Metadata(state_dict_metadata=self.tensors, planner_data={k: (k,) for k in self.tensors},
                            storage_data=self.storage, storage_meta=StorageMeta(checkpoint_id=str(self.dir)),
                            version=DCP_VERSION)
        tmp = _DigestingFile(self.dir / ".metadata.tmp")
        pickle.dump(metadata, tmp)
        digests[".metadata"] = tmp.close()
        os.replace(self.dir / ".metadata.tmp", self.dir / ".metadata")
        return digests

    def abort(self) -> None:
        for stream in self.files.values():
            stream.file.close()
