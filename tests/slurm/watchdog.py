"""The last resort of a test Slurm cluster (cluster.py): a process of its own session that
reads a pipe from the test process. EOF comes when the test process stops the cluster (the
folder is gone by then) or dies without its finalizer (SIGKILL, a crash): then it kills
every process with the cluster's SLURM_CONF in its environment (the daemons get SIGKILL from
the kernel when their parent dies, but slurmstepd, srun and the job's tasks would wait for
them forever) and removes the folder. Standard library only: it starts in a blink.

    python tests/slurm/watchdog.py FOLDER SLURM_CONF < pipe
"""

import os
import shutil
import signal
import sys
import time


def processes_with(variable: str) -> list[int]:
    """Live processes (not this one) with `variable` ("NAME=value") in their environment; a
    zombie shows an empty environment."""
    marker, found = variable.encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            pass
    return found


def kill_all_with(variable: str, rounds: int = 20):
    """SIGKILL those processes until none is left (a slurmstepd may start a task meanwhile)."""
    for _ in range(rounds):
        pids = processes_with(variable)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def main(folder: str, conf: str):
    sys.stdin.buffer.read()
    if os.path.isdir(folder):
        kill_all_with(f"SLURM_CONF={conf}")
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
