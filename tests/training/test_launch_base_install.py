"""scripts/pretrain_gpt.sh on a base install of megalite (`pip install -e .`, no extras): a toy
run trains; a flag whose optional package is missing (--tensorboard-dir, --wandb-project)
stops every rank with one line naming the flag and the extra to install, when the options
are validated, before any data is read or model built (before, the run prepared its data and
built its model, then failed in the logger). The default tests hide the extras
(tests/training/base_install.py); the slow one builds a real venv with `pip install
torch==2.13.0 -e .` (about 140 s on 2 busy cores, 2026-11-28)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.config.optional_packages import FLAG_PACKAGES
from tests.training.base_install import base_install_path
from tests.training.launch import REPO, SCRIPT_BASE, drop_flags, script_env, train_losses

TOY = drop_flags(SCRIPT_BASE, "--num-layers", "--hidden-size", "--ffn-hidden-size") + [
    "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48", "--tensor-model-parallel-size", "2",
    "--train-iters", "3", "--eval-iters", "0"]
MISSING = [("--tensorboard-dir", "tensorboard", "tensorboard"), ("--wandb-project", "wandb", "wandb")]


def _script(env: dict, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/pretrain_gpt.sh", *TOY, *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout)


def _check_base_install(env: dict, tmp_path: Path) -> None:
    for flag, module, extra in MISSING:
        proc = _script(env, flag, str(tmp_path / module))
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("pretrain_gpt: error:")]
        assert lines and set(lines) == {f'pretrain_gpt: error: {flag} needs {module}, which is not installed: '
                                        f'pip install -e ".[{extra}]" (or pip install {module})'}, proc.stderr
        assert "memory (rank" not in proc.stdout and not (tmp_path / module).exists()  # no model was built
    metrics = tmp_path / "metrics.jsonl"
    proc = _script(env, "--metrics-file", str(metrics))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(train_losses(metrics)) == [1, 2, 3]


def test_the_flags_table_names_real_extras():
    setup = (REPO / "setup.py").read_text()
    for _, _, _, module, extra in FLAG_PACKAGES:
        listed = setup.split(f'"{extra}": [')[1].split("]")[0] if f'"{extra}": [' in setup else ""
        assert re.search(rf'"{module}([=<>~!][^"]*)?"', listed), (extra, module)  # a version pin may follow


def test_on_a_base_install_a_missing_extra_stops_at_validation(tmp_path):
    env = script_env(PYTHONPATH=f"{base_install_path(tmp_path / 'base')}:{REPO}", NPROC_PER_NODE="2")
    _check_base_install(env, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_in_a_fresh_venv_with_only_the_base_install(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "torch==2.13.0", "-e", str(REPO)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {k: v for k, v in script_env(NPROC_PER_NODE="2").items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=str(venv / "bin" / "python"), PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
    _check_base_install(env, tmp_path)
