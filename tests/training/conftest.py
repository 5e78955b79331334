"""One short training run shared by the driver tests (test_launch_script.py,
test_driver_flags.py): `bash scripts/pretrain_gpt.sh` on its local path (torchrun, two CPU
processes because TP=2), 6 iterations with dropout, checkpoints at iterations 4 and 6 (with
optimizer and RNG state), a final validation and test evaluation, --log-params-norm and
--timing-log-level 1."""

import subprocess
from types import SimpleNamespace

import pytest

from tests.training.launch import REPO, SCRIPT_BASE, TRAINED_ITERS, script_env, train_losses


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    argv = SCRIPT_BASE + [
        "--tensor-model-parallel-size", "2", "--train-iters", str(TRAINED_ITERS), "--save-interval", "4",
        "--save", str(root / "ckpt"), "--eval-iters", "1", "--eval-interval", "1000",
        "--metrics-file", str(root / "metrics.jsonl"), "--exit-reason-file", str(root / "reason.txt"),
        "--log-params-norm", "--timing-log-level", "1"]
    proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh", *argv], cwd=REPO, env=script_env(),
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    losses = train_losses(root / "metrics.jsonl")
    assert sorted(losses) == list(range(1, TRAINED_ITERS + 1)), output[-5000:]
    return SimpleNamespace(root=root, ckpt=root / "ckpt", metrics=root / "metrics.jsonl", output=output,
                           reason=root / "reason.txt", argv=argv, losses=losses)
