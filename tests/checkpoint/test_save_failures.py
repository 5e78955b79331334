"""A save that cannot be written (a full disk) ends with one line naming the checkpoint
directory and saying why, on every rank, with the previous checkpoint and the tracker intact
and the partial iter_XXXXXXX.tmp removed: end to end through a small tmpfs, and in spawned
ranks whose file writes raise ENOSPC as a full disk's do (sync and --async-save)."""

import contextlib
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import megalite.checkpoint.dcp.checkpoint as dcp_checkpoint
import megalite.checkpoint.dcp.storage as dcp_storage
from megalite.checkpoint.dcp.storage import dcp_failure
from megalite.checkpoint.dcp.checkpoint import TRACKER, iteration_dir, load_checkpoint, read_tracker, save_checkpoint
from megalite.checkpoint.dcp.format import CheckpointError, verify_files
from megalite.model.gpt import GPTModel
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import free_port, run_distributed
from tests.model.test_gpt_tp import make_config
from tests.training.launch import BASE, REPO, launch


def full_disk_line(root, iteration: int, previous: int) -> str:
    """The line a save of `iteration` into `root` that ran out of space ends with."""
    return (re.escape(f"{root}: no space left on device saving iteration {iteration} (") + r"[^)]* free\)"
            + re.escape(f"; {TRACKER} still points at iteration {previous}; removed the partial "
                        f"{iteration_dir(root, iteration).name}.tmp"))


def assert_only_previous_checkpoint(root: Path, previous: int):
    assert read_tracker(root) == previous
    assert sorted(p.name for p in root.iterdir()) == sorted([TRACKER, iteration_dir(root, previous).name])
    published = iteration_dir(root, previous)
    files = json.loads((published / "common.json").read_text())["files"]
    assert files and verify_files(published, files) == []  # every file matches its digest


class _FullDisk:
    """A file that takes `room` bytes, then fails each write as a full disk does."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= size
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


def fill_disk_after(room: int):
    """From now on DCP's data files in this process hold `room` bytes at most."""
    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with open(path, mode) as f:
            yield _FullDisk(f, room) if "w" in mode and str(path).endswith(".distcp") else f

    dcp_filesystem.FileSystem.create_stream = create_stream


def _model(state):
    return [GPTModel(make_config("llama"), state, init_seed=1)]


def _save_on_a_filling_disk(rank, world_size, root):
    """Iteration 1 saved; then rank 1's disk fills while saving iteration 2, synchronously
    then in the background: what each save raised."""
    state = ParallelState.create(ParallelLayout(world_size))
    group = dist.new_group(backend="gloo")  # for DCP's collectives in the background thread
    chunks = _model(state)
    save_checkpoint(root, 1, chunks=chunks, optimizer=None, pstate=state, common={})
    if rank == 1:
        fill_disk_after(1000)
    raised = []
    for async_save in (False, True):
        try:
            save_checkpoint(root, 2, chunks=chunks, optimizer=None, pstate=state, common={}, async_save=async_save,
                            group=group if async_save else None).finalize()
            raised.append(None)
        except CheckpointError as e:
            raised.append(str(e))
    return raised


def test_a_disk_filling_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    raised = run_distributed(_save_on_a_filling_disk, 2, str(tmp_path), timeout=120)
    assert raised[0] == raised[1]
    for message in raised[0] + raised[1]:  # each rank's, sync and async
        assert message is not None and re.fullmatch(full_disk_line(tmp_path, 2, 1), message), raised
    assert_only_previous_checkpoint(tmp_path, 1)


def test_torch_short_write_without_its_oserror_is_confirmed_by_the_free_space(tmp_path, monkeypatch):
    """torch.save reports a failed write as 'unexpected pos'; where it kept no OSError, the
    free space left decides: less than the rank's data is a full disk, more is another failure."""
    state = ParallelState.single()
    chunks = _model(state)
    save_checkpoint(tmp_path, 1, chunks=chunks, optimizer=None, pstate=state, common={})

    def short_write(self, plan, planner):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(FileSystemWriter, "write_data", short_write)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(dcp_storage.shutil, "disk_usage", lambda path: usage._replace(free=100))
    with pytest.raises(CheckpointError) as refused:
        save_checkpoint(tmp_path, 2, chunks=chunks, optimizer=None, pstate=state, common={})
    assert re.fullmatch(full_disk_line(tmp_path, 2, 1), str(refused.value))
    assert_only_previous_checkpoint(tmp_path, 1)
    monkeypatch.setattr(dcp_storage.shutil, "disk_usage", lambda path: usage._replace(free=1 << 40))
    with pytest.raises(CheckpointException) as failed:  # not a full disk: a bug keeps its traceback
        save_checkpoint(tmp_path, 2, chunks=chunks, optimizer=None, pstate=state, common={})
    assert "unexpected pos" in str(dcp_failure(failed.value))
    assert read_tracker(tmp_path) == 1


