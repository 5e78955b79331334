"""Checkpoints written by Megatron-Core itself (tests/checkpoint/megatron_core_fixture.py: its
GPTModel at TP=2 PP=2 on CPU, saved in `torch` and `torch_dist`) load into megalite at TP=1,
TP=2 and PP=2 (with and without virtual stages) and give Megatron-Core's logits; training
continues from them; convert.py --loader megatron --saver hf gives transformers the same logits.

Llama-like (RoPE, RMSNorm, SwiGLU, GQA, untied; `torch` files with Transformer Engine's fused
norm names) and GPT-2-like (learned positions, LayerNorm, GeLU, biases, tied; local names).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite.checkpoint.megatron.reader import MegatronCheckpoint
from tests.checkpoint.megatron_core_fixture import ITERATION, VOCAB, tokens, write_megatron_checkpoints
from tests.checkpoint.megatron_core_pipeline import megalite_pipeline_logits
from tests.distributed import free_port, run_distributed

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # Megatron-Core writes each family in 30-90 s on 2 shared cores
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def megatron_dir(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(f"megatron_{request.param}")
    run_distributed(write_megatron_checkpoints, 4, str(out), request.param, request.param == "llama", timeout=600)
    return request.param, out


def _megalite_logits(rank, world, out):
    return {fmt: _load_and_run(world, f"{out}/{fmt}") for fmt in ("torch", "torch_dist")}


def _load_and_run(world, load_dir):
    from megalite.model.pipeline_chunks import build_model_chunks
    from megalite.parallel.state import ParallelLayout, ParallelState
    from megalite.config.arguments import parse_args
    from megalite.checkpoint.run_load import load_for_run
    from megalite.config.run_config import CheckpointConfig

    pstate = ParallelState.create(ParallelLayout(world, tensor=world))
    config = MegatronCheckpoint(load_dir).config
    [model] = build_model_chunks(config, pstate, init_seed=5)
    args = parse_args(["--load", load_dir, "--finetune", "--auto-detect-ckpt-format"])
    common = load_for_run(CheckpointConfig.from_args(args), [model], pstate, None)
    model.eval()
    with torch.no_grad():
        local = model(tokens())  # vocab-parallel logits [b, s, V/t]
    pieces = [torch.empty_like(local) for _ in range(world)]
    if world > 1:
        torch.distributed.all_gather(pieces, local.contiguous(), group=pstate.tp_group)
    else:
        pieces = [local]
    return torch.cat(pieces, dim=-1)[..., :VOCAB], common["iteration"]


@pytest.mark.parametrize("tp", [1, 2])
def test_megalite_gives_megatron_core_logits(megatron_dir, tp):
    """Both formats, loaded at TP=1 PP=1 and at TP=2 PP=1, within 1e-5 in fp32."""
    _, out = megatron_dir
    reference = torch.load(out / "logits.pt", weights_only=True)
    for by_format in run_distributed(_megalite_logits, tp, str(out)):
        for fmt, (logits, iteration) in by_format.items():
            assert iteration == ITERATION, fmt
            torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"{fmt}: {m}")


@pytest.mark.parametrize("vp", [1, 2])
def test_megalite_pipeline_gives_megatron_core_logits(megatron_dir, vp):
    """Both formats loaded at megalite TP=1 PP=2 (with 2 virtual stages per rank: layers
    {0, 2} and {1, 3}, where Megatron's PP=2 files hold {0, 1} and {2, 3})."""
    _, out = megatron_dir
    reference = torch.load(out / "logits.pt", weights_only=True)
    formats = ["torch", "torch_dist"]
    results = run_distributed(megalite_pipeline_logits, 2, [str(out / f) for f in formats], vp)
    for fmt, (logits, iteration) in zip(formats, results[1]):
        assert iteration == ITERATION, fmt
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5, msg=lambda m: f"{fmt}: {m}")


def test_both_formats_hold_the_same_tensors(megatron_dir):
    _, out = megatron_dir
    legacy, dist = MegatronCheckpoint(out / "torch"), MegatronCheckpoint(out / "torch_dist")
    assert (legacy.format, dist.format) == ("torch", "torch_dist")
    for name in legacy.names():
        assert torch.equal(legacy.get(name), dist.get(name)), name
    assert legacy.unused() == [] and dist.unused() == []


def test_training_continues_from_it(megatron_dir, tmp_path):
    family, out = megatron_dir
    save = tmp_path / "after"
    argv = ["--use-checkpoint-args", "--load", str(out / "torch"), "--ckpt-format", "torch", "--no-load-optim",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--mock-data",
            "--make-vocab-size-divisible-by", "8", "--seq-length", "12",
            "--train-iters", str(ITERATION + 2), "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
            "--eval-iters", "0", "--num-workers", "0", "--distributed-backend", "gloo", "--save", str(save),
            "--save-interval", str(ITERATION + 2), "--log-interval", "1", "--tensor-model-parallel-size", "2",
            # the fixture's Megatron run computed exact GeLU (bias_gelu_fusion=False); Megatron's
            # --use-checkpoint-args does not carry that flag either, so the resuming command gives it
            "--no-bias-gelu-fusion"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", env["MASTER_PORT"], "-m", "megalite.pretrain_gpt", *argv],
                          capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"loaded Megatron torch checkpoint" in proc.stdout
    assert (save / f"iter_{ITERATION + 2:07d}").is_dir()  # iterations 8 and 9 ran: the count went on from 7
    from megalite.checkpoint.megalite_reader import MegaliteCheckpoint

    after, before = MegaliteCheckpoint(save), MegatronCheckpoint(out / "torch")
    moved = [n for n in before.names() if not torch.equal(after.get(f"model/{n}"), before.get(n))]
    assert moved, "two training steps changed no weight"


def test_convert_to_hf_gives_transformers_the_same_logits(megatron_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    from megalite.convert.cli import main

    _, out = megatron_dir
    for fmt in ("torch", "torch_dist"):
        hf = tmp_path / f"hf_{fmt}"
        assert main(["--loader", "megatron", "--saver", "hf", "--load-dir", str(out / fmt), "--save-dir", str(hf)]) == 0
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(tokens()).logits
        reference = torch.load(out / "logits.pt", weights_only=True)
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_convert_to_megalite_keeps_iteration_and_weights(megatron_dir, tmp_path):
    from megalite.convert.cli import main
    from megalite.checkpoint.megalite_reader import MegaliteCheckpoint

    _, out = megatron_dir
    assert main(["--loader", "megatron", "--saver", "megalite", "--load-dir", str(out / "torch_dist"),
                 "--save-dir", str(tmp_path / "ml"), "--target-tensor-parallel-size", "2"]) == 0
    converted, source = MegaliteCheckpoint(tmp_path / "ml"), MegatronCheckpoint(out / "torch")
    assert converted.iteration == ITERATION and converted.common["consumed_train_samples"] == 56
    for name in source.names():
        assert torch.equal(converted.get(f"model/{name}"), source.get(name)), name
