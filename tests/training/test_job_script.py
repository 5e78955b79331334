"""scripts/slurm/pretrain_gpt.sbatch run by bash as Slurm runs it, with stand-ins for srun
(it starts the tasks, `bash scripts/pretrain_gpt.sh ...` each with its SLURM_* variables) and
scontrol, on a base install of megalite (tests/training/base_install.py: no tensorboard):
- the job trains without --tensorboard-dir (before, every rank stopped on "--tensorboard-dir
  needs the tensorboard package" after preparing its data and building its model);
- each task is one Python process (before, scripts/pretrain_gpt.sh started Python once to read
  the options, then again as the rank), counted through a PYTHON wrapper that logs each start;
- a SIGUSR1 during the ranks' start-up stops them with nothing saved, and the job requeues
  itself as after a SIGUSR1 in the loop.
tests/slurm runs the same script on a real Slurm cluster."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.checkpoint.dcp.checkpoint import read_tracker
from tests.data.conftest import load_tool
from tests.training.base_install import base_install_path
from tests.training.launch import REPO, script_env, train_losses
from tests.training.test_start_up_signal import signal_when_caught

SBATCH = REPO / "scripts" / "slurm" / "pretrain_gpt.sbatch"
TASKS = 2
CONFIG = """num-layers: 2
hidden-size: 32
num-attention-heads: 4
seq-length: 32
max-position-embeddings: 32
tensor-model-parallel-size: 2
micro-batch-size: 2
global-batch-size: 4
train-iters: 3
lr: 1.0e-3
tokenizer-type: SentencePieceTokenizer
split: "90,5,5"
num-workers: 0
log-interval: 1
eval-iters: 1
eval-interval: 100
save-interval: 100
"""
SRUN = """#!/bin/bash
# srun --kill-on-bad-exit=1 COMMAND...: FAKE_TASKS tasks of COMMAND on one node
shift
pids=()
for ((task = 0; task < FAKE_TASKS; task++)); do
    SLURM_PROCID=$task SLURM_LOCALID=$task SLURM_NTASKS=$FAKE_TASKS SLURM_STEP_ID=0 SLURM_JOB_NODELIST=node01 \\
        "$@" > "$FAKE_LOGS/task$task.log" 2>&1 &
    pids+=($!)
    echo $! >> "$FAKE_LOGS/pids"
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
SCONTROL = """#!/bin/bash
echo "$*" >> "$FAKE_LOGS/scontrol"
[[ $1 == show && $2 == hostnames ]] && echo 127.0.0.1
exit 0
"""
PYTHON = f"""#!/bin/bash
echo "${{SLURM_PROCID:-job}}" >> "$FAKE_LOGS/python-starts"
exec "{sys.executable}" "$@"
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    jsonl, prefix = root / "corpus.jsonl", root / "tokenizer"
    load_tool("make_demo_corpus").main(["--output", str(jsonl), "--max-mb", "0.1"])
    load_tool("train_tokenizer").main(["--input", str(jsonl), "--json-keys", "text", "--vocab-size", "600",
                                       "--model-prefix", str(prefix)])
    assert load_tool("preprocess_data").main([
        "--input", str(jsonl), "--json-keys", "text", "--output-prefix", str(root / "demo"),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f"{prefix}.model", "--append-eod"]) == 0
    return {"data": root / "demo_text_document", "tokenizer": Path(f"{prefix}.model")}


def _job(tmp_path: Path, corpus) -> tuple[list[str], dict]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL), ("python", PYTHON)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "config.yaml").write_text(CONFIG)
    (tmp_path / "logs").mkdir()
    env = script_env(PATH=f"{bin_dir}:{script_env()['PATH']}", PYTHON=str(bin_dir / "python"),
                     PYTHONPATH=f"{base_install_path(tmp_path / 'base')}:{REPO}", FAKE_TASKS=str(TASKS),
                     FAKE_LOGS=str(tmp_path / "logs"), CONFIG=str(tmp_path / "config.yaml"),
                     DATA_PATH=str(corpus["data"]), TOKENIZER_MODEL=str(corpus["tokenizer"]),
                     RUN_DIR=str(tmp_path / "run"), MEGALITE_DIR=str(REPO), SLURM_JOB_ID="4242")
    return ["bash", str(SBATCH)], env


def _logs(tmp_path: Path, name: str) -> list[str]:
    path = tmp_path / "logs" / name
    return path.read_text().splitlines() if path.exists() else []


def _tasks_output(tmp_path: Path) -> str:
    return "\n".join(f"--- task {t} ---\n" + (tmp_path / "logs" / f"task{t}.log").read_text()[-3000:]
                     for t in range(TASKS) if (tmp_path / "logs" / f"task{t}.log").exists())


def test_the_job_trains_on_a_base_install_with_one_python_per_task(tmp_path, corpus):
    command, env = _job(tmp_path, corpus)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr + _tasks_output(tmp_path)
    assert "no tensorboard package: running without --tensorboard-dir" in proc.stdout
    assert "megalite stopped: done" in proc.stdout, proc.stdout + _tasks_output(tmp_path)
    run = tmp_path / "run"
    assert sorted(train_losses(run / "metrics.jsonl")) == [1, 2, 3] and read_tracker(run) == 3
    assert not (run / "tensorboard").exists()
    starts = _logs(tmp_path, "python-starts")
    assert sorted(s for s in starts if s != "job") == [str(t) for t in range(TASKS)], starts  # one each
    assert _logs(tmp_path, "scontrol") == ["show hostnames node01"] * TASKS


def test_a_usr1_during_start_up_stops_the_ranks_and_requeues_the_job(tmp_path, corpus):
    command, env = _job(tmp_path, corpus)
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           cwd=tmp_path)
    try:
        pids = tmp_path / "logs" / "pids"
        while len(_logs(tmp_path, "pids")) < TASKS and job.poll() is None:
            pass
        signal_when_caught([int(pid) for pid in pids.read_text().split()], signal.SIGUSR1)
        out = job.communicate(timeout=300)[0]
    finally:
        job.kill()
    assert job.returncode == 0, out + _tasks_output(tmp_path)
    assert "megalite stopped: signal SIGUSR1" in out, out + _tasks_output(tmp_path)
    assert "stopping at iteration 0 before training (signal SIGUSR1 during start-up)" in _tasks_output(tmp_path)
    assert _logs(tmp_path, "scontrol")[-1] == "requeue 4242"
    assert not train_losses(tmp_path / "run" / "metrics.jsonl")
    assert not any(p.name.startswith("iter_") for p in (tmp_path / "run").iterdir())
