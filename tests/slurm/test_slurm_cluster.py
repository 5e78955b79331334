"""scripts/slurm/*.sbatch on a real single-node Slurm cluster (tests/slurm/cluster.py), as a
user submits them: the training job end to end at four tasks (TP=2 x PP=2, the demo config at
toy scale); a SIGUSR1 (scancel --signal=USR1, as Slurm's --signal=USR1@300 sends it: to the
job's steps, not the batch shell) that saves, requeues the job and resumes it to the losses of
the uninterrupted run; scancel (SIGTERM) that saves and ends the job for good; the
preprocessing array job and the merge that depends on it. Skipped, with the reason, where
slurm-wlm and munge are not installed or this is not root; tests/training/test_launch_script.py
keeps the stand-in tests of the same scripts."""

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megalite.checkpoint.dcp.checkpoint import read_tracker
from tests.data.conftest import load_tool
from tests.slurm.cluster import CLIENTS, DAEMONS, TERMINAL, missing
from tests.slurm.watchdog import processes_with
from tests.training.base_install import base_install_path
from tests.training.launch import REPO, eval_losses, script_env, train_losses

TRAIN_SBATCH = REPO / "scripts" / "slurm" / "pretrain_gpt.sbatch"
PREPROCESS_SBATCH = REPO / "scripts" / "slurm" / "preprocess_data.sbatch"
ITERS = 12
# One node of four CPU tasks instead of the script's 4 nodes x 8 GPUs; everything else as written.
TRAIN_SBATCH_ARGS = ["--nodes=1", "--ntasks-per-node=4", "--gpus-per-node=0"]
TRAIN_ARGS = ["--train-iters", str(ITERS), "--lr-warmup-iters", "2", "--eval-iters", "1", "--log-interval", "1"]
JOB_TIMEOUT = 240  # seconds for one training job: 28 CPU-seconds, about 15 s on 2 idle cores


def _submit_training(slurm, corpus, run_dir: Path) -> tuple[int, Path]:
    """From the repository, as a user does (the job's logs go to the test's folder); the ranks
    run this interpreter (PYTHON, read by scripts/pretrain_gpt.sh)."""
    env = slurm.env(base=script_env(), DATA_PATH=str(corpus["data"]), TOKENIZER_MODEL=str(corpus["tokenizer"]),
                    CONFIG="examples/demo_cpu.yaml", RUN_DIR=str(run_dir))
    output = run_dir.parent / f"{run_dir.name}.out"
    job = slurm.sbatch([*TRAIN_SBATCH_ARGS, f"--output={output}", str(TRAIN_SBATCH), *TRAIN_ARGS], env=env, cwd=REPO)
    return job, output


def _wait_for_training(slurm, job: int, run_dir: Path, output: Path, iterations: int = 1):
    """Until the job's metrics hold `iterations` iterations, while it still runs."""
    def training():
        return len(train_losses(run_dir / "metrics.jsonl")) >= iterations

    records = slurm.wait_for_jobs(job, lambda rs: training() or rs[0]["JobState"] in TERMINAL, JOB_TIMEOUT,
                                  f"iteration {iterations}", output)
    assert records[0]["JobState"] == "RUNNING", f"the job ended before it was signalled: {records[0]}\n" \
                                                f"{slurm.job_output(output)}"


