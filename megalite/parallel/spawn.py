"""Run a function in spawned CPU processes joined by a gloo process group (for tests,
benchmarks and experiments on one machine; training runs use torchrun or srun).

    results = run_distributed(fn, world_size, arg1, arg2)

calls fn(rank, world_size, arg1, arg2) in each process (fn must be a module-level function)
and returns the per-rank return values. A failure on any rank raises here with that rank's
traceback, a rank that dies without one (killed, or a crash outside Python) at once; a hang is
killed after `timeout` seconds without a result. A rank waiting longer than `collective_timeout`
seconds in one collective or transfer, on any group (those `fn` creates included), fails with
gloo's timeout error and its traceback: a deadlock names where each rank waits instead of
running into `timeout` or the test's.

The ranks are forked from multiprocessing's fork server, a clean process started on the first
call that has imported torch, fn's module and `preload` once: a rank then starts in
milliseconds instead of importing torch and megalite again (seconds each; most of a small
test's time). They get the caller's environment as it is at the call.
"""

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d

from megalite.parallel.state import ParallelLayout, ParallelState


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out on its own (connect(), bind to 0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORT_LOW = 15000
_next_port = [None]


def free_port() -> int:
    """A port free now for a rendezvous that binds it later (after its ranks start Python).

    Not one the kernel picks: between this check and the bind, any process's connect() or
    gloo's pair listeners may take a kernel-picked port (a run then fails with "The server
    socket has failed to listen"). Ports below the kernel's range are taken only by those who
    name them; each process walks them from its own starting point, so two processes calling
    this at once (parallel test workers) meet only if one overtakes the other's walk."""
    high = max(_ephemeral_low(), _PORT_LOW + 1000)
    span = high - _PORT_LOW
    if _next_port[0] is None:
        _next_port[0] = (os.getpid() * 7919 + time.monotonic_ns()) % span
    for _ in range(span):
        port = _PORT_LOW + _next_port[0] % span
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORT_LOW}-{high - 1}")


def pair_state(rank: int) -> ParallelState:
    """Ranks {0, 1} and {2, 3} of a world of 4 as two independent DP = 2 runs (a collective:
    every rank creates both groups)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    return ParallelState(ParallelLayout(2), rank % 2, {"dp": group, "world": group})


def _worker(rank, world_size, port, collective_timeout, fn, args, results, environ):
    # the fork server's environment is the caller's when the server started
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        wait = timedelta(seconds=collective_timeout)
        # Groups made without a timeout (ParallelState.create's, a test's own new_group) take
        # torch's default, not the world group's: set that default too, in this process only.
        distributed_c10d.default_pg_timeout = wait
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=wait)
        out = fn(rank, world_size, *args)
        # Tensors go by value: a queue would share their storage with a process about to exit.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def fork_server_context(preload: Sequence[str] = ()):
    """multiprocessing's fork-server context; `preload` (module names) is imported by the
    server when it starts, that is on the first use in this process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["megalite.parallel.spawn", *preload])
    return ctx


def run_distributed(fn, world_size: int, *args, timeout: float = 300, collective_timeout: float = 300,
                    preload: Sequence[str] = ()):
    ctx = fork_server_context([*preload, *([fn.__module__] if fn.__module__ != "__main__" else [])])
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, collective_timeout, fn, args, results, environ),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors, deadline = {}, {}, None
    try:
        waited = 0.0
        while len(out) + len(errors) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    break
                waited += 1.0
                # a rank that died without reporting (killed, crashed in C++) would leave the others
                # waiting in a collective: say so now instead of after the whole timeout
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if r not in out and r not in errors and p.exitcode is not None]
                if dead and results.empty():
                    raise RuntimeError(f"{fn.__name__}: rank {dead[0][0]} exited with status {dead[0][1]} without a "
                                       "result or a traceback (killed, or crashed outside Python)")
                if waited >= timeout:
                    raise TimeoutError(f"{fn.__name__}: no result from ranks "
                                       f"{sorted(set(range(world_size)) - set(out))} within {timeout}s")
                continue
            waited = 0.0
            if status == "ok":
                out[rank] = torch.load(io.BytesIO(value), weights_only=True)
                continue
            errors[rank] = value
            if "Timed out" not in value:
                break
            # A collective timed out: in a deadlock every rank's wait does, each traceback naming
            # where that rank waits; collect them for a while
            deadline = deadline or time.monotonic() + collective_timeout + 10
        if errors:
            raise RuntimeError("\n".join(f"{fn.__name__} failed on rank {r}:\n{tb}" for r, tb in errors.items()))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
