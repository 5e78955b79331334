import os

# Triton kernels run in Triton's CPU interpreter in these tests; the variable must be set before
# anything (megatron.core, say) imports triton.language.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

# Tests are numerical comparisons at fp32; keep them on one deterministic thread budget.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer than the default suite allows; run with -m slow")


@pytest.fixture
def seed():
    torch.manual_seed(1234)
    return 1234
