"""Conversion errors and atomic publication of an output directory (any format, write).

A converter writes everything under a hidden sibling `.NAME.tmp-PID` of the requested
--save-dir and renames it into place only when complete, so an interrupted or failed
conversion leaves nothing under the final name.
"""

import contextlib
import os
import shutil
from pathlib import Path


class ConversionError(ValueError):
    """Bad converter input; the message is one line naming the file, tensor or flag."""


@contextlib.contextmanager
def staged_output(save_dir):
    """Yield a temporary directory that becomes `save_dir` when the block completes."""
    final = Path(save_dir).absolute()
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise ConversionError(f"--save-dir {final}: already exists and is not empty (choose a new directory)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        final.rmdir()  # an empty directory made beforehand
    os.rename(tmp, final)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
