"""scripts/pretrain_gpt.sh on its two paths, and the Slurm job script around it.

The local path (torchrun, two CPU processes because TP=2) is the shared `trained_run`
(conftest.py); here its outputs are checked: the run, --exit-reason-file, the timing block of
--timing-log-level 1 and --log-params-norm against the checkpointed weights. The srun path is
run as srun runs it: one `bash scripts/pretrain_gpt.sh` per task with SLURM_* variables and
a stand-in `scontrol` (it evaluates the trained checkpoint with --skip-train). The sbatch
script runs with stand-ins for srun and scontrol to check when it requeues itself.
"""

import re
import subprocess
from pathlib import Path

import pytest

from megalite.checkpoint.dcp.checkpoint import read_tracker
from megalite.training.metrics import read_metrics
from tests.distributed import free_port
from tests.training.launch import (REPO, SCRIPT_BASE, TRAINED_ITERS, checkpoint_norm, drop_flags, eval_losses,
                                   script_env)

SBATCH = sorted((REPO / "scripts" / "slurm").glob("*.sbatch"))
TRAIN_SBATCH = [path for path in SBATCH if path.name.startswith("pretrain")]  # preprocess_data.sbatch: tests/data


def _fake_command(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def test_local_torchrun_path(trained_run):
    out = trained_run.output
    assert "memory (rank 0):" in out and "memory (rank 1):" in out   # two processes, one per TP rank
    assert trained_run.reason.read_text() == "done\n"
    assert read_tracker(trained_run.ckpt) == TRAINED_ITERS and (trained_run.ckpt / "iter_0000004").is_dir()
    blocks = out.split("(min, max) time across ranks (ms):")[1:]
    assert len(blocks) == TRAINED_ITERS                              # --log-interval 1
    for block in blocks:
        for phase in ("forward-backward", "grads-sync", "optimizer"):
            low, high = map(float, re.search(rf"    {phase} \.+: \(([\d.]+), ([\d.]+)\)", block).groups())
            assert 0 < low <= high, block
    assert "save-checkpoint ....." in blocks[4]                      # the save at iteration 4


@pytest.mark.parametrize("iteration", [4, TRAINED_ITERS])
def test_params_norm_is_the_norm_of_the_checkpointed_weights(trained_run, iteration):
    """At TP=2 the norm and biases are replicated: each must count once."""
    expected = checkpoint_norm(trained_run.ckpt, iteration, "model/")
    logged = read_metrics(str(trained_run.metrics))[0][iteration]["params_norm"]
    assert abs(logged - expected) <= 1e-9 * logged, (logged, expected)
    assert f"params norm: {logged:.3f} |" in trained_run.output


def _slurm_job_id() -> int:
    """A SLURM_JOB_ID whose port (the script's 10000 + id % 50000) is free now."""
    for _ in range(100):
        port = free_port()
        if 10000 <= port < 60000:
            return 50000 + port - 10000
    raise AssertionError("no free port in 10000-59999")


def test_srun_path_two_tasks_form_one_group_and_skip_train_evaluates(trained_run, tmp_path):
    """Two tasks as srun starts them (only SLURM_* variables tell them apart) join one TP=2
    group; --skip-train with neither --lr nor --train-iters evaluates the loaded checkpoint on
    the validation and test splits exactly as the run that saved it did at its end."""
    _fake_command(tmp_path / "bin", "scontrol", 'echo "$*" >> "$SCONTROL_LOG"\n'
                  '[[ $1 == show && $2 == hostnames ]] && printf "127.0.0.1\\n127.0.0.1\\n"\n')
    job_id = _slurm_job_id()
    argv = drop_flags(SCRIPT_BASE, "--lr", "--lr-decay-style", "--lr-warmup-iters", "--min-lr") + [
        "--tensor-model-parallel-size", "2", "--skip-train", "--load", str(trained_run.ckpt), "--eval-iters", "1",
        "--metrics-file", str(tmp_path / "metrics.jsonl"), "--exit-reason-file", str(tmp_path / "reason.txt")]
    procs = []
    for task in range(2):
        env = script_env(SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NTASKS="2", SLURM_STEP_ID="0",
                         SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST="node[07-08]",
                         SCONTROL_LOG=str(tmp_path / "scontrol.log"), PATH=f"{tmp_path / 'bin'}:{script_env()['PATH']}")
        procs.append(subprocess.Popen(["bash", "scripts/pretrain_gpt.sh", *argv], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()  # a rank left waiting for a peer that died would ignore SIGTERM's save-and-exit
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "memory (rank 0):" in outputs[0] and "memory (rank 1):" in outputs[1]
    assert (tmp_path / "scontrol.log").read_text().splitlines() == ["show hostnames node[07-08]"] * 2
    assert (tmp_path / "reason.txt").read_text() == "skip-train\n"
    train, evaluations = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert train == {} and set(evaluations) == {"valid", "test"}
    for split in ("valid", "test"):
        assert eval_losses(tmp_path / "metrics.jsonl", split) == {TRAINED_ITERS: eval_losses(trained_run.metrics,
                                                                                              split)[TRAINED_ITERS]}


@pytest.mark.parametrize("path", [REPO / "scripts" / "pretrain_gpt.sh", *SBATCH], ids=lambda p: p.name)
def test_scripts_parse(path):
    assert SBATCH, "no scripts/slurm/*.sbatch"
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("reason, requeued", [
    ("signal SIGUSR1", True), ("exit-duration-in-mins", True), ("done", False), ("signal SIGTERM", False),
    ("", False),  # nothing written this time: a stale file from an earlier run must not count
])
def test_sbatch_requeues_itself_after_a_time_limit_stop(tmp_path, reason, requeued):
    """srun and scontrol are stand-ins: srun writes `reason` where --exit-reason-file says."""
    bin_dir = tmp_path / "bin"
    _fake_command(bin_dir, "srun", 'echo "$*" > "$FAKE_LOGS/srun"\n'
                  'while [[ $# -gt 0 ]]; do\n'
                  '  [[ $1 == --exit-reason-file && -n $FAKE_REASON ]] && echo "$FAKE_REASON" > "$2"\n'
                  '  shift\ndone\n')
    _fake_command(bin_dir, "scontrol", 'echo "$*" >> "$FAKE_LOGS/scontrol"\n')
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "exit_reason.txt").write_text("signal SIGUSR1\n")   # left by an earlier job
    env = script_env(FAKE_LOGS=str(tmp_path), FAKE_REASON=reason, PATH=f"{bin_dir}:{script_env()['PATH']}",
                     DATA_PATH="data/x_text_document", TOKENIZER_MODEL="tok.model", RUN_DIR=str(run_dir),
                     MEGALITE_DIR=str(tmp_path), SLURM_JOB_ID="4242")
    assert TRAIN_SBATCH
    for sbatch in TRAIN_SBATCH:
        (tmp_path / "scontrol").unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(sbatch), "--train-iters", "5"], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        srun_args = (tmp_path / "srun").read_text().split()
        assert srun_args[srun_args.index("--exit-reason-file") + 1] == str(run_dir / "exit_reason.txt")
        assert srun_args[-2:] == ["--train-iters", "5"] and str(run_dir) in srun_args
        calls = (tmp_path / "scontrol").read_text().splitlines() if (tmp_path / "scontrol").exists() else []
        assert calls == (["requeue 4242"] if requeued else []), (sbatch.name, proc.stdout)
