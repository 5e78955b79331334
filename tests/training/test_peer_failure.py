"""pretrain_gpt's sorting of a rank's failures: a collective that failed because a peer rank
died, hung or closed its connection is one line (test_pretrain_resume.py kills a rank); an
error of the rank's own code keeps its traceback."""

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megalite.pretrain_gpt import peer_failure

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:15775: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error. GLHF!")
GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv "
                "operation to complete")


def raised_in_torch_distributed(error: BaseException, operation: str = "all_reduce") -> BaseException:
    """`error` as raised by torch.distributed's `operation` (a frame of distributed_c10d.py)."""
    scope = {}
    exec(compile(f"def {operation}(error):\n    raise error\n", "/site-packages/torch/distributed/distributed_c10d.py",
                 "exec"), scope)
    try:
        scope[operation](error)
    except BaseException as e:  # noqa: BLE001 - the error with its traceback
        return e
    raise AssertionError("not raised")


@pytest.mark.parametrize("error, line", [
    (raised_in_torch_distributed(RuntimeError(GLOO_RESET)),
     "all_reduce failed (Read error [127.0.0.1]:15775: Connection reset by peer)"),
    (raised_in_torch_distributed(RuntimeError(GLOO_TIMEOUT), "broadcast"),
     "broadcast failed (Timed out waiting 30000ms for recv operation to complete)"),
    (raised_in_torch_distributed(dist.DistBackendError("NCCL communicator was aborted on rank 3.\nmore"), "barrier"),
     "barrier failed (NCCL communicator was aborted on rank 3)"),
    (RuntimeError("Connection closed by peer [10.0.0.7]:6012"), "Connection closed by peer [10.0.0.7]:6012"),
    (CheckpointException("write", {1: (raised_in_torch_distributed(RuntimeError(GLOO_RESET), "gather"), None)}),
     "gather failed (Read error [127.0.0.1]:15775: Connection reset by peer)"),
])
def test_a_lost_peer_is_one_line(error, line):
    assert peer_failure(error) == line


@pytest.mark.parametrize("error", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
    raised_in_torch_distributed(RuntimeError("Tensors must be contiguous")),
    RuntimeError("DataLoader worker (pid 123) timed out after 5 seconds"),
    ValueError("Connection reset by peer"),  # not a RuntimeError from a collective
    KeyError("layers.0"),
])
def test_a_failure_of_the_rank_itself_keeps_its_traceback(error):
    assert peer_failure(error) is None
