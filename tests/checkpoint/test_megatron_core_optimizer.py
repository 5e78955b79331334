"""A full resume from Megatron-Core's own training state (tests/checkpoint/megatron_core_training.py:
its GPTModel, DDP, optimizer and scheduler on CPU, 2 steps, saved in each of its formats): megalite
loads the weights, Adam's moments, the fp32 main parameters, the step count and the schedule, and
its next steps' losses equal Megatron-Core's own continuation within 1e-5 (the first continued
loss checks the weights; the later ones the optimizer state and schedule: --no-load-optim moves
them). Read at TP=1 and at megalite TP=1 PP=2 DP=2 with its distributed optimizer.

Megatron's plain optimizer (FP32Optimizer, TP=2 DP=1): `torch` and `torch_dist`. Its distributed
optimizer (TP=2 DP=2): `torch` (distrib_optim.pt), `torch_dist` 'fully_reshardable' and its
default 'dp_reshardable' (per-bucket tensors; read at megalite DP=1 and DP=2). The distributed
optimizer's bucket layout is also checked element for element at PP=2 DP=2 with virtual stages,
tied embeddings and many buckets.
"""

import os

import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint.megatron.optimizer import MegatronOptimizerState
from megalite.checkpoint.megatron.reader import MegatronCheckpoint
from megalite.checkpoint.dcp.format import CheckpointError
from tests.checkpoint.megatron_core_training import (
    CLIP, DECAY, GLOBAL_BATCH, ITERATION, LR, MIN_LR, SEQ, STEPS_AFTER, STEPS_SAVED, VOCAB, WARMUP, WEIGHT_DECAY,
    batches, save_bucket_layout_probe, train_and_save,
)
from tests.distributed import free_port, run_distributed

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # Megatron-Core trains and saves in 1-2 min on 2 shared cores


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory) -> dict:
    """{'plain' | 'distributed': the folder of the run's checkpoints and losses.pt}."""
    runs = {}
    for name, world, distributed, saves in (
            ("plain", 2, False, [("torch", None), ("torch_dist", None)]),
            ("distributed", 4, True, [("torch", None), ("torch_dist", "fully_reshardable"),
                                      ("torch_dist", "dp_reshardable")])):
        out = tmp_path_factory.mktemp(f"megatron_{name}")
        run_distributed(train_and_save, world, str(out), "llama", 2, distributed, saves, timeout=900)
        runs[name] = out
    return runs


def _argv(world: int, load_dir, tp: int, pp: int, *extra) -> list[str]:
    dp = world // (tp * pp)
    return ["--load", str(load_dir), "--auto-detect-ckpt-format", "--use-checkpoint-args",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--make-vocab-size-divisible-by", "8",
            "--mock-data", "--seq-length", str(SEQ), "--micro-batch-size", str(GLOBAL_BATCH // dp),
            "--global-batch-size", str(GLOBAL_BATCH), "--lr", str(LR), "--min-lr", str(MIN_LR),
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(WARMUP), "--lr-decay-iters", str(DECAY),
            "--train-iters", str(DECAY), "--weight-decay", str(WEIGHT_DECAY), "--clip-grad", str(CLIP),
            "--eval-iters", "0", "--num-workers", "0", "--distributed-backend", "gloo",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]


def _micro_batches(tokens: torch.Tensor, pstate, micro_batch_size: int):
    """This DP rank's micro-batches of a global batch, in Megatron's sampler order."""
    for start in range(0, GLOBAL_BATCH, micro_batch_size * pstate.dp_size):
        rows = tokens[start + pstate.dp_rank * micro_batch_size:start + (pstate.dp_rank + 1) * micro_batch_size]
        yield {"tokens": rows[:, :-1], "labels": rows[:, 1:], "loss_mask": torch.ones(len(rows), SEQ),
               "position_ids": torch.arange(SEQ).expand(len(rows), SEQ), "attention_mask": None}


def _continue(rank, world, port, argv_args):
    """build_run --load the checkpoint, then train_step on Megatron's next batches: (losses on
    the last stage, iteration after loading, the scheduler's step count after loading)."""
    from megalite.config.arguments import parse_args
    from megalite.training.loop import Trainer
    from megalite.training.setup_run import build_run

    dist.destroy_process_group()  # build_run joins its own
    os.environ["MASTER_PORT"] = str(port)
    args = parse_args(_argv(world, *argv_args))
    run = build_run(args)
    loaded = (run.iteration, run.scheduler.num_steps)
    trainer = Trainer(run)
    steps, losses = batches(), []
    for i in range(STEPS_SAVED, STEPS_SAVED + STEPS_AFTER):
        losses.append(trainer.train_step(_micro_batches(steps[i], run.pstate, args.micro_batch_size))[0])
    trainer.close()
    dist.barrier()
    return losses if run.pstate.is_last_stage else None, loaded


def _losses(load_dir, world: int, tp: int, pp: int, *extra):
    results = run_distributed(_continue, world, free_port(), (str(load_dir), tp, pp, *extra), timeout=600)
    losses = next(r[0] for r in results if r[0] is not None)
    return torch.tensor(losses, dtype=torch.float64), results[0][1]


CASES = [("plain", "torch"), ("plain", "torch_dist"), ("distributed", "torch"),
         ("distributed", "torch_dist_fully_reshardable"), ("distributed", "torch_dist_dp_reshardable")]


@pytest.mark.parametrize("run,fmt", CASES)
def test_resume_at_tp1_continues_as_megatron_does(megatron_runs, run, fmt):
    reference = torch.load(megatron_runs[run] / "losses.pt", weights_only=True)[STEPS_SAVED:]
    losses, (iteration, scheduler_steps) = _losses(megatron_runs[run] / fmt, 1, 1, 1)
    assert (iteration, scheduler_steps) == (ITERATION, ITERATION * GLOBAL_BATCH)
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("run,fmt", [("plain", "torch_dist"), ("distributed", "torch"),
                                     ("distributed", "torch_dist_dp_reshardable")])
def test_resume_at_pp2_dp2_distributed_optimizer(megatron_runs, run, fmt):
    reference = torch.load(megatron_runs[run] / "losses.pt", weights_only=True)[STEPS_SAVED:]
    losses, _ = _losses(megatron_runs[run] / fmt, 4, 1, 2, "--use-distributed-optimizer")
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-5)


