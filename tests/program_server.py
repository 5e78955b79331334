"""Python programs forked from a server that has imported torch and megalite once, for programs
that tests/forked_program.py's multiprocessing fork server cannot start: those whose interpreter
must differ from the test process's at start-up (the fake-CUDA shim in LD_PRELOAD, Triton's
compiled path instead of its interpreter) and those started by a shell script (gpu_check.sh's
$PYTHON). Each program is still its own process (pid, environment, argv, working directory,
stdin/stdout/stderr, exit status, signals), only without the seconds of imports.

A server is one process per pytest worker and start-up environment (the variables read when
torch, Triton or the shim load: `startup_key`), started on first use and ended with the worker.
`run(argv, env=...)` is subprocess.run(argv, capture_output=True, text=True) for
argv = [sys.executable, "-m", module | script, *args]; `python_command(env)` writes an executable
that runs `python ARGS` through the server (a program whose start-up variables differ from the
server's, or `python -c`, execs the real interpreter instead).

    python tests/program_server.py serve SOCKET   # the server (its environment is its key)
    python tests/program_server.py run SOCKET KEY ARGS...   # a client (what python_command writes)
"""

import atexit
import json
import os
import select
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# imported once by every server: what the dry runs, driver runs and tools import
PRELOAD = ("torch", "megalite.model.gpt", "megalite.training.setup_run", "megalite.training.loop",
           "megalite.config.arguments", "megalite.optimizer.mixed_precision", "megalite.parallel.pipeline.executor",
           "megalite.planner.cli")
_FIXED_KEYS = ("LD_PRELOAD", "OMP_NUM_THREADS", "MEGALITE_FAKE_CUDA_SHIM")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def startup_key(env) -> dict:
    """The variables an interpreter reads while torch, Triton and the shim load: a forked program
    sees the server's values, so only a program whose values are the server's may be forked.
    PYTHONPATH apart (`_path_fits`)."""
    return {k: v for k, v in env.items() if k in _FIXED_KEYS or k.startswith(("TRITON_", "TORCH", "PYTORCH_"))}


def _entries(pythonpath) -> list[str]:
    return list(dict.fromkeys(p for p in (pythonpath or "").split(":") if p))


def _path_fits(server_path, pythonpath) -> bool:
    """A program's PYTHONPATH may add folders to the server's (gpu_check.sh puts the repository
    first again, its test steps tools/benchmarks): the preloaded modules come from the server's."""
    return set(_entries(server_path)) <= set(_entries(pythonpath))


def _program_main(program, environ, cwd):
    """In the forked child, with fds 0-2 already the client's: run `program` as __main__."""
    import runpy
    import traceback

    os.chdir(cwd)
    served = _entries(os.environ.get("PYTHONPATH"))
    os.environ.clear()
    os.environ.update(environ)
    # as an interpreter started with the program's PYTHONPATH would have it (the site folders after)
    sys.path[1:] = [*_entries(environ.get("PYTHONPATH")), *(p for p in sys.path[1:] if p not in served)]
    status = 0
    try:
        if program[0] == "-m":
            sys.argv = [program[1], *program[2:]]
            sys.path[0] = cwd
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(program)
            sys.path[0] = os.path.dirname(os.path.abspath(program[0]))
            runpy.run_path(program[0], run_name="__main__")
    except SystemExit as error:
        if isinstance(error.code, int) or error.code is None:
            status = error.code or 0
        else:
            print(error.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _keep(conn, fds, request):
    """The server's child for one request: forks the program, tells the client its pid and then its
    exit status (negative: the signal that ended it); kills it if the client goes away first."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's own handler is not the program's
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        _program_main(request["program"], request["env"], request["cwd"])
    for fd in fds:
        os.close(fd)
    conn.sendall(struct.pack("q", pid))
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            conn.sendall(struct.pack("q", os.waitstatus_to_exitcode(status)))
            os._exit(0)
        if select.select([conn], [], [], 0.02)[0] and not conn.recv(1):  # the client is gone
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os._exit(0)


def serve(path: str) -> None:
    sys.path[0] = str(REPO)
    import importlib

    # no torch.set_num_threads here: it makes the thread pool, which a forked program that forks
    # again (the dry run's stages) finds leaked ("Invalid thread pool!")
    for name in PRELOAD:
        importlib.import_module(name)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    parent = os.getppid()
    print("ready", flush=True)
    while os.getppid() == parent and not stop:  # a worker killed outright leaves no server behind
        _reap(os.WNOHANG)
        try:
            conn, _ = listener.accept()
        except (TimeoutError, InterruptedError):
            continue
        conn.settimeout(None)
        data, fds, _, _ = socket.recv_fds(conn, 8, 3)
        size = struct.unpack("q", data)[0]
        payload = b""
        while len(payload) < size:
            payload += conn.recv(size - len(payload))
        if os.fork() == 0:
            listener.close()
            _keep(conn, fds, json.loads(payload))
        conn.close()
        for fd in fds:
            os.close(fd)
    _reap(0)


def _reap(options):
    """Wait for the finished request keepers (all, with options 0): their CPU time, and their
    programs', then counts as this server's, and the server's as its pytest worker's."""
    try:
        while os.waitpid(-1, options)[0]:
            pass
    except ChildProcessError:
        pass


def _start(path, env, program, fds, cwd):
    """Connect, send the request with `fds` as the program's stdin, stdout and stderr; (socket, pid)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    payload = json.dumps({"program": list(program), "env": dict(env), "cwd": str(cwd)}).encode()
    socket.send_fds(conn, [struct.pack("q", len(payload))], list(fds))
    conn.sendall(payload)
    return conn, _read_int(conn)


def _read_int(conn) -> int:
    data = b""
    while len(data) < 8:
        chunk = conn.recv(8 - len(data))
        if not chunk:
            raise ConnectionError("the program server closed the connection")
        data += chunk
    return struct.unpack("q", data)[0]


def client(path: str, key: str, args: list[str]) -> None:
    """`python ARGS` through the server at `path` (never returns): signals the caller sends go to
    the program, and the program's exit status (or signal) is this process's."""
    served = json.loads(key)
    fits = startup_key(os.environ) == served["startup"] and _path_fits(served["path"], os.environ.get("PYTHONPATH"))
    if not fits or not args or args[0] == "-c" or not os.path.exists(path):
        os.execv(sys.executable, [sys.executable, *args])
    conn, pid = _start(path, os.environ, args, (0, 1, 2), os.getcwd())
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _frame: os.kill(pid, sig))
    status = _read_int(conn)
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


