"""A megalite checkpoint read one full tensor at a time, whatever layout wrote it.

Each `get(key)` asks DCP for that one tensor at its full stored shape; DCP assembles it from
the chunks the ranks of the saving run wrote. The files are checked against common.json's
digests first, and metadata is unpickled only through megalite's allowlist reader.
"""

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

from megalite.checkpoint.publish import ConversionError
from megalite.model.config import GPTConfig
from megalite.checkpoint.dcp.format import (
    CheckpointError, and_more, read_metadata_file, single_process_dcp, verify_files,
)
from megalite.checkpoint.dcp.storage import SafeFileSystemReader, dcp_failure, first_sentence, read_record
from megalite.checkpoint.detect import checkpoint_kind, convert_first
from megalite.checkpoint.dcp.checkpoint import TRACKER, published_iteration_dir, read_tracker


def read_common(load_dir, iteration: int | None = None) -> tuple[dict, int]:
    """(common.json of the latest (or given) checkpoint under `load_dir`, its iteration)."""
    common, iteration, _ = _read_published(load_dir, iteration)
    return common, iteration


def _read_published(load_dir, iteration: int | None) -> tuple[dict, int, Path]:
    """read_common's pair and the iteration folder whose common.json it read."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    kind = checkpoint_kind(root, iteration)
    if kind not in (None, "megalite"):
        raise CheckpointError(convert_first(root, kind))
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise CheckpointError(f"{root / TRACKER}: missing (not a megalite checkpoint directory)")
    path = published_iteration_dir(root, iteration) / "common.json"
    try:
        common = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (incomplete checkpoint)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(common.get("model_config"), dict):
        raise CheckpointError(f"{path}: no model_config entry (cannot rebuild the model)")
    return common, iteration, path.parent


class MegaliteCheckpoint:
    """The latest (or given) checkpoint under a megalite --save directory."""

    def __init__(self, load_dir, iteration: int | None = None, verify: bool = True):
        self.root = Path(load_dir)
        try:
            self.common, self.iteration, self.path = _read_published(self.root, iteration)
        except CheckpointError as e:
            raise ConversionError(str(e)) from None
        if verify:
            problems = verify_files(self.path, self.common.get("files", {}))
            if problems:
                raise ConversionError(problems[0] + and_more(problems))
        try:
            self.metadata = read_metadata_file(self.path / ".metadata")
            self.config = GPTConfig.from_dict(self.common["model_config"])
        except (CheckpointError, ValueError, TypeError) as e:
            raise ConversionError(f"{self.path}: {e}") from None
        self.used: set[str] = set()

    def keys(self) -> list[str]:
        return list(self.metadata.state_dict_metadata)

    def spec(self, key: str) -> tuple[tuple, torch.dtype]:
        """(stored shape, dtype) of tensor `key`, which counts as used."""
        meta = self.metadata.state_dict_metadata.get(key)
        if meta is None or not hasattr(meta, "size"):
            raise ConversionError(f"{self.path}: checkpoint has no tensor {key}")
        self.used.add(key)
        return tuple(meta.size), meta.properties.dtype

    def unused(self, prefix: str = "model/") -> list[str]:
        """Stored keys under `prefix` that no `spec` or `get` asked for, in stored order."""
        return [key for key in self.keys() if key.startswith(prefix) and key not in self.used]

    def get(self, key: str) -> torch.Tensor:
        """The full tensor `key` ('model/<name>' or 'optimizer/<state>/<name>'), assembled
        from its stored chunks (each a torch.save record read with weights_only=True)."""
        shape, dtype = self.spec(key)
        tensor = torch.empty(shape, dtype=dtype)
        chunks = self.metadata.state_dict_metadata[key].chunks
        infos = [self.metadata.storage_data.get(MetadataIndex(key, c.offsets)) for c in chunks]
        if sum(torch.Size(c.sizes).numel() for c in chunks) != tensor.numel():
            raise ConversionError(f"{self.path}: the chunks of tensor {key} do not cover its shape {list(shape)}")
        if any(info is None or getattr(info, "transform_descriptors", None) for info in infos):
            return self._get_through_dcp(key, tensor)  # compressed or unusual storage: DCP's reader
        for chunk, info in zip(chunks, infos):
            piece = read_record(self.path / info.relative_path, info, f"the record of tensor {key}", ConversionError)
            region = tensor[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            if tuple(piece.shape) != tuple(region.shape):
                raise ConversionError(f"{self.path}: tensor {key} chunk at {list(chunk.offsets)} has shape "
                                      f"{tuple(piece.shape)}, expected {tuple(region.shape)}")
            region.copy_(piece)
        return tensor

    def _get_through_dcp(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        try:
            with single_process_dcp():
                dcp.load({key: tensor}, storage_reader=SafeFileSystemReader(self.path), no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - name the checkpoint and tensor
            failure = dcp_failure(e)
            if isinstance(failure, CheckpointError):
                raise ConversionError(str(failure)) from None
            raise ConversionError(f"{self.path}: cannot read tensor {key} ({first_sentence(failure)})") from None
        return tensor

    def get_model(self, name: str) -> torch.Tensor:
        return self.get(f"model/{name}")
