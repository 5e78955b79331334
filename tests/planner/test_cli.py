"""tools/plan.py end to end on a small model: the table, the launch lines (which pretrain_gpt's
own parser and the launch script accept), the JSON, and bad input refused in one line."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.planner.cli import main
from megalite.config.arguments import parse_args, validate_args

REPO = Path(__file__).resolve().parents[2]
MODEL = ("-- --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 --global-batch-size 32 "
         "--bf16 --tokenizer-type NullTokenizer --vocab-size 1023").split()


def test_plan_prints_the_table_and_launch_lines(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    assert main(["--cluster", "h100", "--num-gpus", "16", "--top", "5", "--json", str(out_json)] + MODEL) == 0
    out = capsys.readouterr().out
    assert "layouts:" in out and "fit" in out and out.count("bash scripts/pretrain_gpt.sh") == 3
    ranked = json.loads(out_json.read_text())
    assert ranked == sorted(ranked, key=lambda r: r["step_time"]) and len(ranked) >= 5
    line = next(l for l in out.splitlines() if "scripts/pretrain_gpt.sh" in l)
    env, flags = line.split(" bash scripts/pretrain_gpt.sh ")
    assert env.strip() == "NPROC_PER_NODE=8 NNODES=2"
    args = parse_args(shlex.split(flags) + ["--mock-data", "--lr", "1e-4", "--train-iters", "1"])
    validate_args(args, 16)
    assert args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size \
        * (16 // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)) == 16


def test_search_space_options_restrict_the_layouts(capsys):
    assert main(["--cluster", "a100", "--num-gpus", "8", "--tp", "2", "--pp", "1,2", "--recompute", "full",
                 "--sequence-parallel", "on", "--distributed-optimizer", "off", "--top", "50"] + MODEL) == 0
    rows = [l for l in capsys.readouterr().out.splitlines() if l[:3].strip().isdigit()]
    assert rows and all(" TP2 " in f" {r} " and " full" in r and " SP" in r and " DO" not in r for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "tpu"] + MODEL, "--cluster 'tpu': no preset for this card"),
    (["--hf-config", "x.json"] + MODEL, "either as --hf-config or as flags"),
    (["--cluster", "a100"] + MODEL + ["--tensor-model-parallel-size", "2"], "the planner chooses the layout"),
    (["--cluster", "a100"], "no model"),
    (["--cluster", "missing.json"] + MODEL, "--cluster missing.json: cannot read it"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_nothing_fits(capsys):
    assert main(["--cluster", "a100", "--num-gpus", "8", "--gpu-memory-gib", "0.001"] + MODEL) == 1
    assert "no layout fits; the smallest predicted footprints" in capsys.readouterr().out


def test_the_tool_runs_as_a_script():
    out = subprocess.run([sys.executable, "tools/plan.py", "--cluster", "h100", "--num-gpus", "8", "--top", "3"] + MODEL,
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "NPROC_PER_NODE=8 bash scripts/pretrain_gpt.sh" in out.stdout
