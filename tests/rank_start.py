"""What every test rank starts with, set once in the fork server (tests/distributed.py PRELOAD):
as in the test process (tests/conftest.py), Triton's interpreter and one intra-op thread."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