def test_without_the_optimizer_state_the_losses_differ(megatron_runs):
    """The check above could not pass with the optimizer state or schedule ignored."""
    reference = torch.load(megatron_runs["distributed"] / "losses.pt", weights_only=True)[STEPS_SAVED:]
    fresh, (iteration, _) = _losses(megatron_runs["distributed"] / "torch", 1, 1, 1, "--no-load-optim")
    assert iteration == ITERATION
    torch.testing.assert_close(fresh[0], reference[0], rtol=1e-5, atol=1e-5)  # the same weights
    assert (fresh[1:] - reference[1:]).abs().min() > 1e-4


def test_main_parameters_sit_where_the_layout_says(megatron_runs):
    """fp32 training: the distributed optimizer's main values at the rebuilt bucket positions
    are the weights, for every parameter of every rank."""
    checkpoint = MegatronCheckpoint(megatron_runs["distributed"] / "torch")
    state = MegatronOptimizerState(checkpoint)
    assert state.step == ITERATION and state.has_main
    for name in checkpoint.names():
        assert torch.equal(state.get(name, "param"), checkpoint.get(name)), name
        assert state.get(name, "exp_avg_sq").min() >= 0, name


def test_dp_reshardable_state_is_the_distrib_optim_state(megatron_runs):
    """Megatron's default torch_dist layout (per-bucket tensors of each TP rank) holds, for every
    parameter and state, what the same run's distrib_optim.pt holds."""
    out = megatron_runs["distributed"]
    legacy = MegatronOptimizerState(MegatronCheckpoint(out / "torch"))
    checkpoint = MegatronCheckpoint(out / "torch_dist_dp_reshardable")
    state = MegatronOptimizerState(checkpoint)
    assert (state.step, state.has_main, state.hyperparameters) == (ITERATION, True, legacy.hyperparameters)
    for name in checkpoint.names():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state.get(name, key), legacy.get(name, key)), (name, key)


def test_dp_reshardable_at_pp2_is_refused_naming_the_file(megatron_runs, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(megatron_runs["distributed"] / "torch_dist_dp_reshardable", copy)
    common = copy / f"iter_{ITERATION:07d}" / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].pipeline_model_parallel_size = 2
    torch.save(state, common)
    with pytest.raises(CheckpointError, match=r"common\.pt: .*'dp_reshardable' .* PP=1 .*"
                       r"--pipeline-model-parallel-size 2.*--no-load-optim"):
        MegatronOptimizerState(MegatronCheckpoint(copy))


