"""SIGTERM / SIGUSR1 during start-up (issue 29): pretrain_gpt installs its handler before it
imports torch, so a signal that arrives while a rank imports, builds its model or reads its data
stops every rank before the first iteration (they agree on it, as the loop does at each
iteration boundary), with nothing saved, status 0 and the reason in --exit-reason-file; the job
script then requeues a SIGUSR1 stop as after one in the loop. Before, the signal's default
action killed the rank (status -10 / -15), with no reason written and no requeue."""

import os
import signal
import time
from pathlib import Path

import pytest

from megalite.training.metrics import read_metrics
from tests.training.launch import SCRIPT_BASE, launch


def handler_installed(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` catches `sig` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (sig - 1) & 1)


def torch_loaded(pid: int) -> bool:
    """Whether libtorch is mapped into process `pid` yet (`import torch` takes seconds)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def signal_when_caught(pids: list[int], sig: signal.Signals, timeout: float = 60) -> list[bool]:
    """Send `sig` to each process as soon as it catches it: at once, in its start-up. Returns,
    for each, whether it had loaded torch by then."""
    loaded, deadline = {}, time.monotonic() + timeout
    while len(loaded) < len(pids):
        assert time.monotonic() < deadline, f"no handler for {sig.name} in {pids} after {timeout}s"
        for pid in pids:
            if pid not in loaded and handler_installed(pid, sig):
                loaded[pid] = torch_loaded(pid)
                os.kill(pid, sig)
        time.sleep(0.002)
    return [loaded[pid] for pid in pids]


@pytest.mark.parametrize("sig, signalled", [(signal.SIGUSR1, (0, 1)), (signal.SIGTERM, (1,))],
                         ids=["usr1-every-rank", "term-one-rank"])
def test_a_signal_during_start_up_stops_before_training_with_nothing_saved(tmp_path, sig, signalled):
    """A signal on one rank only stops both: they agree before the first iteration."""
    save, reason, metrics = tmp_path / "ckpt", tmp_path / "reason.txt", tmp_path / "metrics.jsonl"
    args = SCRIPT_BASE + ["--distributed-backend", "gloo", "--tensor-model-parallel-size", "2", "--train-iters", "4",
                          "--eval-iters", "1", "--save", str(save), "--save-interval", "1",
                          "--exit-reason-file", str(reason), "--metrics-file", str(metrics)]
    ranks = launch(args, 2, tmp_path / "logs", fork=False)  # a start-up before torch is imported
    try:
        loaded = signal_when_caught([ranks.procs[r].pid for r in signalled], sig)
        codes = ranks.wait(240)
    finally:
        ranks.kill()
    assert not all(loaded), "the handler came only after `import torch`: no signal arrived while it imported"
    assert codes == [0, 0], ranks.output()
    assert reason.read_text() == f"signal {sig.name}\n"
    log = ranks.logs[0].read_text()
    assert f"stopping at iteration 0 before training (signal {sig.name} during start-up); nothing to save" in log, \
        ranks.output()
    assert "memory (rank 0):" in log  # the model was built: the stop came at the end of start-up
    assert not save.exists() or not any(save.iterdir()), sorted(save.rglob("*"))
    assert not metrics.exists() or read_metrics(str(metrics)) == ({}, {})
