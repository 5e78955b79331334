"""What the tests' fork server (megalite.parallel.spawn) imports once, for every rank of
run_distributed and every program of tests/forked_program.py: as in the test process
(tests/conftest.py), Triton's interpreter and one intra-op thread; then the modules a rank or a
training run would otherwise import again."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

PRELOAD = ("tests.rank_start", "megalite.model.gpt", "megalite.training.setup_run", "megalite.training.loop",
           "megalite.config.arguments", "megalite.optimizer.mixed_precision", "megalite.parallel.pipeline.executor")
