import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """These tests run many tiny ops; with two OpenMP threads on a busy 2-core machine each op
    waits on the other thread (20 ms for a 90x64 matmul). One thread is 500x faster there."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
