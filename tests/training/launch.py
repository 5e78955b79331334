"""Launch `python -m megalite.pretrain_gpt` as separate rank processes, as srun does (each rank
its own process with RANK / WORLD_SIZE / MASTER_* in its environment), so tests can signal or
kill individual ranks."""

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
from megalite.checkpoint.dcp.checkpoint import TRACKER, iteration_dir
from megalite.training.metrics import read_metrics
from tests.distributed import free_port
from tests.forked_program import ForkedProgram

REPO = Path(__file__).resolve().parents[2]

# A small Llama-style model on mock data; every run of a test shares these.
BASE = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "211",
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--ffn-hidden-size", "96", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--min-lr", "3e-4",
    "--log-interval", "1", "--num-workers", "0", "--distributed-backend", "gloo", "--seed", "7",
]


class Ranks:
    """The processes of one launch."""

    def __init__(self, procs, logs):
        self.procs, self.logs = procs, logs

    def wait(self, timeout=300) -> list[int]:
        deadline = time.time() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"ranks still running after {timeout}s:\n{self.output()}")
        return codes

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def output(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{Path(log).read_text()[-3000:]}{self.stderr(r)[-3000:]}"
                         for r, log in enumerate(self.logs))

    def stderr(self, rank: int) -> str:
        """What rank `rank` wrote to stderr, when launched with separate_stderr (else '')."""
        err = Path(self.logs[rank]).with_suffix(".err")
        return err.read_text() if err.exists() else ""


def launch(args: list[str], world_size: int, log_dir: Path, env: dict | None = None,
           separate_stderr: bool = False, program: tuple[str, ...] = ("-m", "megalite.pretrain_gpt"),
           fork: bool = True) -> Ranks:
    """Start the ranks (`python *program *args`); each writes stdout and stderr to
    log_dir/rank<R>.log, or with `separate_stderr` its stderr alone to rank<R>.err. Each rank is
    its own process, forked from the tests' fork server with torch and megalite imported
    (tests/forked_program.py); `fork=False` starts a fresh interpreter per rank, for what only
    one shows (start-up before the imports, interpreter teardown, a base install)."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for rank in range(world_size):
        rank_env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(REPO), **(env or {})}
        log = log_dir / f"rank{rank}.log"
        err_log = log.with_suffix(".err") if separate_stderr else None
        log.write_text("")
        if err_log:
            err_log.write_text("")
        if fork:
            procs.append(ForkedProgram(program, args, rank_env, REPO, log, err_log))
        else:
            with open(log, "w") as out, open(err_log or os.devnull, "w") as err:
                procs.append(subprocess.Popen([sys.executable, *program, *args], env=rank_env, stdout=out,
                                              stderr=err if separate_stderr else subprocess.STDOUT, cwd=REPO))
        logs.append(log)
    return Ranks(procs, logs)


def run(args: list[str], world_size: int, log_dir: Path, timeout=300, **launch_options) -> Ranks:
    ranks = launch(args, world_size, log_dir, **launch_options)
    codes = ranks.wait(timeout)
    assert codes == [0] * world_size, f"exit codes {codes}:\n{ranks.output()}"
    return ranks


def train_losses(metrics_file: Path) -> dict[int, float]:
    if not metrics_file.exists():
        return {}
    return {it: r["lm_loss"] for it, r in read_metrics(str(metrics_file))[0].items()}


def eval_losses(metrics_file: Path, split: str = "valid") -> dict[int, float]:
    return {it: r["lm_loss"] for it, r in read_metrics(str(metrics_file))[1].get(split, {}).items()}


def wait_for(condition, timeout=240, what="condition", ranks: Ranks | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        if ranks is not None and any(p.poll() is not None for p in ranks.procs):
            raise AssertionError(f"a rank exited while waiting for {what}:\n{ranks.output()}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def drop_flags(argv: list[str], *flags: str) -> list[str]:
    """`argv` without the given flags and their values (a flag may be given only once, so a
    test replacing a value drops it first)."""
    kept, i = [], 0
    while i < len(argv):
        width = 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
        if argv[i] not in flags:
            kept += argv[i:i + width]
        i += width
    return kept


LAUNCH_VARIABLES = ("LAUNCHER", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE", "RANK",
                    "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def script_env(**extra) -> dict:
    """The environment for scripts/pretrain_gpt.sh: this interpreter, one thread per rank, no
    launch or Slurm variables inherited from the test's own environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LAUNCH_VARIABLES}
    return {**env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


TRAINED_ITERS = 6  # iterations of the shared `trained_run` (conftest.py)
SCRIPT_BASE = drop_flags(BASE, "--distributed-backend")  # the script picks gloo without a GPU


def copy_checkpoint(ckpt: Path, iteration: int, target: Path) -> Path:
    """A --load directory holding only iteration `iteration` of `ckpt`."""
    target.mkdir(parents=True)
    shutil.copytree(iteration_dir(ckpt, iteration), iteration_dir(target, iteration))
    (target / TRACKER).write_text(str(iteration))
    return target


def checkpoint_norm(ckpt: Path, iteration: int, prefix: str) -> float:
    """The L2 norm, summed in float64, of the tensors of checkpoint `iteration` under `ckpt`
    whose keys start with `prefix` (there must be some)."""
    checkpoint = MegaliteCheckpoint(ckpt, iteration)
    keys = [k for k in checkpoint.keys() if k.startswith(prefix)]
    assert keys, f"no tensor {prefix}* in {ckpt} iteration {iteration}"
    return math.sqrt(sum(checkpoint.get(k).double().square().sum().item() for k in keys))
