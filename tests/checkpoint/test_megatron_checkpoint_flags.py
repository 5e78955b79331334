"""Megatron's checkpoint flags, each with a test that fails if it were ignored."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite.model.gpt import GPTModel
from megalite.parallel.state import ParallelState
from megalite.config.arguments import parse_args, validate_args
from megalite.config.megatron.checkpoint import checkpoint_flag_notes
from megalite.checkpoint.dcp.format import CheckpointError
from megalite.training.lr_schedule import LRScheduler
from megalite.checkpoint.run_load import (
    checkpoint_args_of, load_for_run, non_persistent_dir, prune_checkpoints, restore_scheduler,
)
from megalite.config.megatron.checkpoint import apply_checkpoint_args
from megalite.config.run_config import CheckpointConfig
from tests.checkpoint.megatron_files import CONFIG, megatron_args, write_megatron_torch
from tests.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "1"]


def _load(tmp_path, *flags, seed=1):
    model = GPTModel(CONFIG, init_seed=seed)
    args = parse_args(["--load", str(tmp_path / "ckpt"), *flags])
    return model, load_for_run(CheckpointConfig.from_args(args), [model], ParallelState.single(), None)


def _fc1(model):
    return dict(model.named_parameters())["layers.0.mlp.linear_fc1.weight"]


def test_ckpt_format_and_auto_detect(tmp_path):
    state = write_megatron_torch(tmp_path / "ckpt", seed=3)
    with pytest.raises(CheckpointError, match=r"--ckpt-format dcp: .* is in torch format"):
        _load(tmp_path, "--finetune")  # megalite's default, torch_dist
    with pytest.raises(CheckpointError, match="--ckpt-format torch_dist"):
        _load(tmp_path, "--finetune", "--ckpt-format", "torch_dist")
    for flags in (["--ckpt-format", "torch"], ["--auto-detect-ckpt-format"]):
        model, common = _load(tmp_path, "--finetune", *flags)
        assert torch.equal(_fc1(model), state["decoder.layers.0.mlp.linear_fc1.weight"])
        assert common["iteration"] == 3 and common["consumed_train_samples"] == 12


def test_megatron_optimizer_state_needs_no_load_optim(tmp_path):
    write_megatron_torch(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="--no-load-optim"):
        _load(tmp_path, "--ckpt-format", "torch")
    _, common = _load(tmp_path, "--ckpt-format", "torch", "--no-load-optim")
    assert common["iteration"] == 3 and not common["finetune"]


def test_ckpt_step_picks_the_iteration(tmp_path):
    first = write_megatron_torch(tmp_path / "ckpt", iteration=3, seed=3)
    write_megatron_torch(tmp_path / "ckpt", iteration=5, seed=5)
    model, common = _load(tmp_path, "--ckpt-format", "torch", "--finetune", "--ckpt-step", "3")
    assert common["iteration"] == 3 and torch.equal(_fc1(model), first["decoder.layers.0.mlp.linear_fc1.weight"])
    _, common = _load(tmp_path, "--ckpt-format", "torch", "--finetune")
    assert common["iteration"] == 5


def test_pretrained_checkpoint_when_load_is_empty(tmp_path):
    state = write_megatron_torch(tmp_path / "pre", seed=4)
    model = GPTModel(CONFIG, init_seed=1)
    args = parse_args(["--load", str(tmp_path / "empty"), "--pretrained-checkpoint", str(tmp_path / "pre"),
                       "--ckpt-format", "torch"])
    common = load_for_run(CheckpointConfig.from_args(args), [model], ParallelState.single(), None)
    assert common["finetune"] and torch.equal(_fc1(model), state["decoder.layers.0.mlp.linear_fc1.weight"])


def test_use_checkpoint_args_takes_the_architecture(tmp_path):
    write_megatron_torch(tmp_path / "ckpt", args=megatron_args(num_layers=2, hidden_size=16, swiglu=True))
    plain = parse_args(["--load", str(tmp_path / "ckpt")])
    assert apply_checkpoint_args(plain, checkpoint_args_of(plain.load)) == [] and plain.num_layers is None and not plain.swiglu
    args = parse_args(["--load", str(tmp_path / "ckpt"), "--use-checkpoint-args", "--num-layers", "8"])
    lines = apply_checkpoint_args(args, checkpoint_args_of(args.load))
    assert args.num_layers == 8  # set by the user: Megatron keeps it
    assert (args.hidden_size, args.swiglu, args.normalization, args.disable_bias_linear) == (16, True, "RMSNorm", True)
    assert any("swiglu" in line for line in lines)


def test_dist_ckpt_strictness(tmp_path, caplog):
    extra = {"decoder.layers.1.self_attention.q_layernorm.weight": torch.ones(8)}
    write_megatron_torch(tmp_path / "ckpt", extra=extra)
    _load(tmp_path, "--ckpt-format", "torch", "--finetune")  # assume_ok_unexpected: Megatron's default
    with pytest.raises(CheckpointError, match=r"q_layernorm\.weight has no place.*raise_unexpected"):
        _load(tmp_path, "--ckpt-format", "torch", "--finetune", "--dist-ckpt-strictness", "raise_unexpected")
    with caplog.at_level(logging.WARNING):
        _load(tmp_path, "--ckpt-format", "torch", "--finetune", "--dist-ckpt-strictness", "log_unexpected")
    assert "q_layernorm.weight has no place" in caplog.text
    with pytest.raises(ValueError, match="--dist-ckpt-strictness ignore_all"):
        validate_args(parse_args([*MODEL, "--dist-ckpt-strictness", "ignore_all"]), 1)


def _scheduler(lr: float) -> LRScheduler:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return LRScheduler(optimizer, max_lr=lr, decay_steps=100, decay_style="constant")


def test_scheduler_flags():
    saved = _scheduler(1e-3)
    saved.step(10)
    state = saved.state_dict()
    with pytest.raises(CheckpointError, match="--override-opt_param-scheduler"):
        restore_scheduler(_scheduler(2e-3), state, CheckpointConfig.from_args(parse_args([])))
    kept = _scheduler(2e-3)
    restore_scheduler(kept, state, CheckpointConfig.from_args(parse_args(["--override-opt_param-scheduler"])))
    assert kept.num_steps == 10 and kept.optimizer.param_groups[0]["lr"] == 2e-3
    taken = _scheduler(2e-3)
    restore_scheduler(taken, state, CheckpointConfig.from_args(parse_args(["--use-checkpoint-opt_param-scheduler"])))
    assert taken.num_steps == 10 and taken.optimizer.param_groups[0]["lr"] == 1e-3
    with pytest.raises(ValueError, match="contradict"):
        validate_args(parse_args([*MODEL, "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"]), 1)


def test_prune_keeps_multiples_and_the_latest(tmp_path):
    for i in (2, 3, 4, 5):
        (tmp_path / f"iter_{i:07d}").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002", "iter_0000004", "iter_0000005"]


def test_non_persistent_directories():
    kinds = {"local": ["--non-persistent-local-ckpt-dir", "/node/ckpt"], "global": []}
    for kind, extra in kinds.items():
        args = parse_args(["--save", "/s", "--non-persistent-save-interval", "5", "--non-persistent-ckpt-type", kind, *extra])
        assert str(non_persistent_dir(CheckpointConfig.from_args(args))) == ("/node/ckpt" if kind == "local" else "/s/non_persistent")
    assert non_persistent_dir(CheckpointConfig.from_args(parse_args(["--save", "/s"]))) is None


def test_accepted_flags_say_how_megalite_serves_them():
    args = parse_args(["--ckpt-format", "torch", "--use-persistent-ckpt-worker", "--ckpt-fully-parallel-load",
                       "--ckpt-assume-constant-structure", "--dist-ckpt-optim-fully-reshardable"])
    notes = checkpoint_flag_notes(args)
    for flag in ("--ckpt-format torch", "--use-persistent-ckpt-worker", "--ckpt-fully-parallel-load",
                 "--ckpt-assume-constant-structure", "--dist-ckpt-optim-fully-reshardable"):
        assert sum(line.startswith(flag) for line in notes) == 1, flag
    assert checkpoint_flag_notes(parse_args([])) == []
    with pytest.raises(ValueError, match="--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir"):
        validate_args(parse_args([*MODEL, "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "local"]), 1)
    with pytest.raises(ValueError, match="--non-persistent-ckpt-type"):
        validate_args(parse_args([*MODEL, "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type",
                                  "in_memory"]), 1)


def _train(tmp_path, name, *flags):
    metrics = tmp_path / f"{name}.jsonl"
    argv = [*MODEL, "--vocab-size", "63", "--tokenizer-type", "NullTokenizer", "--mock-data", "--global-batch-size", "2",
            "--lr", "1e-3", "--lr-decay-iters", "10", "--eval-iters", "0", "--num-workers", "0",
            "--distributed-backend", "gloo",
            "--log-interval", "1", "--metrics-file", str(metrics), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-m", "megalite.pretrain_gpt", *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["iteration"] for r in lines if "split" not in r and "lm_loss" in r]


@pytest.mark.slow  # three training runs: about 30-60 s on 2 shared cores
def test_retain_interval_non_persistent_local_and_resume(tmp_path):
    save, local = tmp_path / "save", tmp_path / "local"
    keep = ["--save", str(save), "--save-interval", "2", "--non-persistent-save-interval", "1",
            "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(local)]
    _train(tmp_path, "first", "--train-iters", "5", "--save-retain-interval", "4", *keep)
    # 2 pruned by --save-retain-interval; 5 is the end-of-training save
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000004", "iter_0000005"]
    assert sorted(p.name for p in local.glob("iter_*")) == ["iter_0000005"]  # non-persistent: only the latest
    shutil.rmtree(save / "iter_0000005")  # as if the run had died after iteration 5's non-persistent save
    (save / "latest_checkpointed_iteration.txt").write_text("4")
    resumed = _train(tmp_path, "resumed", "--train-iters", "6", "--load", str(save), *keep)
    assert resumed == [6]  # from the newer non-persistent iteration 5, not --save's 4
    stepped = _train(tmp_path, "stepped", "--train-iters", "6", "--load", str(save), "--ckpt-step", "4", *keep)
    assert stepped == [5, 6]
    # --save-interval without --save saves nothing (as in Megatron) and takes no turn from the local saves
    alone = tmp_path / "alone"
    _train(tmp_path, "alone", "--train-iters", "4", "--save-interval", "2", "--non-persistent-save-interval", "1",
           "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(alone))
    assert sorted(p.name for p in alone.glob("iter_*")) == ["iter_0000004"]


def _save_replicated(rank, world, root):
    from megalite.model.pipeline_chunks import build_model_chunks
    from megalite.parallel.state import ParallelLayout
    from megalite.checkpoint.dcp.checkpoint import save_checkpoint

    state = ParallelState.create(ParallelLayout(world))  # DP = 2: every tensor replicated
    chunks = build_model_chunks(CONFIG, state, init_seed=2)
    for fully_parallel in (True, False):
        save_checkpoint(f"{root}/{fully_parallel}", 1, chunks=chunks, optimizer=None, pstate=state, common={},
                        fully_parallel=fully_parallel)
    return rank


@pytest.mark.slow
def test_ckpt_fully_parallel_save_spreads_the_writes(tmp_path):
    from tests.distributed import run_distributed

    run_distributed(_save_replicated, 2, str(tmp_path))

    def data_bytes(variant, rank):
        return sum(p.stat().st_size for p in (tmp_path / variant / "iter_0000001").glob(f"__{rank}_*.distcp"))
    spread, lowest = [data_bytes("True", r) for r in (0, 1)], [data_bytes("False", r) for r in (0, 1)]
    assert min(spread) > sum(spread) / 4  # --ckpt-fully-parallel-save (Megatron's default): both ranks write
    assert lowest[1] < sum(lowest) / 20  # --no-ckpt-fully-parallel-save: rank 0 writes the replicated tensors
    assert parse_args(["--no-ckpt-fully-parallel-save"]).ckpt_fully_parallel_save is False
