"""Tokenising shards in several processes, the calling one included, results in input order.

Every process takes the next shard index from a shared counter (faster ones take more)
and the caller, between its own shards, hands back the results that are complete in input
order. Forked workers inherit the caller's worker object, tokenizer loaded (nothing is
pickled); under spawn they build their own. Workers ignore SIGINT (the caller handles it),
die with the caller (Linux: PR_SET_PDEATHSIG) and are terminated when it stops early.
"""

import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys

WAIT_SECONDS = 0.5  # how often an idle caller reports progress


def context():
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def ordered_results(worker, shards, processes: int, make_worker=None, on_idle=None):
    """Yield worker.run(shard) for every shard, in order, computed by `processes` processes.

    `make_worker` (picklable, no arguments) builds a worker in a spawned process. A result
    with `.error` set stops handing out further shards and is the last one yielded; a
    worker that raises or dies raises here. Leaving the generator early terminates the
    workers.
    """
    count = len(shards)
    if processes <= 1 or count <= 1:
        yield from map(worker.run, shards)
        return
    ctx = context()
    dispenser = _Dispenser(ctx, count)
    fork = ctx.get_start_method() == "fork"
    if fork:
        gc.freeze()  # the children's garbage collector then skips (and never copies) our heap
    workers = _Workers()
    try:
        for _ in range(min(processes, count) - 1):
            workers.start(ctx, worker if fork else make_worker, not fork, shards, dispenser)
        done, ahead = {}, 0
        while ahead < count:
            if ahead in done:
                result = done.pop(ahead)
                ahead += 1
                yield result
                if result.error is not None:
                    return
                continue
            index = dispenser.take()
            if index is not None:
                done[index] = worker.run(shards[index])
                if done[index].error is not None:
                    dispenser.stop()
                workers.receive(done, dispenser, timeout=0)
            else:
                workers.receive(done, dispenser, timeout=WAIT_SECONDS)
                if on_idle is not None:
                    on_idle()
    finally:
        workers.close()
        if fork:
            gc.unfreeze()


class _Dispenser:
    """The next shard index, shared by all processes."""

    def __init__(self, ctx, count: int):
        self.next, self.count = ctx.Value("q", 0), count

    def take(self) -> int | None:
        with self.next.get_lock():
            index = self.next.value
            if index >= self.count:
                return None
            self.next.value = index + 1
            return index

    def stop(self) -> None:
        with self.next.get_lock():
            self.next.value = self.count


class _Workers:
    """The worker processes and the pipes their results come back on."""

    def __init__(self):
        self.processes, self.readers, self.running = [], [], {}

    def start(self, ctx, source, build: bool, shards, dispenser):
        reader, writer = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_child_main, args=(source, build, shards, dispenser, writer, os.getpid()),
                              daemon=True)
        process.start()
        writer.close()
        self.processes.append(process)
        self.readers.append(reader)
        self.running[process.sentinel] = process

    def receive(self, done: dict, dispenser, timeout: float) -> None:
        """Move the results that have arrived into `done`. Raises a worker's exception, or
        RuntimeError for a worker that died."""
        for ready in multiprocessing.connection.wait(self.readers + list(self.running), timeout):
            if ready in self.running:
                process = self.running.pop(ready)
                process.join()  # it has exited (its sentinel is ready); collect the exit code
                if process.exitcode != 0:
                    self._drain(done, dispenser)  # its exception, if it sent one, is raised first
                    raise RuntimeError(f"preprocessing worker process {process.pid} died "
                                       f"(exit code {process.exitcode})")
            else:
                self._drain(done, dispenser, [ready])

    def _drain(self, done, dispenser, readers=None):
        for reader in readers or list(self.readers):
            while reader.poll():
                try:
                    kind, payload = reader.recv()
                except EOFError:  # the worker finished and closed its end
                    self.readers.remove(reader)
                    reader.close()
                    break
                if kind == "exception":
                    raise payload
                done[payload.index] = payload
                if payload.error is not None:
                    dispenser.stop()

    def close(self):
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join()
        for reader in self.readers:
            reader.close()


def _child_main(source, build: bool, shards, dispenser, writer, parent_pid: int):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent_pid)
    try:
        worker = source() if build else source
        while (index := dispenser.take()) is not None:
            result = worker.run(shards[index])
            writer.send(("result", result))
            if result.error is not None:
                dispenser.stop()
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent
        try:
            writer.send(("exception", e))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            writer.send(("exception", RuntimeError(f"preprocessing worker: {e!r}")))
        os._exit(1)
    finally:
        writer.close()


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGTERM this process when its parent dies (a SIGKILLed caller leaves no
    orphan workers behind)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)
