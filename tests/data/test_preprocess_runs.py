"""Preprocessing runs in their own processes: memory stays flat as the input grows; a run
stopped by a signal leaves nothing under the final names, and its leftovers are removed."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.data.conftest import REPO, run_python

PEAK_MEMORY = r"""
import os, sys
from megalite.data.preprocess import PreprocessConfig, preprocess
from megalite.data.tokenizers import build_tokenizer

def status_mb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))

build_tokenizer("SentencePieceTokenizer", tokenizer_model=sys.argv[3])
before = status_mb("VmRSS")
config = PreprocessConfig(input=[sys.argv[1]], output_prefix=sys.argv[2], tokenizer_type="SentencePieceTokenizer",
                          tokenizer_model=sys.argv[3], append_eod=True, max_shard_bytes=1 << 20)
with open(os.devnull, "w") as quiet:
    summary = preprocess(config, stream=quiet)
print(status_mb("VmHWM") - before, summary["tokens"])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_does_not_grow_with_the_input(tmp_path, demo_corpus, sp_model):
    """The same 1 MB shards over an input 4x larger: the peak resident memory of the run
    (beyond what the process held before) stays within 4 MB, while holding the extra input
    or its tokens would take more than 6 MB."""
    with open(demo_corpus, "rb") as f:
        corpus = f.read()
    growth, tokens = {}, {}
    for copies in (4, 16):
        path = tmp_path / f"in{copies}.jsonl"
        path.write_bytes(corpus * copies)
        out = run_python(["-c", PEAK_MEMORY, str(path), str(tmp_path / f"out{copies}"), sp_model], timeout=300)
        assert out.returncode == 0, out.stderr
        growth[copies], tokens[copies] = (float(x) for x in out.stdout.split())
    assert tokens[16] == 4 * tokens[4]
    assert growth[16] - growth[4] < 4.0, growth
    assert len(corpus) * 12 / 1e6 > 6.0  # the extra input (3x the small one) is larger than 6 MB


def preprocess_command(tmp_path, source, prefix):
    """Arguments to the Python interpreter."""
    return [os.path.join(REPO, "tools", "preprocess_data.py"), "--input", str(source),
            "--output-prefix", str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--workers", "2", "--log-interval", "100000"]


def start_and_stop_mid_run(tmp_path, sig):
    """Start a 2-worker run on a large input; send `sig` once workers are writing shards.
    Returns (process, its worker processes, output directory)."""
    out = tmp_path / "out"
    out.mkdir()
    source = tmp_path / "in.txt"
    source.write_bytes(b"1 2 3 4 5 6 7 8 9\n" * 1_500_000)  # 27 MB: several seconds of work
    proc = subprocess.Popen([sys.executable, *preprocess_command(tmp_path, source, out / "ds")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(name.endswith("-shards") and os.listdir(out / name) for name in os.listdir(out)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    workers = psutil.Process(proc.pid).children()
    assert len(workers) == 1  # the main process tokenises too
    proc.send_signal(sig)
    proc.wait(timeout=60)
    return proc, workers, out


def test_terminated_run_removes_its_temporary_files(tmp_path):
    proc, workers, out = start_and_stop_mid_run(tmp_path, signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.returncode == 143 and "error: stopped by SIGTERM; no output written" in err, err
    assert os.listdir(out) == []
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)


def test_killed_run_leaves_no_final_names_and_the_next_run_removes_its_leftovers(tmp_path):
    proc, workers, out = start_and_stop_mid_run(tmp_path, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    left = sorted(os.listdir(out))
    assert left and all(".tmp-" in name for name in left), left  # temporary names only
    psutil.wait_procs(workers, timeout=3)  # workers die with their parent
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    small = tmp_path / "small.txt"
    small.write_text("1 2\n3\n")
    done = run_python(preprocess_command(tmp_path, small, out / "ds"), timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"removed {out / left[0]}, left by a preprocessing run that was killed" in done.stderr
    assert sorted(os.listdir(out)) == ["ds_text_document.bin", "ds_text_document.idx"]


def test_a_failure_while_merging_stops_the_workers_before_removing_the_temporary_files(tmp_path, monkeypatch):
    """add_dataset fails on the first shard: the workers are gone, and the temporary
    directory with them, by the time the error leaves preprocess()."""
    from megalite.data import preprocess as pre

    def fail(self, prefix):
        raise OSError("disk full")

    monkeypatch.setattr(pre.IndexedDatasetWriter, "add_dataset", fail)
    source = tmp_path / "in.txt"
    source.write_bytes(b"1 2 3 4 5 6 7 8 9\n" * 200_000)
    out = tmp_path / "out"
    out.mkdir()
    config = pre.PreprocessConfig(input=[str(source)], output_prefix=str(out / "ds"), tokenizer_type="NullTokenizer",
                                  vocab_size=100, workers=2, max_shard_bytes=64 << 10)
    before = psutil.Process().children()  # a resource tracker another test started, say
    with open(os.devnull, "w") as quiet, pytest.raises(OSError, match="disk full") as failure:
        pre.preprocess(config, stream=quiet)
    assert psutil.Process().children() == before, failure  # not left to the traceback's release
    assert os.listdir(out) == []
