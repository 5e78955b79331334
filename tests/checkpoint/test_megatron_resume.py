"""Resuming a Megatron checkpoint's optimizer state, schedule and RNG states with Megatron's
rules and flags, on small `torch`-format files (tests/checkpoint/megatron_files.py). Megatron-Core's
own formats, and losses equal to its own continuation: tests/checkpoint/test_megatron_core_optimizer.py
(slow)."""

import random

import numpy as np
import pytest
import torch

from megalite.model.gpt import GPTModel
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.state import ParallelState
from megalite.config.arguments import parse_args
from megalite.checkpoint.dcp.format import CheckpointError
from megalite.checkpoint.run_load import load_for_run, resume_optimizer
from megalite.config.run_config import CheckpointConfig, OptimizerConfig
from megalite.training.setup_run import build_optimizer_and_schedule
from tests.checkpoint.megatron_files import (
    CONFIG, megatron_adam_state, megatron_args, megatron_scheduler, megatron_state_dict, write_megatron_torch,
)

SINGLE = ParallelState.single()
FLAGS = ["--ckpt-format", "torch", "--lr", "1e-3", "--min-lr", "0", "--lr-decay-style", "linear", "--lr-decay-iters",
         "10", "--train-iters", "10", "--global-batch-size", "4", "--micro-batch-size", "4", "--weight-decay", "0.01"]


def _write(tmp_path, iteration=3, scheduler=None, **entries):
    model_state = megatron_state_dict(GPTModel(CONFIG, init_seed=0))
    optimizer, by_name = megatron_adam_state(model_state)
    entries = {"optimizer": optimizer, "opt_param_scheduler": scheduler or megatron_scheduler(), **entries}
    write_megatron_torch(tmp_path / "ckpt", iteration=iteration, seed=0, **entries)
    return model_state, by_name


def _resume(tmp_path, *flags):
    """What build_run does with --load: weights, then the optimizer built, then its state."""
    model = GPTModel(CONFIG, init_seed=1)
    args = parse_args(["--load", str(tmp_path / "ckpt"), *FLAGS, *flags])
    ckpt = CheckpointConfig.from_args(args)
    common = load_for_run(ckpt, [model], SINGLE, None)
    optimizer, scheduler = build_optimizer_and_schedule([DistributedDataParallel(model, SINGLE)],
                                                        OptimizerConfig.from_args(args), SINGLE)
    if not (ckpt.finetune or ckpt.no_load_optim):
        resume_optimizer(common, ckpt, chunks=[model], optimizer=optimizer, scheduler=scheduler, pstate=SINGLE)
    return model, common, optimizer, scheduler


def test_adam_state_lands_on_the_parameter_it_belongs_to(tmp_path):
    model_state, by_name = _write(tmp_path)
    model, common, optimizer, scheduler = _resume(tmp_path)
    loaded = optimizer.state_dict()
    assert loaded["step"] == 2 and common["iteration"] == 3 and scheduler.num_steps == 12
    for name, states in by_name.items():
        ours = loaded["params"][name.removeprefix("decoder.")]
        assert torch.equal(ours["exp_avg"], states["exp_avg"]), name
        assert torch.equal(ours["exp_avg_sq"], states["exp_avg_sq"]), name
        assert torch.equal(ours["param"], model_state[name]), name  # fp32: the weights are the main values


def test_param_groups_that_do_not_fit_are_refused(tmp_path):
    model_state = megatron_state_dict(GPTModel(CONFIG, init_seed=0))
    optimizer, _ = megatron_adam_state(model_state)
    decay, plain = optimizer["param_groups"]
    plain["params"].insert(0, decay["params"].pop())  # a 2-D tensor's state filed as undecayed
    write_megatron_torch(tmp_path / "ckpt", optimizer=optimizer, opt_param_scheduler=megatron_scheduler())
    with pytest.raises(CheckpointError, match=r"model_optim_rng\.pt: a param group .* holds .*--no-load-optim"):
        _resume(tmp_path)


