"""Importing megalite's training modules and running a model forward and backward imports
neither torch._dynamo nor inductor nor triton: those imports add seconds to every process that
never compiles (a conversion, a generation, a spawned test rank). torch itself imports them on
the first torch.optim step or torch.utils.checkpoint call; megalite.model.recompute used to at
import."""

import subprocess
import sys

from tests.training.launch import REPO

PROGRAM = """
import sys, torch
from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
import megalite.training.setup_run
config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=16)
model = GPTModel(config)
tokens = torch.randint(0, 64, (2, 8))
model(tokens, labels=tokens).sum().backward()
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "triton") if m in sys.modules))
"""


def test_a_model_runs_without_importing_the_compiler():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
