"""tools/generate.py on mixture-of-experts checkpoints (issue 24, item 4): tiny random Mixtral and
Qwen2-MoE models built with transformers, converted with convert.py at TP=2 (expert chunks split
over ETP = 2), give transformers' greedy tokens at TP=1 in one process and at TP=2 under torchrun,
with each expert split over the two ranks (the default, ETP = TP) or whole on both
(--expert-tensor-parallel-size 1). Before the expert grid was built for inference, TP=2 refused
the checkpoint ("... local_experts.0.linear_fc1.weight has shape [80, 32] in the checkpoint but
the model expects [160, 32]")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite.convert.tokenizer_files import resolved_entry
from megalite.checkpoint.megalite_reader import read_common
from megalite.data.tokenizers import build_tokenizer
from megalite.inference.cli import main as generate_main
from tests.convert.hf_models import VOCAB, hf_to_megalite, save_hf, write_hf_tokenizer
from tests.convert.hf_moe_models import hf_moe_model
from tests.distributed import free_port

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["hello world", "the quick brown fox jumps"]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def converted(request, tmp_path_factory):
    """(root, checkpoint, transformers' greedy continuation of each prompt)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"generate-{family}")
    hf = hf_moe_model(family, seed=5, num_layers=3, vocab_size=VOCAB)
    hf_dir = Path(save_hf(hf, root / "hf"))
    write_hf_tokenizer(hf_dir)
    ckpt = Path(hf_to_megalite(hf_dir, root / "ckpt", tp=2))
    entry = resolved_entry(read_common(ckpt)[0]["tokenizer"], ckpt)
    tokenizer = build_tokenizer(entry["type"], tokenizer_model=entry["model"])
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tokenizer.eod,
                              pad_token_id=tokenizer.eod)
        expected.append(out[0, ids.shape[1]:].tolist())
    assert any(len(set(tokens)) > 2 for tokens in expected)  # a continuation that says something
    return root, ckpt, expected


def _generate(root, ckpt, name, *extra, ranks=1) -> list[list[int]]:
    output = root / f"{name}.jsonl"
    args = ["--load", str(ckpt), *[a for p in PROMPTS for a in ("--prompt", p)], "--greedy",
            "--max-new-tokens", str(NEW_TOKENS), "--output-file", str(output), *extra]
    if ranks == 1:
        assert generate_main(args) == 0
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
                   str(free_port()), str(REPO / "tools/generate.py"), *args, "--tensor-model-parallel-size", str(ranks)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"TP={ranks}" in proc.stderr
    return [json.loads(line)["tokens"] for line in output.read_text().splitlines()]


def test_tp1_gives_transformers_greedy_tokens(converted):
    root, ckpt, expected = converted
    assert _generate(root, ckpt, "tp1") == expected


def test_tp2_gives_transformers_greedy_tokens(converted):
    root, ckpt, expected = converted
    assert _generate(root, ckpt, "tp2", ranks=2) == expected


@pytest.mark.slow
def test_tp2_with_whole_experts_gives_transformers_greedy_tokens(converted):
    root, ckpt, expected = converted
    assert _generate(root, ckpt, "tp2-etp1", "--expert-tensor-parallel-size", "1", ranks=2) == expected


def test_expert_tensor_parallel_size_is_checked(converted, capsys):
    root, ckpt, _ = converted
    for etp, expect in ((3, "--expert-tensor-parallel-size 3 does not divide the experts' width"),
                        (2, "--expert-tensor-parallel-size 2 x --expert-model-parallel-size 1 does not divide")):
        assert generate_main(["--load", str(ckpt), "--prompt", "x", "--expert-tensor-parallel-size", str(etp)]) == 2
        err = capsys.readouterr().err
        assert expect in err and len(err.strip().splitlines()) == 1, err


def test_quantize_refuses_experts(converted, capsys):
    pytest.importorskip("torchao")  # without it the missing extra's line comes first
    root, ckpt, _ = converted
    assert generate_main(["--load", str(ckpt), "--prompt", "x", "--quantize", "int8"]) == 2
    err = capsys.readouterr().err
    assert "--quantize int8: the checkpoint's model has MoE experts" in err and len(err.strip().splitlines()) == 1, err
