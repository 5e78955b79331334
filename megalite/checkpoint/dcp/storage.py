"""megalite's DCP format on disk (read and write): DCP's file-system reader and writer, with
failures turned into one line naming the file.

Reading: `.metadata` goes through dcp.format's allowlist unpickler; each tensor record through
torch.load(weights_only=True), as DCP does, and a record that is refused (a pickle naming a
global, which could run code) or unreadable is reported with its file and tensor.

Writing: torch.save swallows the OSError of a failed write and raises "[enforce fail at
inline_container.cc] unexpected pos"; the writer digs the OSError back out (or, where torch
kept none, confirms a full disk from the free space left) and raises it, so every rank learns
that the device is full.
"""

import errno
import io
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from megalite.checkpoint.dcp.format import CheckpointError, read_metadata_file


def first_sentence(text: str) -> str:
    """The first sentence of the first non-empty line of `text`, whole (never cut mid-word)."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    end = re.search(r"\.(\s|$)", line)
    return line[:end.start()] if end else line


def load_failure(error: BaseException) -> str:
    """Why torch.load(weights_only=True) failed, in one clause: for a refused pickle the global
    it names or the unpickler's own complaint (torch's advice about weights_only=False left
    out), else the error's first sentence."""
    text = str(error)
    if isinstance(error, pickle.UnpicklingError):
        found = re.search(r"GLOBAL ([\w.]+)", text)
        if found:
            return f"it names the global {found.group(1)}, which could run code"
        detail = re.search(r"WeightsUnpickler error:\s*(.*?)(\n\s*\n\s*Check the documentation|$)", text, re.S)
        return first_sentence(" ".join(detail.group(1).split())) if detail else "a pickle weights_only refuses"
    return first_sentence(text) or type(error).__name__


def record_failure(path, what: str, error: BaseException) -> str:
    """One line: the record `what` of file `path` failed to load with `error`."""
    if isinstance(error, pickle.UnpicklingError):
        unsafe = " as unsafe" if "GLOBAL" in str(error) else ""
        return f"{path}: {what} refused{unsafe}, not a tensor record ({load_failure(error)}); nothing in it was run"
    return f"{path}: {what} unreadable ({load_failure(error)})"


def read_record(path: Path, info, what: str, error=CheckpointError) -> torch.Tensor:
    """One DCP storage record (`info`: its _StorageInfo in .metadata) read from `path` and loaded
    with weights_only; a short, refused or unreadable record raises `error` naming the file and
    `what`."""
    with open(path, "rb") as f:
        f.seek(info.offset)
        record = f.read(info.length)
    if len(record) != info.length:
        raise error(f"{path}: truncated ({what})")
    try:
        tensor = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a record that does not load is damage
        raise error(record_failure(path, what, e)) from None
    if not isinstance(tensor, torch.Tensor):
        raise error(f"{path}: {what} unreadable (it holds a {type(tensor).__name__}, not a tensor)")
    return tensor


def dcp_failure(error: BaseException) -> BaseException:
    """The exception behind DCP's CheckpointException, which collects every rank's failure
    (a CheckpointError or OSError first, then the lowest rank's); `error` itself otherwise."""
    if not isinstance(error, CheckpointException) or not error.failures:
        return error
    found = [f[0] if isinstance(f, tuple) else f for _, f in sorted(error.failures.items())]
    return next((e for e in found if isinstance(e, (CheckpointError, OSError))), found[0])


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with the metadata read through an allowlist unpickler and a record
    that fails to load (refused by weights_only, or damaged) reported as a CheckpointError naming
    its file, tensor and byte range."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata_file(Path(self.path) / ".metadata")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file, sinfo):
        self._reading = sinfo  # the record DCP reads next: named if it fails
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except Exception as e:  # noqa: BLE001 - a record that does not load is refused or damaged
            info = self._reading
            if info is None:
                raise
            keys = [index.fqn for index, stored in self.storage_data.items() if stored is info]
            what = (f"the record of tensor {keys[0]}" if keys else "a record") + \
                f" (bytes {info.offset}-{info.offset + info.length})"
            raise CheckpointError(record_failure(Path(self.path) / info.relative_path, what, e)) from None


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError `error` is, or was raised while handling or because of, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno is not None:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _plan_bytes(plan) -> int:
    return sum(item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize
               for item in plan.items if getattr(item, "tensor_data", None) is not None)


class CheckedFileSystemWriter(FileSystemWriter):
    """DCP's FileSystemWriter raising the OSError behind a failed write (see the module doc)."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as e:  # noqa: BLE001 - re-raised, as the OSError behind it where there is one
            cause = os_error_in(e)
            if cause is None and "unexpected pos" in str(e):  # torch.save's short write, cause dropped
                free = shutil.disk_usage(self.path).free
                if free < _plan_bytes(plan):
                    cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror, cause.filename or str(self.path)) from e
