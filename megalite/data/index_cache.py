"""On-disk cache of index arrays: built by one process, memory-mapped by all.

Arrays live in `cache_dir` as `{key}-{name}-{array}.npy`, written under temporary names and
renamed; `{key}-{name}-description.json` is written last and marks the entry complete. The
key hashes a description of every input that changes the arrays. One process builds while
the others wait on an exclusive file lock (fcntl.flock), polling, so a long build never
sits inside a torch.distributed collective and cannot time out a process group.
"""

import hashlib
import json
import os
import sys
import time

import numpy as np

LOCK_POLL_SECONDS = 0.2
LOCK_LOG_SECONDS = 60.0


def cache_key(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]


def digest(array: np.ndarray) -> str:
    """Content hash of an array (used to key caches on sequence lengths)."""
    return hashlib.blake2b(np.ascontiguousarray(array).view(np.uint8), digest_size=16).hexdigest()


def cached_arrays(cache_dir: str | None, name: str, description: dict, names: tuple[str, ...], build,
                  log=None) -> tuple[dict[str, np.ndarray], dict[str, str] | None]:
    """Return ({array name: array}, {array name: path} or None).

    Loads the arrays memory-mapped from `cache_dir` when a complete entry exists; otherwise
    takes the lock, builds them with `build()` (unless another process finished meanwhile),
    saves them and loads them. Without a usable cache_dir the arrays are built in memory.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if cache_dir is None:
        return build(), None
    key = cache_key(description)
    base = os.path.join(cache_dir, f"{key}-{name}")
    paths = {n: f"{base}-{n}.npy" for n in names}
    marker = f"{base}-description.json"
    if not os.path.isfile(marker):
        try:
            os.makedirs(cache_dir, exist_ok=True)
            lock = open(f"{base}.lock", "a")
        except OSError as e:
            log(f"index cache {cache_dir} is not writable ({e}); building {name} indices in memory")
            return build(), None
        with lock:
            _acquire(lock, base, log)
            try:
                if not os.path.isfile(marker):
                    start = time.perf_counter()
                    arrays = build()
                    for n in names:
                        _save(paths[n], arrays[n])
                    _write_text(marker, json.dumps(description, indent=1, sort_keys=True))
                    log(f"built {name} indices in {time.perf_counter() - start:.2f} s -> {base}-*.npy")
            finally:
                _release(lock)
    return {n: np.load(paths[n], mmap_mode="r") for n in names}, paths


def _acquire(lock, base, log):
    """Take the exclusive lock, polling. Where the filesystem has no locks, go on without:
    concurrent builders then write identical files, each renamed into place atomically."""
    import fcntl

    waited, next_log = 0.0, LOCK_LOG_SECONDS
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(LOCK_POLL_SECONDS)
            waited += LOCK_POLL_SECONDS
            if waited >= next_log:
                log(f"waiting {waited:.0f} s for another process building {base}-*.npy")
                next_log += LOCK_LOG_SECONDS
        except OSError as e:
            log(f"cannot lock {base}.lock ({e}); building without the lock")
            return


def _release(lock):
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_UN)
    except OSError:
        pass


def _save(path: str, array: np.ndarray):
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_text(path: str, text: str):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