def test_another_optimizer_is_refused(tmp_path):
    _write(tmp_path)
    with pytest.raises(CheckpointError, match=r"model_optim_rng\.pt: the optimizer state is for 'adam', this run uses "
                                              r"--optimizer sgd"):
        _resume(tmp_path, "--optimizer", "sgd")


def test_the_schedule_must_match_unless_overridden_or_taken(tmp_path):
    _write(tmp_path, scheduler=megatron_scheduler(num_steps=20, max_lr=2e-3))
    with pytest.raises(CheckpointError, match=r"--lr 0.002 but this run has 0.001 .*--override-opt_param-scheduler"):
        _resume(tmp_path)
    _, _, _, scheduler = _resume(tmp_path, "--override-opt_param-scheduler")
    assert scheduler.max_lr == 1e-3 and scheduler.num_steps == 12  # Megatron: the samples consumed
    _, _, optimizer, scheduler = _resume(tmp_path, "--use-checkpoint-opt_param-scheduler")
    assert scheduler.max_lr == 2e-3 and scheduler.num_steps == 20
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * (1 - 20 / 40))


def test_the_weight_decay_in_the_schedule(tmp_path):
    _write(tmp_path, scheduler=megatron_scheduler(weight_decay=0.05))
    with pytest.raises(CheckpointError, match=r"weight decay is 0.05 to 0.05 but this run has --weight-decay 0.01"):
        _resume(tmp_path)
    _, _, optimizer, _ = _resume(tmp_path, "--use-checkpoint-opt_param-scheduler")
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    _write(tmp_path, scheduler=megatron_scheduler(start_wd=0.0, end_wd=0.1))
    with pytest.raises(CheckpointError, match="goes from 0.0 to 0.1; megalite's is constant"):
        _resume(tmp_path, "--use-checkpoint-opt_param-scheduler")


def test_a_release_checkpoint_gives_weights_only(tmp_path, capsys):
    model_state, _ = _write(tmp_path, iteration="release")
    model, common, optimizer, _ = _resume(tmp_path)
    assert common["iteration"] == 0 and common["megatron_optimizer"] is None
    assert optimizer.state_dict()["step"] == 0
    weights = dict(model.named_parameters())
    assert torch.equal(weights["layers.1.mlp.linear_fc2.weight"], model_state["decoder.layers.1.mlp.linear_fc2.weight"])
    assert "weights only: a release checkpoint" in capsys.readouterr().out


def _rng_entry(seed: int) -> list[dict]:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]


def test_rng_states_only_for_the_same_layout(tmp_path, capsys):
    saved = _rng_entry(7)[0]
    _write(tmp_path, rng_state=[saved])
    torch.manual_seed(0)
    _resume(tmp_path, "--no-load-rng")
    assert not torch.equal(torch.get_rng_state(), saved["torch_rng_state"])
    _resume(tmp_path)
    assert torch.equal(torch.get_rng_state(), saved["torch_rng_state"]) and random.getstate() == saved["random_rng_state"]
    assert np.array_equal(np.random.get_state()[1], saved["np_rng_state"][1])
    assert "its CUDA ones are not used on CPU" in capsys.readouterr().out
    write_megatron_torch(tmp_path / "ckpt", args=megatron_args(tensor_model_parallel_size=2), rng_state=[saved],
                         optimizer=megatron_adam_state(megatron_state_dict(GPTModel(CONFIG, init_seed=0)))[0],
                         opt_param_scheduler=megatron_scheduler())
    torch.manual_seed(0)
    _resume(tmp_path)
    assert not torch.equal(torch.get_rng_state(), saved["torch_rng_state"])
    assert "(TP, PP) mismatch after resume ((1, 1) vs (2, 1) from checkpoint): RNG state will be ignored" in (
        capsys.readouterr().out)
