"""Imported first by the tests' fork server (megalite.parallel.spawn; tests/distributed.py
PRELOAD): as in the test process (tests/conftest.py), Triton's interpreter and one intra-op
thread, before the modules a rank or a training run would otherwise import again."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
