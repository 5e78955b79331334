"""--init-on-shard reaches the model builder (its effect on the weights: tests/model/test_meta_init.py)."""

import pytest
import torch

from megalite.parallel.state import ParallelState
from megalite.training import setup_run
from megalite.config.arguments import parse_args
from tests.training.launch import BASE


class Built(Exception):
    pass


@pytest.mark.parametrize("flag", [False, True])
def test_init_on_shard_flag_is_passed_to_build_model_chunks(monkeypatch, flag):
    seen = {}

    def fake_build(config, pstate, **kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(setup_run, "init_distributed", lambda parallel: (ParallelState.single(), torch.device("cpu")))
    monkeypatch.setattr(setup_run, "build_model_chunks", fake_build)
    args = parse_args(BASE + ["--train-iters", "4"] + (["--init-on-shard"] if flag else []))
    with pytest.raises(Built):
        setup_run.build_run(args)
    assert seen["init_on_shard"] is flag