class ProgramServers:
    """The servers of one pytest worker, by start-up environment; ended at its exit."""

    def __init__(self):
        self._servers = {}
        self._folder = tempfile.mkdtemp(prefix="megalite-programs-")
        atexit.register(self.close)

    def socket_for(self, env) -> str:
        key = json.dumps([startup_key(env), env.get("PYTHONPATH")], sort_keys=True)
        if key not in self._servers:
            path = os.path.join(self._folder, f"server{len(self._servers)}.sock")
            proc = subprocess.Popen([sys.executable, __file__, "serve", path], env=env, stdout=subprocess.PIPE,
                                    cwd=REPO)
            if proc.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"the program server for {key} did not start (exit {proc.wait()})")
            self._servers[key] = (path, proc)
        return self._servers[key][0]

    def close(self):
        for _, proc in self._servers.values():
            proc.terminate()
        for _, proc in self._servers.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._servers.clear()


_SERVERS = []


def servers() -> ProgramServers:
    if not _SERVERS:
        _SERVERS.append(ProgramServers())
    return _SERVERS[0]


def run(argv: list[str], env: dict | None = None, cwd=None, timeout: float | None = None,
        capture_output: bool = True, text: bool = True):
    """subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout) for
    argv = [sys.executable, "-m", module, *args] or [sys.executable, script, *args], forked."""
    if not (capture_output and text):
        raise ValueError("program_server.run captures the output as text")
    if argv[0] != sys.executable:
        raise ValueError(f"program_server.run runs this interpreter's programs, not {argv[0]}")
    env = dict(os.environ if env is None else env)
    path = servers().socket_for(env)
    with tempfile.TemporaryDirectory() as folder, open(os.devnull) as stdin:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        with open(out, "w") as out_file, open(err, "w") as err_file:
            conn, pid = _start(path, env, argv[1:], (stdin.fileno(), out_file.fileno(), err_file.fileno()),
                               os.path.abspath(cwd or os.getcwd()))
        with conn:
            conn.settimeout(timeout)
            try:
                status = _read_int(conn)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(argv, timeout) from None
        return subprocess.CompletedProcess(list(argv), status, out.read_text(), err.read_text())


def python_command(folder, env: dict | None = None) -> str:
    """An executable file in `folder` that runs `python ARGS` through the server for `env`
    (default: this process's environment): a stand-in for the interpreter in a shell script."""
    env = dict(os.environ if env is None else env)
    path = Path(folder, "python")
    key = json.dumps({"startup": startup_key(env), "path": env.get("PYTHONPATH")})
    words = [sys.executable, "-S", __file__, "run", servers().socket_for(env), key]
    path.write_text(f"#!/bin/sh\nexec {' '.join(map(shlex.quote, words))} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        client(sys.argv[2], sys.argv[3], sys.argv[4:])
