"""`python tests/training/end_watch.py PRETRAIN_ARGS...`: one pretrain_gpt rank that, once
main() has returned and before the interpreter's exit, exits with status 3 naming the gloo
threads still alive (the worker threads of a process group that outlived the run: left to the
interpreter's finalization, one that still needs the GIL aborts the process)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalite import pretrain_gpt  # noqa: E402

LEFT_THREADS = 3


def gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # a thread that just ended
            continue
    return sorted(name for name in names if "gloo" in name)


if __name__ == "__main__":
    status = pretrain_gpt.main(sys.argv[1:])
    left = gloo_threads()
    if status == 0 and left:
        print(f"end_watch: gloo threads alive after main(): {left}", flush=True)
        sys.exit(LEFT_THREADS)
    sys.exit(status)
