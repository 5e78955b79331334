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


@pytest.fixture(scope="session")
def reference_runs():
    """Single-process reference runs shared by the tests that compare with them (tests/reference_runs.py)."""
    from tests.reference_runs import ReferenceRuns

    return ReferenceRuns()


@pytest.fixture
def seed():
    torch.manual_seed(1234)
    return 1234


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (-n N) with its default --dist load: whole modules to a worker, the most
    expensive first (tests/xdist_scheduling.py); another --dist mode is left to xdist."""
    if config.getoption("dist") != "load":
        return None
    from tests.xdist_scheduling import ModuleScheduling

    return ModuleScheduling(config, log)
