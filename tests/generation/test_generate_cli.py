"""tools/generate.py end to end: a Hugging Face directory with a tokenizer.json is converted, the
tokenizer travels with the checkpoint (and back to Hugging Face), and the tool's output equals
the library's generation, in one process and at TP=2 under torchrun."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
from megalite.convert.tokenizer_files import resolved_entry
from megalite.data.tokenizers import build_tokenizer
from megalite.inference import SamplingParams, generate_tokens, load_model
from megalite.inference.cli import main as generate_main
from tests.convert.hf_models import hf_model, hf_to_megalite, megalite_to_hf, save_hf, write_hf_tokenizer
from tests.distributed import free_port
from tests.forked_program import run_program

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["hello world", "the quick brown fox"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    hf_dir = Path(save_hf(hf_model("llama", seed=11), root / "hf"))
    write_hf_tokenizer(hf_dir)
    ckpt = hf_to_megalite(hf_dir, root / "ckpt", tp=2)
    (root / "prompts.txt").write_text(PROMPTS[1] + "\n\n")
    return root, Path(ckpt)


def run_tool(root, *extra, torchrun_ranks=0, in_process=False):
    args = [str(REPO / "tools/generate.py"), "--load", str(root / "ckpt"), "--prompt", PROMPTS[0],
            "--prompt-file", str(root / "prompts.txt"), "--max-new-tokens", "10", *map(str, extra)]
    if in_process:
        assert generate_main(args[1:]) == 0
        return None
    if torchrun_ranks:
        args = ["-m", "torch.distributed.run", "--nproc-per-node", str(torchrun_ranks), "--master-port",
                str(free_port()), *args, "--tensor-model-parallel-size", str(torchrun_ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_program([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def library_tokens(ckpt, params, seed):
    model, common = load_model(ckpt)
    entry = resolved_entry(common["tokenizer"], ckpt)
    tok = build_tokenizer(entry["type"], tokenizer_model=entry["model"])
    generator = torch.Generator().manual_seed(seed)
    return [generate_tokens(model, tok.encode(p), 10, params, eod=tok.eod, generator=generator) for p in PROMPTS]


def test_tokenizer_travels_with_the_checkpoint(checkpoint):
    root, ckpt = checkpoint
    entry = MegaliteCheckpoint(ckpt).common["tokenizer"]
    assert entry["type"] == "HuggingFaceTokenizer" and entry["model"] == str(ckpt / "tokenizer")
    assert (ckpt / "tokenizer" / "tokenizer.json").exists()
    back = Path(megalite_to_hf(ckpt, root / "back"))
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in back.iterdir()}
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(back)
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(ckpt / "tokenizer"))
    for text in PROMPTS:
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert json.loads((back / "config.json").read_text())["eos_token_id"] == ours.eod == 0


def test_greedy_and_sampled_output_equal_the_library(checkpoint):
    root, ckpt = checkpoint
    run_tool(root, "--greedy", "--output-file", root / "greedy.jsonl")
    greedy = [json.loads(line) for line in (root / "greedy.jsonl").read_text().splitlines()]
    assert [g["prompt"] for g in greedy] == PROMPTS
    assert [g["tokens"] for g in greedy] == library_tokens(ckpt, SamplingParams(temperature=0), 0)
    sampling = ("--temperature", 0.8, "--top-k", 40, "--top-p", 0.9, "--seed", 3)
    run_tool(root, *sampling, "--output-file", root / "sampled.jsonl", in_process=True)
    run_tool(root, *sampling, "--no-kv-cache", "--output-file", root / "sampled_nocache.jsonl", in_process=True)
    sampled = [json.loads(line)["tokens"] for line in (root / "sampled.jsonl").read_text().splitlines()]
    assert sampled == library_tokens(ckpt, SamplingParams(temperature=0.8, top_k=40, top_p=0.9), 3)
    assert (root / "sampled_nocache.jsonl").read_text() == (root / "sampled.jsonl").read_text()


def test_tp2_under_torchrun_equals_one_process(checkpoint):
    root, _ = checkpoint
    run_tool(root, "--greedy", "--output-file", root / "tp1.jsonl", in_process=True)
    proc = run_tool(root, "--greedy", "--output-file", root / "tp2.jsonl", torchrun_ranks=2)
    assert "TP=2" in proc.stderr
    assert (root / "tp2.jsonl").read_text() == (root / "tp1.jsonl").read_text()


def test_bad_input_is_one_line(tmp_path, checkpoint, capsys):
    root, _ = checkpoint
    for extra, expect in ((["--load", str(root / "ckpt")], "give --prompt TEXT or --prompt-file FILE"),
                          (["--load", str(root / "ckpt"), "--prompt", "x", "--top-p", "2"], "--top-p"),
                          (["--load", str(root / "ckpt"), "--prompt", "x", "--prompt-file", str(tmp_path / "no")],
                           "--prompt-file"),
                          (["--load", str(root / "ckpt"), "--prompt", "x", "--expert-tensor-parallel-size", "1"],
                           "--expert-tensor-parallel-size: the checkpoint's model has no experts"),
                          (["--load", str(root / "ckpt"), "--prompt", "x", "--quantize", "int3"],
                           "argument --quantize: invalid choice")):
        assert generate_main(extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("generate: error:") and expect in err and len(err.strip().splitlines()) == 1, err
    proc = run_program([sys.executable, str(REPO / "tools/generate.py"), "--load", str(tmp_path / "none"),
                           "--prompt", "x"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"generate: error: {tmp_path / 'none'}: no such checkpoint directory"]


def test_quantize_needs_the_extra(checkpoint, capsys, monkeypatch):
    from megalite.config import optional_packages

    monkeypatch.setattr(optional_packages, "installed", lambda module: module != "torchao")
    root, _ = checkpoint
    assert generate_main(["--load", str(root / "ckpt"), "--prompt", "x", "--quantize", "int8"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        'generate: error: --quantize needs torchao, which is not installed: pip install -e ".[quantize]" '
        "(or pip install torchao)"]


def test_quantize_int4_on_cpu_is_one_line(checkpoint, capsys):
    pytest.importorskip("torchao")
    root, _ = checkpoint
    assert generate_main(["--load", str(root / "ckpt"), "--prompt", "x", "--quantize", "int4",
                          "--distributed-backend", "gloo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("generate: error: --quantize int4 needs CUDA") and len(err.strip().splitlines()) == 1, err


def test_quantize_int8_equals_the_library_on_quantized_weights(checkpoint, capsys):
    pytest.importorskip("torchao")
    from megalite.inference.quantize import quantize_weights

    root, ckpt = checkpoint
    run_tool(root, "--greedy", "--quantize", "int8", "--distributed-backend", "gloo",
             "--output-file", root / "int8.jsonl", in_process=True)
    assert "--quantize int8: weights" in capsys.readouterr().err
    model, common = load_model(ckpt)
    quantize_weights(model, "int8")
    entry = resolved_entry(common["tokenizer"], ckpt)
    tok = build_tokenizer(entry["type"], tokenizer_model=entry["model"])
    expected = [generate_tokens(model, tok.encode(p), 10, SamplingParams(temperature=0), eod=tok.eod) for p in PROMPTS]
    assert [json.loads(line)["tokens"] for line in (root / "int8.jsonl").read_text().splitlines()] == expected


def test_bench_quantize_reports_memory_and_perplexity(checkpoint, tmp_path, capsys):
    """tools/benchmarks/bench_quantize.py on the toy checkpoint and a 3-document corpus: one row per
    mode that runs here, the int8 weights smaller than bf16's, its perplexity near bf16's, int4 refused."""
    pytest.importorskip("torchao")
    import numpy as np

    from megalite.data.indexed_dataset import IndexedDatasetWriter
    sys.path.insert(0, str(REPO / "tools/benchmarks"))
    from bench_quantize import main as bench_main

    root, ckpt = checkpoint
    writer = IndexedDatasetWriter(str(tmp_path / "corpus"), dtype=np.int32)
    for seed in range(3):
        writer.add_document(np.random.default_rng(seed).integers(0, 100, 70))
    writer.finalize()
    assert bench_main(["--load", str(ckpt), "--data-path", str(tmp_path / "corpus"), "--documents", "2",
                       "--modes", "bf16", "int8", "int4"]) == 0
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")[1:]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line}
    bf16, int8 = [float(x) for x in rows["bf16"]], [float(x) for x in rows["int8"]]
    assert int8[0] < bf16[0] and int8[1] < 0.6 * bf16[1] and abs(int8[2] - bf16[2]) < 0.05 * bf16[2], rows
    if not torch.cuda.is_available():
        assert "--quantize int4 needs CUDA" in rows["int4"][0]
