"""The cluster path end to end: scripts/slurm/preprocess_data.sbatch run as the tasks of a Slurm
array, merged; and memory stays flat as a Parquet input grows."""

import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.data.conftest import REPO, load_tool, run_python
from tests.data.test_preprocess_runs import PEAK_MEMORY


def test_sbatch_array_tasks_then_merge_equal_one_run(tmp_path, demo_texts, sp_model, capsys):
    import subprocess

    src = tmp_path / "src"
    src.mkdir()
    docs = [p for t in demo_texts for p in t.split("\n\n") if p.strip()][:400]
    with open(src / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs[:250])
    pq.write_table(pa.table({"text": docs[250:]}), src / "b.parquet", row_group_size=25)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A wrapper, not a symlink: a symlinked venv interpreter finds no pyvenv.cfg beside it and
    # starts as the base interpreter, without this environment's packages.
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", INPUT=f"{src}/*.jsonl {src}/*.parquet",
               OUTPUT_PREFIX=str(tmp_path / "out" / "c"), TOKENIZER_MODEL=sp_model, SLURM_ARRAY_TASK_MAX="1",
               WORKERS="2", MEGALITE_DIR=REPO, PYTHONPATH=REPO)
    for task in range(2):
        proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "slurm", "preprocess_data.sbatch")],
                              env=dict(env, SLURM_ARRAY_TASK_ID=str(task)), capture_output=True, text=True,
                              cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr
    parts = sorted(str(tmp_path / "out" / n)[:-4] for n in os.listdir(tmp_path / "out") if n.endswith(".bin"))
    assert [os.path.basename(p) for p in parts] == [f"c-0000{i}-of-00002_text_document" for i in range(2)]
    merge = load_tool("merge_datasets")
    assert merge.main(["--input", *parts, "--output-prefix", str(tmp_path / "merged")]) == 0
    preprocess = load_tool("preprocess_data")
    assert preprocess.main(["--input", f"{src}/*.jsonl", f"{src}/*.parquet", "--output-prefix", str(tmp_path / "one"),
                            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
                            "--append-eod"]) == 0
    capsys.readouterr()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"one_text_document{ext}").read_bytes()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_does_not_grow_with_a_parquet_input(tmp_path, demo_texts, sp_model):
    """As tests/data/test_preprocess_runs.py does for JSONL: the same row groups in a file 4x
    larger; the peak resident memory of the run grows by less than 4 MB, while holding the
    extra input would take more than 12 MB. (From the smallest inputs, Arrow's memory pool
    still warms up: 4 copies peak about 4 MB below 8, 8 to 32 adds under 1 MB.)"""
    growth, tokens = {}, {}
    for copies in (8, 32):
        path = tmp_path / f"in{copies}.parquet"
        table = pa.table({"text": demo_texts * copies})
        pq.write_table(table, path, row_group_size=200)
        out = run_python(["-c", PEAK_MEMORY, str(path), str(tmp_path / f"out{copies}"), sp_model], timeout=300)
        assert out.returncode == 0, out.stderr
        growth[copies], tokens[copies] = (float(x) for x in out.stdout.split())
    assert tokens[32] == 4 * tokens[8]
    assert growth[32] - growth[8] < 4.0, growth
    assert sum(len(t.encode()) for t in demo_texts) * 24 / 1e6 > 12.0