def _job_stdout(output: Path) -> str:
    return output.read_text(errors="replace")


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, corpus, tmp_path_factory):
    """The training job run to its end (test (a) checks it; the signal tests compare with it)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    job, output = _submit_training(slurm_cluster, corpus, run_dir)
    try:
        (record,) = slurm_cluster.wait_finished(job, JOB_TIMEOUT, output)
    finally:
        slurm_cluster.cancel_all()
    return job, record, run_dir, output


def test_training_job_end_to_end(uninterrupted):
    job, record, run_dir, output = uninterrupted
    stdout = _job_stdout(output)
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "0"), \
        f"{record}\n{stdout[-5000:]}"
    assert record["NumTasks"] == "4" and record["NodeList"], record
    for rank in range(4):  # one rank per task: RANK from SLURM_PROCID
        assert f"memory (rank {rank}):" in stdout, stdout[-5000:]
    losses = train_losses(run_dir / "metrics.jsonl")
    assert sorted(losses) == list(range(1, ITERS + 1)), stdout[-5000:]
    assert all(math.isfinite(v) for v in losses.values()) and losses[ITERS] < losses[1] - 0.5, losses
    assert set(eval_losses(run_dir / "metrics.jsonl", "test")) == {ITERS}
    assert read_tracker(run_dir) == ITERS and (run_dir / "exit_reason.txt").read_text() == "done\n"
    assert stdout.count("megalite stopped:") == 1 and "megalite stopped: done" in stdout


def test_training_job_on_a_base_install(slurm, corpus, tmp_path):
    """As a user with megalite installed by `pip install -e .` alone submits it (no tensorboard:
    tests/training/base_install.py hides the extras): the job trains without --tensorboard-dir
    (before, every rank stopped on it after preparing its data and building its model)."""
    run_dir, output = tmp_path / "run", tmp_path / "job.out"
    env = slurm.env(base=script_env(PYTHONPATH=f"{base_install_path(tmp_path / 'base')}:{REPO}"),
                    DATA_PATH=str(corpus["data"]), TOKENIZER_MODEL=str(corpus["tokenizer"]),
                    CONFIG="examples/demo_cpu.yaml", RUN_DIR=str(run_dir))
    job = slurm.sbatch([*TRAIN_SBATCH_ARGS, f"--output={output}", str(TRAIN_SBATCH), "--train-iters", "2",
                        "--lr-warmup-iters", "1", "--eval-iters", "1", "--log-interval", "1"], env=env, cwd=REPO)
    (record,) = slurm.wait_finished(job, JOB_TIMEOUT, output)
    stdout = _job_stdout(output)
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), f"{record}\n{stdout[-5000:]}"
    assert "no tensorboard package: running without --tensorboard-dir" in stdout
    assert sorted(train_losses(run_dir / "metrics.jsonl")) == [1, 2] and not (run_dir / "tensorboard").exists()
    assert "megalite stopped: done" in stdout


@pytest.mark.slow
@pytest.mark.timeout(4 * JOB_TIMEOUT + 60)  # three runs, the first as the `uninterrupted` fixture
def test_usr1_saves_requeues_and_resumes_to_the_same_losses(slurm, corpus, uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    job, output = _submit_training(slurm, corpus, run_dir)
    _wait_for_training(slurm, job, run_dir, output)
    slurm.command(["scancel", "--signal=USR1", str(job)])  # the job's steps, as --signal=USR1@300 does
    # The batch script runs `scontrol requeue` before it exits: the job never shows a terminal
    # state between the two runs.
    (record,) = slurm.wait_finished(job, 2 * JOB_TIMEOUT, output)
    stdout = _job_stdout(output)
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        f"{record}\n{stdout[-5000:]}"
    first, _, second = stdout.partition("megalite stopped: signal SIGUSR1")
    saves = re.findall(r"stopping at iteration (\d+) \(signal SIGUSR1\)", first)
    assert len(saves) == 1 and 1 <= int(saves[0]) < ITERS, stdout[-5000:]
    stopped = int(saves[0])
    assert f"saved checkpoint at iteration {stopped} " in first, first[-5000:]
    assert "starting from scratch" in first and "starting from scratch" not in second, stdout[-5000:]
    assert re.search(r"iteration +(\d+)/", second).group(1) == str(stopped + 1), second[-5000:]
    assert "megalite stopped: done" in second and read_tracker(run_dir) == ITERS
    assert train_losses(run_dir / "metrics.jsonl") == train_losses(uninterrupted[2] / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.timeout(3 * JOB_TIMEOUT + 60)
def test_scancel_saves_and_ends_the_job_without_requeue(slurm, corpus, uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    job, output = _submit_training(slurm, corpus, run_dir)
    _wait_for_training(slurm, job, run_dir, output)
    slurm.command(["scancel", str(job)])  # SIGTERM to the steps and the batch shell, SIGKILL after KillWait
    (record,) = slurm.wait_finished(job, JOB_TIMEOUT, output)
    stdout = _job_stdout(output)
    assert (record["JobState"], record["Restarts"]) == ("CANCELLED", "0"), f"{record}\n{stdout[-5000:]}"
    assert (run_dir / "exit_reason.txt").read_text() == "signal SIGTERM\n", stdout[-5000:]
    losses = train_losses(run_dir / "metrics.jsonl")
    stopped = read_tracker(run_dir)
    assert stopped == max(losses) < ITERS, stdout[-5000:]  # saved at the iteration it stopped at
    assert losses == {i: v for i, v in train_losses(uninterrupted[2] / "metrics.jsonl").items() if i <= stopped}
    time.sleep(6)  # longer than cred_expire, the wait before a requeued job may start again
    (record,) = slurm.jobs(job)
    assert (record["JobState"], record["Restarts"]) == ("CANCELLED", "0"), record


def test_preprocessing_array_job_then_merge_equals_one_run(slurm, corpus, python_bin, tmp_path):
    """The two commands of preprocess_data.sbatch's header, as written there (an array of two
    tasks, then the merge as a job that depends on it)."""
    src = tmp_path / "src"
    src.mkdir()
    lines = corpus["jsonl"].read_text().splitlines(keepends=True)
    (src / "a.jsonl").write_text("".join(lines[: len(lines) // 2]))
    (src / "b.jsonl").write_text("".join(lines[len(lines) // 2:]))
    env = slurm.env(PATH=f"{python_bin}:{os.environ['PATH']}", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
                    INPUT=f"{src}/*.jsonl", OUTPUT_PREFIX=str(tmp_path / "tok" / "corpus"),
                    TOKENIZER_MODEL=str(corpus["tokenizer"]))
    array = slurm.sbatch(["--array=0-1", "--cpus-per-task=2", f"--output={tmp_path}/%x-%A_%a.out",
                          str(PREPROCESS_SBATCH)], env=env, cwd=REPO)
    merge = slurm.sbatch([f"--dependency=afterok:{array}", f"--output={tmp_path}/merge-%j.out", "--wrap",
                          f"python tools/merge_datasets.py --input {tmp_path}/tok/corpus-*-of-00002_text_document.bin"
                          f" --output-prefix {tmp_path}/tok/corpus_text_document"], env=env, cwd=REPO)
    (merged,) = slurm.wait_finished(merge, JOB_TIMEOUT, tmp_path / f"merge-{merge}.out")
    tasks = slurm.jobs(array)
    logs = "\n".join(slurm.job_output(p) for p in sorted(tmp_path.glob("*.out")))
    assert sorted(t["ArrayTaskId"] for t in tasks) == ["0", "1"], tasks
    assert {t["JobState"] for t in tasks} == {"COMPLETED"} and merged["JobState"] == "COMPLETED", f"{tasks}\n{logs}"
    assert sorted(p.name for p in (tmp_path / "tok").glob("*.bin")) == [
        "corpus-00000-of-00002_text_document.bin", "corpus-00001-of-00002_text_document.bin",
        "corpus_text_document.bin"], logs
    assert load_tool("preprocess_data").main([
        "--input", f"{src}/*.jsonl", "--json-keys", "text", "--output-prefix", str(tmp_path / "one"),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(corpus["tokenizer"]),
        "--append-eod"]) == 0
    for ext in (".bin", ".idx"):
        merged_bytes = (tmp_path / "tok" / f"corpus_text_document{ext}").read_bytes()
        assert merged_bytes == (tmp_path / f"one_text_document{ext}").read_bytes(), ext


def test_skip_reason_names_what_is_missing(tmp_path):
    assert missing(path=str(tmp_path)) == (f"slurm-wlm/munge not installed ({', '.join(DAEMONS + CLIENTS)} not found): "
                                           "apt-get install slurm-wlm munge (.ci/run does)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


CHILD = """
import os
from tests.slurm.cluster import SlurmCluster