def test_missing_distrib_optim_is_refused_naming_it(megatron_runs, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(megatron_runs["distributed"] / "torch", copy)
    (copy / f"iter_{ITERATION:07d}" / "mp_rank_01" / "distrib_optim.pt").unlink()
    with pytest.raises(CheckpointError, match=r"mp_rank_01/distrib_optim\.pt: missing.*--finetune"):
        MegatronOptimizerState(MegatronCheckpoint(copy))


def _rng_after_load(rank, world, load_dir):
    from megalite.model.pipeline_chunks import build_model_chunks
    from megalite.parallel.state import ParallelLayout, ParallelState
    from megalite.config.arguments import parse_args
    from megalite.checkpoint.run_load import load_for_run
    from megalite.config.run_config import CheckpointConfig

    pstate = ParallelState.create(ParallelLayout(world, tensor=world))
    [model] = build_model_chunks(MegatronCheckpoint(load_dir).config, pstate, init_seed=5)
    torch.manual_seed(99)
    ckpt = CheckpointConfig.from_args(parse_args(["--load", load_dir, "--auto-detect-ckpt-format", "--no-load-optim"]))
    load_for_run(ckpt, [model], pstate, None)
    return torch.get_rng_state()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist_fully_reshardable"])
def test_rng_states_restored_at_the_same_tp_pp(megatron_runs, fmt):
    out = megatron_runs["distributed"]
    for tp_rank, state in enumerate(run_distributed(_rng_after_load, 2, str(out / fmt))):
        assert torch.equal(state, torch.load(out / f"torch_rng_tp{tp_rank}.pt", weights_only=True)), tp_rank


def test_bucket_layout_with_buckets_virtual_stages_and_tied_copies(tmp_path):
    """Megatron-Core's distributed optimizer at PP=2 DP=2 with 2 virtual stages, tied embeddings
    and one bucket per parameter on the first chunk (megatron_core_training.py's probe: every
    element holds exp_avg = 0.1 w, exp_avg_sq = 0.001 w^2): each parameter's three states sit
    where the rebuilt layout says, on both pipeline ranks and both chunks."""
    run_distributed(save_bucket_layout_probe, 4, str(tmp_path), 30, timeout=900)
    checkpoint = MegatronCheckpoint(tmp_path)
    assert checkpoint.files.chunk_keys == ["model0", "model1"] and checkpoint.files.pp == 2
    state = MegatronOptimizerState(checkpoint)
    assert state.step == 1
    for name in checkpoint.names():
        weight = checkpoint.get(name)
        assert torch.equal(state.get(name, "param"), weight), name
        torch.testing.assert_close(state.get(name, "exp_avg"), 0.1 * weight, rtol=1e-5, atol=1e-9, msg=name)
        torch.testing.assert_close(state.get(name, "exp_avg_sq"), 1e-3 * weight * weight, rtol=1e-4, atol=1e-12,
                                   msg=name)


@pytest.fixture(scope="module")
def megatron_bf16_runs(tmp_path_factory) -> dict:
    """bf16 weights with fp32 main parameters (the norms stay fp32 in Megatron-Core's local spec,
    so the plain optimizer's groups and the distributed optimizer's buffers mix both dtypes)."""
    runs = {}
    for name, world, distributed, saves in (("plain", 2, False, [("torch", None)]),
                                            ("distributed", 4, True, [("torch", None),
                                                                      ("torch_dist", "fully_reshardable"),
                                                                      ("torch_dist", "dp_reshardable")])):
        out = tmp_path_factory.mktemp(f"megatron_bf16_{name}")
        run_distributed(train_and_save, world, str(out), "llama", 2, distributed, saves, None, True, timeout=900)
        runs[name] = out
    return runs


def _loaded_optimizer_state(rank, world, port, argv_args):
    from megalite.config.arguments import parse_args
    from megalite.training.setup_run import build_run

    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    run = build_run(parse_args(_argv(world, *argv_args)))
    return run.optimizer.state_dict()


def test_bf16_main_parameters_are_megatrons_fp32_copies(megatron_bf16_runs):
    """The fp32 main values (Float16OptimizerWithFloat16Params' fp32_from_fp16_params, the
    distributed optimizer's fp32 buffers) round to the bf16 weights, agree between the torch and
    torch_dist files (both layouts; dp_reshardable's: a bf16 and an fp32 buffer) of one run, and
    are what megalite's optimizer holds after --load --bf16."""
    for run, formats in (("plain", ["torch"]),
                         ("distributed", ["torch", "torch_dist_fully_reshardable", "torch_dist_dp_reshardable"])):
        states = [MegatronOptimizerState(MegatronCheckpoint(megatron_bf16_runs[run] / f)) for f in formats]
        checkpoint = states[0].checkpoint
        rounded_off = 0
        for name in checkpoint.names():
            main, weight = states[0].get(name, "param"), checkpoint.get(name)
            assert main.dtype == torch.float32 and torch.equal(main.to(weight.dtype), weight), (run, name)
            rounded_off += int(not torch.equal(main, weight.float()))
            for other in states[1:]:
                for key in ("param", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(states[0].get(name, key), other.get(name, key)), (run, name, key)
        assert rounded_off > 0, run  # the fp32 copies hold more than the bf16 weights
    loaded = run_distributed(_loaded_optimizer_state, 1, free_port(),
                             (str(megatron_bf16_runs["distributed"] / "torch"), 1, 1, "--bf16"), timeout=600)[0]
    state = MegatronOptimizerState(MegatronCheckpoint(megatron_bf16_runs["distributed"] / "torch"))
    assert loaded["step"] == ITERATION
    for name, entry in loaded["params"].items():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], state.get(name, key)), (name, key)
