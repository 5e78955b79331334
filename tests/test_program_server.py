"""tests/program_server.py: a program forked from the server behaves as one the interpreter
starts (argv, environment, working directory, output, exit status, signals), with torch already
imported; a program whose start-up variables differ from the server's gets a fresh interpreter."""

import os
import signal
import subprocess
import sys
import time

from tests import program_server

PROGRAM = """import os, sys
print("torch preloaded:", "torch" in sys.modules, "argv:", sys.argv[1:], "cwd:", os.getcwd(),
      "env:", os.environ.get("PROGRAM_SERVER_TEST"), flush=True)
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["sleep"]:
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


def test_a_forked_program_has_its_argv_environment_folder_output_and_status(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, PROGRAM_SERVER_TEST="here")
    done = program_server.run([sys.executable, str(script), "3"], env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == f"torch preloaded: True argv: ['3'] cwd: {tmp_path} env: here\n"
    assert done.stderr == "to stderr\n"


def test_the_shell_stand_in_forwards_signals_and_falls_back_to_the_interpreter(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    python = program_server.python_command(tmp_path)
    done = subprocess.run([python, str(script), "0"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.split()[:3]) == (0, ["torch", "preloaded:", "True"]), done.stderr
    # another start-up variable (Triton's mode, read when triton loads): a real interpreter, as
    # gpu_check.sh's host-overhead step needs
    env = dict(os.environ, TRITON_INTERPRET="0" if os.environ.get("TRITON_INTERPRET") == "1" else "1")
    done = subprocess.run([python, str(script), "5"], capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode, done.stdout.split()[:3]) == (5, ["torch", "preloaded:", "False"]), done.stderr
    proc = subprocess.Popen([python, str(script), "sleep"], stdout=subprocess.PIPE, text=True)
    assert "torch preloaded: True" in proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM


def test_a_program_past_its_timeout_is_killed(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM.replace("print(", "open('started', 'w').close(); print(", 1))
    began = time.monotonic()
    try:
        program_server.run([sys.executable, str(script), "sleep"], cwd=tmp_path, timeout=2)
    except subprocess.TimeoutExpired:
        pass
    else:
        raise AssertionError("no timeout")
    assert time.monotonic() - began < 30 and (tmp_path / "started").exists()