@pytest.mark.parametrize("failing", ["rng", "tracker", "tracker-overwrite"])
def test_a_full_disk_outside_dcp_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failing):
    """Full before the RNG states are written, or when the tracker is replaced (after the new
    directory was renamed into place: the rename is undone, and an overwritten iteration's old
    directory is restored)."""
    state = ParallelState.single()
    chunks = _model(state)
    save_checkpoint(tmp_path, 1, chunks=chunks, optimizer=None, pstate=state, common={"run": "first"})
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if failing == "rng":
        def save_rng_state(path, tracker):
            raise full
        monkeypatch.setattr(dcp_checkpoint, "save_rng_state", save_rng_state)
    else:
        write_text_atomic = dcp_checkpoint.write_text_atomic

        def write_tracker(path, text):
            if path.name == TRACKER:
                raise full
            write_text_atomic(path, text)
        monkeypatch.setattr(dcp_checkpoint, "write_text_atomic", write_tracker)
    iteration = 1 if failing == "tracker-overwrite" else 2
    with pytest.raises(CheckpointError) as refused:
        save_checkpoint(tmp_path, iteration, chunks=chunks, optimizer=None, pstate=state, common={"run": "second"})
    assert re.fullmatch(full_disk_line(tmp_path, iteration, 1), str(refused.value))
    assert_only_previous_checkpoint(tmp_path, 1)
    loaded = load_checkpoint(tmp_path, chunks=_model(state), pstate=state)
    assert loaded["run"] == "first"


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` (root only); the test is skipped where it cannot be."""
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _args(ckpt: Path, *extra) -> list[str]:
    return BASE + ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "1", "--eval-iters", "0", *extra]


def test_pretrain_gpt_saving_into_a_full_filesystem(tmp_path):
    """4 MiB hold the checkpoint of iteration 1 (2.6 MB) but not iteration 2's as well."""
    with small_filesystem(tmp_path / "small", "4m") as small:
        ckpt = small / "ckpt"
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-m", "megalite.pretrain_gpt", *_args(ckpt)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and re.fullmatch("pretrain_gpt: error: " + full_disk_line(ckpt, 2, 1), lines[0]), \
            proc.stderr[-3000:]
        assert_only_previous_checkpoint(ckpt, 1)


@pytest.mark.slow
def test_two_ranks_with_async_save_into_a_full_filesystem(tmp_path):
    with small_filesystem(tmp_path / "small", "4m") as small:
        ckpt = small / "ckpt"
        ranks = launch(_args(ckpt, "--async-save"), 2, tmp_path / "logs", separate_stderr=True)
        assert ranks.wait(timeout=300) == [2, 2], ranks.output()
        for rank in range(2):
            lines = ranks.stderr(rank).strip().splitlines()
            assert len(lines) == 1 and re.fullmatch("pretrain_gpt: error: " + full_disk_line(ckpt, 2, 1), lines[0]), \
                ranks.output()
        assert_only_previous_checkpoint(ckpt, 1)


def test_a_partial_directory_that_cannot_be_removed_is_named(tmp_path, monkeypatch):
    state = ParallelState.single()
    chunks = _model(state)
    save_checkpoint(tmp_path, 1, chunks=chunks, optimizer=None, pstate=state, common={})
    monkeypatch.setattr(dcp_checkpoint, "save_rng_state", lambda path, tracker: fill_the_disk())
    monkeypatch.setattr(dcp_checkpoint.shutil, "rmtree", lambda path: fail_to_remove(path))
    with pytest.raises(CheckpointError) as refused:
        save_checkpoint(tmp_path, 2, chunks=chunks, optimizer=None, pstate=state, common={})
    tmp = iteration_dir(tmp_path, 2).with_suffix(".tmp")
    assert str(refused.value).endswith(f"; the partial {tmp} is left behind (Permission denied): remove it")
    assert read_tracker(tmp_path) == 1 and tmp.is_dir()


def fill_the_disk():
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def fail_to_remove(path):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
