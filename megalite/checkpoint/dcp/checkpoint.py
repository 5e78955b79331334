"""Saving and loading a training run's megalite checkpoint (DCP), resharding on load.

Layout (Megatron's):
    <save>/latest_checkpointed_iteration.txt        the last complete checkpoint's iteration
    <save>/iter_0000100/.metadata, __R_I.distcp      model and optimizer tensors (DCP)
    <save>/iter_0000100/common.json                  iteration, samples, scheduler, args, file digests
    <save>/iter_0000100/rng_tp0_pp0_dp0.json          each rank's RNG states

A checkpoint is written to iter_XXXXXXX.tmp and renamed when every rank has finished, then
the tracker file is replaced atomically: a crash at any moment leaves the previous checkpoint
loadable and the tracker pointing at it. Saving an iteration that already exists first renames
the old directory to iter_XXXXXXX.old and deletes it only once the new one is published; until
then a load finds it there. common.json holds the size and CRC32 of every other file (tensor
data, metadata, RNG states) and a load refuses a file that does not match. Nothing is unpickled
on load but DCP's metadata, through an allowlist (dcp.format), and tensor records, through
torch.load(weights_only=True) (dcp.storage: a record naming a global is refused, naming its
file and tensor). A save that cannot be written (a full disk) raises the same CheckpointError,
naming the directory, on every rank; the previous checkpoint and the tracker stay, and the
partial iter_XXXXXXX.tmp is removed.

Optimizer state is saved as each rank holds it: under the distributed optimizer (or FSDP2)
every DP rank writes only its own slice of the fp32 main parameters and optimizer moments, and
every rank reads only the elements its own layout needs.
"""

import errno
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megalite.checkpoint.dcp.format import (
    CheckpointError, all_problems, and_more, check_shapes, dcp_state_dict, file_digest, read_metadata_file,
    single_process_dcp, tensor_entries, verify_files,
)
from megalite.checkpoint.dcp.storage import (
    CheckedFileSystemWriter, SafeFileSystemReader, dcp_failure, first_sentence, os_error_in, record_failure,
)
from megalite.checkpoint.dcp.integrity import save_integrity_manifest
from megalite.checkpoint.dcp.rng_state import layout_record, load_rng_state, rng_file_name, save_rng_state

log = logging.getLogger(__name__)
TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _aside_dir(final: Path) -> Path:
    """Where an overwritten checkpoint waits until its replacement is published."""
    return final.with_suffix(".old")


def published_iteration_dir(root, iteration: int) -> Path:
    """iter_XXXXXXX, or its .old copy where a save overwriting that iteration was interrupted."""
    path = iteration_dir(root, iteration)
    return _aside_dir(path) if not path.is_dir() and _aside_dir(path).is_dir() else path


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agree(message: str | None, group=None) -> str | None:
    """The first failure message any rank has (None when every rank succeeded); a barrier."""
    if not _distributed():
        return message
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, message, group=group)
    return next((m for m in gathered if m), None)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_tracker(root) -> int | None:
    path = Path(root) / TRACKER
    if not path.exists():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}")
    return int(text)


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def _save_failure(root: Path, iteration: int, error: BaseException) -> str | None:
    """One line for a save that an OSError on some rank stopped (a full disk, a lost mount,
    permissions), naming the directory and what is left; None for any other failure (a bug,
    whose traceback is kept)."""
    cause = os_error_in(dcp_failure(error))
    if cause is None:
        return None
    if cause.errno == errno.ENOSPC:
        free = shutil.disk_usage(root).free if root.is_dir() else 0
        what = f"no space left on device saving iteration {iteration} ({_size(free)} free)"
    else:
        what = f"cannot save iteration {iteration}: {cause.strerror or first_sentence(cause)}"
        what += f" ({cause.filename})" if cause.filename else ""
    try:
        previous = read_tracker(root)
    except (CheckpointError, OSError):
        previous = None
    kept = f"{TRACKER} still points at iteration {previous}" if previous is not None else "no checkpoint is published"
    return f"{root}: {what}; {kept}"


