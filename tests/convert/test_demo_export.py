"""A model trained by the embedded default run's configuration (examples/demo_cpu.yaml: a small
Llama-style GPT with GQA at TP=2 PP=2 on four CPU processes, on the demo corpus with its
SentencePiece tokenizer) converts to Hugging Face, and transformers reproduces the validation
loss megalite logged, on the same tokens, within 1e-4. The exported tokenizer encodes as
megalite's does."""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megalite.data.tokenizers import build_tokenizer
from megalite.parallel.state import ParallelState
from megalite.config.arguments import parse_args, validate_args
from tests.convert.hf_models import megalite_to_hf
from tests.distributed import free_port
from tests.forked_program import run_program

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
LOSS_TOL = 1e-4
TRAIN_ITERS, EVAL_ITERS, WORLD = 4, 2, 4


def _run(*argv, env=None):
    proc = run_program([sys.executable, *map(str, argv)], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, f"{argv[:3]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The embedded default's data preparation on a small corpus, then a short training run."""
    root = tmp_path_factory.mktemp("demo")
    data = root / "data"
    data.mkdir()
    _run("tools/make_demo_corpus.py", "--output", data / "corpus.jsonl", "--max-mb", "0.5")
    _run("tools/train_tokenizer.py", "--input", data / "corpus.jsonl", "--json-keys", "text", "--vocab-size", "2048",
         "--model-prefix", data / "tokenizer")
    _run("tools/preprocess_data.py", "--input", data / "corpus.jsonl", "--json-keys", "text", "--output-prefix",
         data / "demo", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", data / "tokenizer.model",
         "--append-eod", "--workers", "1")
    argv = ["--config", str(REPO / "examples/demo_cpu.yaml"), "--data-path", str(data / "demo_text_document"),
            "--tokenizer-model", str(data / "tokenizer.model"), "--save", str(root / "checkpoints"),
            "--metrics-file", str(root / "metrics.jsonl"), "--train-iters", str(TRAIN_ITERS), "--lr-warmup-iters", "1",
            "--eval-iters", str(EVAL_ITERS), "--data-cache-path", str(root / "cache"), "--distributed-backend", "gloo"]
    _run("-m", "torch.distributed.run", "--nproc-per-node", WORLD, "--master-port", free_port(),
         "-m", "megalite.pretrain_gpt", *argv)
    return root, argv


def _with_flags(argv: list[str], values: dict) -> list[str]:
    """argv with each flag of `values` set to its value: replaced where argv has it (a flag may be
    given once), appended where it does not."""
    out, values = list(argv), {flag: str(value) for flag, value in values.items()}
    for i, arg in enumerate(out[:-1]):
        if arg in values:
            out[i + 1] = values.pop(arg)
    return out + [item for pair in values.items() for item in pair]


def _valid_loss_logged(metrics: Path) -> float:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    valid = [r for r in records if r.get("split") == "valid" and r["iteration"] == TRAIN_ITERS]
    assert valid, f"{metrics}: no validation loss at iteration {TRAIN_ITERS}"
    return valid[-1]["lm_loss"]


def _valid_batches(argv):
    """The validation micro-batches of the run's final evaluation, in the order it read them:
    its datasets rebuilt from its own options (the index cache it wrote is reused)."""
    from megalite.config.run_config import DataConfig
    from megalite.training.setup_run import build_data

    args = parse_args(argv)
    validate_args(args, WORLD)
    tokenizer = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model)
    run = SimpleNamespace(config=SimpleNamespace(data=DataConfig.from_args(args)), pstate=ParallelState.single(),
                          tokenizer=tokenizer)
    _, valid, _ = build_data(run)
    per_step, mbs = args.global_batch_size, args.micro_batch_size
    for step in range(EVAL_ITERS):
        yield [[valid[i] for i in range(start, start + mbs)]
               for start in range(step * per_step, (step + 1) * per_step, mbs)]


def test_transformers_reproduces_the_validation_loss(demo_run):
    root, argv = demo_run
    hf_dir = Path(megalite_to_hf(root / "checkpoints", root / "hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
    step_losses = []
    with torch.no_grad():
        for micro_batches in _valid_batches(argv):
            losses = []
            for samples in micro_batches:
                tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
                labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
                mask = torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).float()
                logits = model(tokens).logits.float()
                per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
                losses.append((per_token * mask).sum() / mask.sum())
            step_losses.append(torch.stack(losses).mean())
    hf_loss = torch.stack(step_losses).mean().item()
    logged = _valid_loss_logged(root / "metrics.jsonl")
    print(f"transformers {hf_loss:.7f} megalite {logged:.7f}")
    assert abs(hf_loss - logged) <= LOSS_TOL, f"transformers {hf_loss:.6f} vs megalite's logged {logged:.6f}"


def test_exported_tokenizer_encodes_like_megalite(demo_run):
    root, argv = demo_run
    hf_dir = root / "hf"
    if not hf_dir.exists():
        megalite_to_hf(root / "checkpoints", hf_dir)
    assert (hf_dir / "tokenizer.model").exists()
    ours = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(root / "data" / "tokenizer.model"))
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = json.loads((root / "data" / "corpus.jsonl").read_text().splitlines()[3])["text"][:2000]
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert json.loads((hf_dir / "config.json").read_text())["eos_token_id"] == ours.eod


def test_relayout_keeps_optimizer_state_and_training_continues(demo_run):
    """The trained TP=2 PP=2 checkpoint (with Adam state) converted offline to TP=1 PP=1 keeps
    every tensor; a one-process run continues from it (optimizer and scheduler loaded)."""
    from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
    from tests.convert.hf_models import convert

    root, argv = demo_run
    assert convert("--loader", "megalite", "--saver", "megalite", "--load-dir", root / "checkpoints",
                   "--save-dir", root / "tp1", "--target-tensor-parallel-size", 1,
                   "--target-pipeline-parallel-size", 1) == 0
    source, target = MegaliteCheckpoint(root / "checkpoints"), MegaliteCheckpoint(root / "tp1")
    assert any(k.startswith("optimizer/exp_avg_sq/") for k in source.keys())
    assert source.keys() == target.keys() and target.iteration == source.iteration == TRAIN_ITERS
    for key in source.keys():
        assert torch.equal(source.get(key), target.get(key)), key
    continued = _with_flags(argv, {"--save": root / "continued", "--load": root / "tp1",
                                   "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1,
                                   "--train-iters": TRAIN_ITERS + 1, "--lr-decay-iters": TRAIN_ITERS,
                                   "--eval-iters": 0, "--log-interval": 1, "--metrics-file": root / "continued.jsonl"})
    proc = _run("-m", "megalite.pretrain_gpt", *continued,
                env={"WORLD_SIZE": "1", "RANK": "0", "MASTER_PORT": str(free_port())})
    records = [json.loads(line) for line in (root / "continued.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "lm_loss" in r and "split" not in r] == [TRAIN_ITERS + 1], proc.stdout
