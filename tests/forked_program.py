"""`python -m module args` or `python script.py args` as a child of the tests' fork server
(megalite.parallel.spawn): the program runs in its own process, with its own pid, environment,
working directory, argv, stdout and stderr files and exit status, as subprocess.Popen would
start it, but torch and megalite are already imported (tests/distributed.py PRELOAD), which saves the
seconds every rank of every test run would spend importing them. ForkedProgram answers the
Popen calls the tests make (pid, poll, wait, send_signal, kill).

What a fresh interpreter alone shows (start-up before torch is imported, a base install's
missing packages, interpreter teardown) is tested with real subprocesses:
tests/training/launch.py's `fork=False`."""

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from megalite.parallel.spawn import fork_server_context
from tests.distributed import PRELOAD


def _exit_status(error: SystemExit) -> int:
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _run_program(program, args, environ, cwd, stdout_path, stderr_path):
    # a fork-server child inherits "forkserver" as its default start method; a fresh interpreter's is
    # the platform's ("fork" on Linux): without this, every DataLoader worker or Pool of the program
    # started a new fork server of its own (a fresh interpreter importing torch, ~10-30 s)
    multiprocessing.set_start_method(None, force=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    out = os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if stderr_path else out
    os.dup2(out, 1)
    os.dup2(err, 2)
    status = 0
    try:
        if program[0] == "-m":
            sys.argv = [program[1], *program[2:], *args]
            sys.path[0] = cwd
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [*program, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(program[0]))
            runpy.run_path(program[0], run_name="__main__")
    except SystemExit as error:
        status = _exit_status(error)
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # what the interpreter runs at its end (logging's flush, say)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class ForkedProgram:
    """A running program (see the module's docstring); stdout to `stdout_path`, stderr to
    `stderr_path` or, without one, to stdout's file."""

    def __init__(self, program: tuple[str, ...], args: list[str], env: dict, cwd, stdout_path, stderr_path=None):
        self.args = [sys.executable, *program, *args]
        ctx = fork_server_context(PRELOAD)
        # not a daemon: the program may start processes of its own (loader workers, async saves)
        self._process = ctx.Process(target=_run_program, daemon=False,
                                    args=(program, list(args), dict(env), str(cwd), str(stdout_path),
                                          str(stderr_path) if stderr_path else None))
        self._process.start()
        self.pid = self._process.pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def run_program(argv: list[str], env: dict | None = None, cwd=None, timeout: float | None = None,
                capture_output: bool = True, text: bool = True):
    """subprocess.run(argv, capture_output=True, text=True, ...) for `argv` = [sys.executable,
    "-m", module, *args] or [sys.executable, script, *args], the program forked as above."""
    if not (capture_output and text):
        raise ValueError("run_program captures the output as text")
    if argv[0] != sys.executable:
        raise ValueError(f"run_program runs this interpreter's programs, not {argv[0]}")
    program, args = (tuple(argv[1:3]), argv[3:]) if argv[1] == "-m" else ((argv[1],), argv[2:])
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        proc = ForkedProgram(program, args, os.environ if env is None else env, cwd or os.getcwd(), out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(list(argv), code, out.read_text(), err.read_text())