def _give_up(tmp: Path, message: str):
    """Every rank, after a save failed on some rank: rank 0 removes the partial directory, and
    every rank raises rank 0's line."""
    line = None
    if _rank() == 0:
        try:
            shutil.rmtree(tmp)
            line = f"{message}; removed the partial {tmp.name}"
        except FileNotFoundError:
            line = message
        except OSError as e:
            line = f"{message}; the partial {tmp} is left behind ({e.strerror}): remove it"
    raise CheckpointError(_agree(line))


class PendingSave:
    """A checkpoint being written; `finalize()` (on every rank) waits for it and publishes it.
    Its own collectives run on the default group from the training thread; DCP's background
    writes use the separate group given to save_checkpoint. A write that fails on any rank
    raises the same CheckpointError on every rank, with the previous checkpoint and the tracker
    untouched and the partial directory removed."""

    def __init__(self, root, iteration, tmp, common, rng_file: str, future=None, error: str | None = None,
                 integrity: bool = False):
        self.root, self.iteration, self.tmp, self.common = Path(root), iteration, tmp, common
        self.rng_file, self.future, self.error, self.integrity = rng_file, future, error, integrity

    def done(self) -> bool:
        """Whether every rank's write has finished (a collective when distributed)."""
        local = self.future is None or self.future.done()
        if not _distributed():
            return local
        flag = torch.tensor([1 if local else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def failed(self, error: BaseException):
        """Every rank, when DCP's write failed (DCP reports a failure to every rank at once)."""
        message = _save_failure(self.root, self.iteration, error)
        if message is None:
            raise error
        _give_up(self.tmp, message)

    def finalize(self) -> Path:
        if self.future is not None:
            try:
                self.future.result()
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - sorted by failed()
                self.failed(e)
        rank = _rank()
        mine = {"!error": self.error} if self.error else {}
        if not self.error:
            mine = {p.name: file_digest(p) for p in self.tmp.glob(f"__{rank}_*.distcp")}
            mine[self.rng_file] = file_digest(self.tmp / self.rng_file)
        gathered = [mine]
        if _distributed():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        errors = [part["!error"] for part in gathered if "!error" in part]
        if errors:
            _give_up(self.tmp, errors[0])
        final = iteration_dir(self.root, self.iteration)
        failure = None
        if rank == 0:
            files = {k: v for part in gathered for k, v in part.items()}
            files[".metadata"] = file_digest(self.tmp / ".metadata")
            try:
                self._publish(final, {**self.common, "files": files})
            except OSError as e:
                failure = self._unpublish(final, e)
        failure = _agree(failure)
        if failure:
            raise CheckpointError(failure)
        return final

    def _publish(self, final: Path, common: dict) -> None:
        write_text_atomic(self.tmp / "common.json", json.dumps(common, indent=1, sort_keys=True))
        if self.integrity:
            save_integrity_manifest(self.tmp)
        aside = _aside_dir(final)
        if final.exists():  # overwrite: keep the old one loadable until the new one is published
            os.replace(final, aside)  # free: save_checkpoint settled every .old before this save
        os.replace(self.tmp, final)
        write_text_atomic(self.root / TRACKER, str(self.iteration))
        shutil.rmtree(aside, ignore_errors=True)

    def _unpublish(self, final: Path, error: OSError) -> str:
        """Rank 0, when publishing failed: back to the previous checkpoint; the line to raise."""
        message = _save_failure(self.root, self.iteration, error)
        aside = _aside_dir(final)
        try:
            if final.exists() and not self.tmp.exists():
                os.replace(final, self.tmp)  # renamed before the tracker could follow
            if aside.exists():
                os.replace(aside, final)
            shutil.rmtree(self.tmp)
            return f"{message}; removed the partial {self.tmp.name}"
        except OSError as e:
            return f"{message}; the partial {self.tmp} is left behind ({e.strerror}): remove it"


def _finish_interrupted_overwrites(root: Path) -> None:
    """Settle what a crash during an overwrite left: an old directory set aside whose
    replacement was published is deleted; one whose replacement never appeared is restored."""
    for aside in root.glob("iter_*.old"):
        final = aside.with_suffix("")
        if final.exists():
            shutil.rmtree(aside)
        else:
            os.replace(aside, final)


def save_checkpoint(root, iteration: int, *, chunks, optimizer, pstate, rng_tracker=None, common: dict,
                    async_save: bool = False, group=None, fully_parallel: bool = True,
                    cache_plan: bool = False, verify_integrity: bool = False) -> PendingSave:
    """Write a checkpoint of `chunks` (and `optimizer`) at `iteration`; every rank calls this.

    Returns a PendingSave; synchronous saves are already published, asynchronous ones are
    published by `finalize()`. `common` holds JSON-able run state (iteration, consumed samples,
    scheduler and optimizer scalars, args) and is written by rank 0. `group` carries DCP's
    collectives: asynchronous saves need one of their own (a gloo group), since they run in a
    background thread while training uses the default group. `fully_parallel`
    (--ckpt-fully-parallel-save) spreads the writing of replicated tensors over the ranks holding
    them; without it the lowest such rank writes each. `cache_plan`
    (--ckpt-assume-constant-structure) lets DCP reuse the previous save's plan. `verify_integrity`
    adds the SHA-256 manifest (megalite.checkpoint.dcp.integrity) before the checkpoint is published. A
    write that fails (a full disk) raises CheckpointError on every rank (see PendingSave)."""
    root = Path(root)
    tmp = iteration_dir(root, iteration).with_suffix(".tmp")
    failure = None
    if _rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _finish_interrupted_overwrites(root)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a crash during an earlier save
            tmp.mkdir()
        except OSError as e:
            failure = _save_failure(root, iteration, e)
    failure = _agree(failure, group)
    if failure:
        raise CheckpointError(failure)
    optimizer_state = optimizer.sharded_state_dict() if optimizer is not None else {"params": {}}
    entries, vocab = tensor_entries(chunks, optimizer_state.pop("params"), pstate, for_load=False)
    with single_process_dcp():
        state = dcp_state_dict(entries, pstate, vocab)
    rng_file = rng_file_name(pstate)
    error = None
    try:
        save_rng_state(tmp / rng_file, rng_tracker)
    except OSError as e:
        error = _save_failure(root, iteration, e)  # reported to every rank by finalize
    common = {**common, "iteration": iteration, "optimizer": optimizer_state,
              "layout": layout_record(pstate)}
    writer = CheckedFileSystemWriter(tmp, thread_count=1, sync_files=True)
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=not fully_parallel, enable_plan_caching=cache_plan)
    no_dist = not _distributed()
    pending = PendingSave(root, iteration, tmp, common, rng_file, error=error, integrity=verify_integrity)
    with single_process_dcp():
        if async_save:
            future = dcp.async_save(state, storage_writer=writer, planner=planner, process_group=group, no_dist=no_dist)
            pending.future = getattr(future, "upload_completion", future)
            return pending
        try:
            dcp.save(state, storage_writer=writer, planner=planner, process_group=group, no_dist=no_dist)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - sorted by failed()
            pending.failed(e)
    pending.finalize()
    return pending


def _read_common(path: Path) -> dict:
    common_path = path / "common.json"
    if not common_path.exists():
        raise CheckpointError(f"{common_path}: missing (incomplete checkpoint)")
    try:
        return json.loads(common_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{common_path}: not valid JSON ({e})") from e


def _load_tensors(path: Path, metadata, entries, pstate, vocab) -> None:
    """Load `entries` from the checkpoint at `path`, whose .metadata the caller has read."""
    check_shapes(metadata, entries, pstate, vocab, path)
    try:
        with single_process_dcp():
            state = dcp_state_dict(entries, pstate, vocab)
            dcp.load(state, storage_reader=SafeFileSystemReader(path), no_dist=not _distributed())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP gathers every rank's failure
        failure = dcp_failure(e)
        if isinstance(failure, CheckpointError):  # a refused or damaged record, named by the reader
            raise CheckpointError(str(failure)) from None
        if isinstance(failure, pickle.UnpicklingError):  # where DCP's reader did not say which record
            raise CheckpointError(record_failure(path, "a record", failure)) from None
        raise CheckpointError(f"{path}: failed to load ({first_sentence(failure)})") from e


def _load_one(path: Path, *, chunks, pstate, rng_tracker, load_rng: bool) -> dict:
    common = _read_common(path)
    world, rank = (dist.get_world_size(), dist.get_rank()) if _distributed() else (1, 0)
    problems = all_problems(verify_files(path, common.get("files", {}), rank, world))
    if problems:
        raise CheckpointError(problems[0] + and_more(problems))
    entries, vocab = tensor_entries(chunks, {}, pstate, for_load=True)
    metadata = read_metadata_file(path / ".metadata")
    # checkpoints from before expert biases were saved (and conversions without them) start them at 0;
    # an FP8 run from a checkpoint without FP8 scaling state (a bf16 run's) starts its scales afresh
    entries = [e for e in entries if not (e[3].endswith("expert_bias") or e[0].startswith("fp8/"))
               or e[0] in metadata.state_dict_metadata]
    _load_tensors(path, metadata, entries, pstate, vocab)
    if load_rng:
        load_rng_state(path, pstate, rng_tracker, common.get("layout"))
    return {**common, "path": str(path)}


def load_optimizer_state(common: dict, *, chunks, optimizer, pstate) -> None:
    """Second phase of a load: the optimizer's state from the checkpoint `load_checkpoint`
    returned. Build the optimizer after loading the model, so its fp32 main parameters start
    from the loaded weights; then call this unless --no-load-optim or --finetune."""
    path = Path(common["path"])
    saved = common.get("optimizer") or {}
    if saved.get("optimizer") is None:
        raise CheckpointError(f"{path}: the checkpoint has no optimizer state (a converted or --no-save-optim "
                              "checkpoint): use --no-load-optim or --finetune")
    if saved.get("optimizer") != optimizer.kind:
        raise CheckpointError(f"{path}: optimizer state is for {saved.get('optimizer')!r}, this run uses "
                              f"{optimizer.kind!r} (use --no-load-optim to start the optimizer afresh)")
    metadata = read_metadata_file(path / ".metadata")
    states = sorted({k.split("/")[1] for k in metadata.state_dict_metadata if k.startswith("optimizer/")})
    buffers = optimizer.empty_sharded_state(states)  # only the elements this rank holds
    entries, vocab = tensor_entries(chunks, buffers, pstate, for_load=True)
    _load_tensors(path, metadata, [e for e in entries if e[0].startswith("optimizer/")], pstate, vocab)
    try:
        optimizer.load_sharded_state_dict({**saved, "params": buffers})
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: optimizer state does not fit this run ({e})") from e


def load_checkpoint(root, *, chunks, pstate, rng_tracker=None, load_rng=True, fallback=False,
                    iteration: int | None = None):
    """Load the model weights (and RNG states) of the latest checkpoint under `root` into
    `chunks`; return its common state (a dict, with "path") or None when there is none. A
    damaged checkpoint raises CheckpointError naming the file, unless `fallback` is set: then
    earlier checkpoints are tried, newest first. Optimizer state: `load_optimizer_state`."""
    root = Path(root)
    latest = read_tracker(root) if iteration is None else iteration
    if latest is None:
        return None
    candidates = [latest]
    if fallback:
        older = sorted((int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit()), reverse=True)
        candidates += [i for i in older if i < latest]
    error = None
    for it in candidates:
        path = published_iteration_dir(root, it)
        try:
            if not path.is_dir():
                raise CheckpointError(f"{path}: missing (tracker {root / TRACKER} points at iteration {it})")
            return _load_one(path, chunks=chunks, pstate=pstate, rng_tracker=rng_tracker, load_rng=load_rng)
        except CheckpointError as e:
            if not fallback:
                raise
            log.warning("checkpoint %s refused: %s; trying an earlier one", path, e)
            error = e
    raise CheckpointError(f"no usable checkpoint under {root}; last error: {error}")