def program(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.path.basename(f.read().split(b"\\0")[0])
    except OSError:
        return b""


cluster = SlurmCluster()
cluster.start()
job = cluster.sbatch(["--ntasks=2", f"--output={cluster.root}/job.out", "--wrap", "srun sleep 600"],
                     env=cluster.env(), cwd=cluster.root)
cluster.wait_for_jobs(job, lambda rs: rs[0]["JobState"] == "RUNNING"
                      and [program(pid) for pid in cluster.stragglers()].count(b"sleep") == 2, 60, "two tasks")
print("READY", cluster.conf, *cluster.stragglers(), flush=True)
os.read(0, 1)
"""


def test_a_killed_test_process_leaves_no_slurm_process(slurm_installed, tmp_path):
    """SIGKILL to a process running a cluster with a two-task job: no finalizer runs, yet the
    daemons, slurmstepd, the batch script, srun and the tasks (outside the daemons' process
    groups) all end, and the cluster's folder goes (the kernel's parent-death signal and
    tests/slurm/watchdog.py)."""
    report = tmp_path / "report.txt"
    with open(report, "w") as out:
        child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, stdin=subprocess.PIPE, stdout=out,
                                 stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        while child.poll() is None and "READY" not in report.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        ready = [line.split()[1:] for line in report.read_text().splitlines() if line.startswith("READY ")]
        assert ready, report.read_text()[-5000:]
    finally:
        child.kill()
        child.wait()
    conf, *pids = ready[0]
    assert len(pids) >= 8, pids  # munged, slurmctld, slurmscriptd, slurmd, 2 slurmstepd, sh, srun, 2 sleep
    deadline = time.monotonic() + 30
    while (processes_with(f"SLURM_CONF={conf}") or Path(conf).parent.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with(f"SLURM_CONF={conf}") and not Path(conf).parent.exists()
    assert not [pid for pid in map(int, pids) if _alive(pid)]
