import os

# Triton kernels run in Triton's CPU interpreter in these tests; the variable must be set before
# anything (megatron.core, say) imports triton.language.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

# One intra-op thread: the tests run many tiny ops, which a second OpenMP thread only slows down
# (on a busy 2-core machine a 90x64 matmul waited 20 ms on it); spawned ranks use one as well.
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer than the default suite allows; run with -m slow")


@pytest.fixture
def seed():
    torch.manual_seed(1234)
    return 1234
