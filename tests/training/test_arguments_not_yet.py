"""Megatron flags megalite accepts but cannot run yet stop with one line naming the flag (never
accepted and ignored); the defaults run."""

import pytest

from tests.training.test_arguments import parsed, refused


@pytest.mark.parametrize("extra, words", [
    ("--context-parallel-size 2", ["--context-parallel-size 2", "not implemented"]),
    ("--cp-comm-type p2p", ["--cp-comm-type", "context parallelism"]),
    ("--hierarchical-context-parallel-sizes 2 2", ["--hierarchical-context-parallel-sizes"]),
])
def test_refused_naming_the_flag(extra, words):
    message = refused(extra)
    assert "\n" not in message and all(w in message for w in words), message


def test_defaults_run():
    args = parsed("--context-parallel-size 1 --expert-model-parallel-size 1 --attention-backend auto", 1)
    assert (args.context_parallel_size, args.num_experts, args.attention_backend) == (1, None, "auto")
