"""The README's main-job command, `bash scripts/pretrain_gpt.sh` with no arguments (slow: a few
minutes): it must finish in under 10 minutes, print a final validation loss below the unigram
entropy of the demo corpus, and leave a checkpoint and a loss plot. Its final checkpoint,
exported to Hugging Face by tools/checkpoint/convert.py, must reproduce in transformers the
validation loss the run logged, on the same tokens, within 1e-4 (tests/convert/
test_demo_export.py checks the same on a 4-iteration run of this configuration)."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megalite.data.tokenizers import build_tokenizer
from megalite.parallel.state import ParallelState
from megalite.config.arguments import Arguments
from megalite.checkpoint.dcp.checkpoint import iteration_dir, read_tracker
from megalite.training.metrics import read_metrics
from megalite.training.setup_run import build_data
from tests.training.launch import REPO, script_env
from tools.demo_summary import unigram_entropy

LOSS_TOL = 1e-4
TIME_LIMIT_S = 600


def _final_valid_batches(args, consumed_before: int):
    """The micro-batches of the evaluation that started after `consumed_before` validation
    samples, in the order the run read them (one data-parallel replica: DP = 1)."""
    tokenizer = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model)
    _, valid, _ = build_data(SimpleNamespace(args=args, pstate=ParallelState.single(), tokenizer=tokenizer))
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    for step in range(args.eval_iters):
        start = consumed_before + step * gbs
        yield [[valid[i] for i in range(s, s + mbs)] for s in range(start, start + gbs, mbs)]


def _transformers_loss(hf_dir: Path, batches) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    step_losses = []
    with torch.no_grad():
        for micro_batches in batches:
            losses = []
            for samples in micro_batches:
                tokens, labels, mask = (torch.stack([torch.as_tensor(s[k]) for s in samples])
                                        for k in ("tokens", "labels", "loss_mask"))
                logits = model(tokens.long()).logits.float()
                per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.long(), reduction="none")
                losses.append((per_token * mask.float()).sum() / mask.float().sum())
            step_losses.append(torch.stack(losses).mean())
    return torch.stack(step_losses).mean().item()


@pytest.mark.slow
def test_embedded_default_run(tmp_path):
    pytest.importorskip("transformers")
    run_dir = tmp_path / "demo"
    start = time.time()
    proc = subprocess.run(["bash", "scripts/pretrain_gpt.sh"], cwd=REPO, env=script_env(RUN_DIR=str(run_dir)),
                          capture_output=True, text=True, timeout=TIME_LIMIT_S + 120)
    elapsed = time.time() - start
    print(f"embedded default run: {elapsed:.0f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert elapsed < TIME_LIMIT_S, f"the embedded default run took {elapsed:.0f} s"

    printed = float(re.search(r"final validation loss : ([\d.]+) nats", proc.stdout).group(1))
    entropy = unigram_entropy(str(run_dir / "data" / "demo_text_document"))
    _, evaluations = read_metrics(str(run_dir / "metrics.jsonl"))
    valid = evaluations["valid"]
    last = max(valid)
    logged = valid[last]["lm_loss"]
    print(f"final validation loss {logged:.4f} at iteration {last}, unigram entropy {entropy:.4f}")
    assert abs(printed - logged) < 1e-4 and logged < entropy
    assert read_tracker(run_dir / "checkpoints") == last
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    common = json.loads((iteration_dir(run_dir / "checkpoints", last) / "common.json").read_text())
    args = Arguments.from_dict(common["args"])
    per_evaluation = args.eval_iters * args.global_batch_size
    assert args.data_parallel_size == 1 and common["consumed_valid_samples"] == len(valid) * per_evaluation
    convert = subprocess.run([sys.executable, "tools/checkpoint/convert.py", "--loader", "megalite", "--saver", "hf",
                              "--load-dir", str(run_dir / "checkpoints"), "--save-dir", str(tmp_path / "hf")],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
    assert convert.returncode == 0, convert.stderr[-3000:]
    hf_loss = _transformers_loss(tmp_path / "hf", _final_valid_batches(args, (len(valid) - 1) * per_evaluation))
    print(f"transformers {hf_loss:.7f} megalite {logged:.7f}")
    assert abs(hf_loss - logged) <= LOSS_TOL, f"transformers {hf_loss:.6f} vs megalite's logged {logged:.6f}"
