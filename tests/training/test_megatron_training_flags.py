"""Megatron's training-loop flags, each checked where it acts (in-process unless it needs ranks):
batch-size ramp-up and step schedule, per-token loss, decoupled LR, pipeline-split accounting,
deterministic mode, manual GC, empty-cache levels, bf16 gradient reduction, the DP weight-hash
check, and the flags megalite serves another way (one start-up line each)."""

import gc
from types import SimpleNamespace

import pytest
import torch

from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads
from megalite.parallel.pipeline.executor import PipelineExecutor
from megalite.parallel.pipeline.stage_layout import layers_per_virtual_stage
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.config.arguments import model_config_from_args, parse_args, validate_args
from megalite.config.megatron.training import interleaved_group_size
from megalite.config.schedules import BatchSchedule, batch_schedule_from_args
from megalite.config.schedules import schedule_lengths_from_args
from megalite.training.lr_schedule import LRScheduler
from megalite.training.metrics import read_metrics
from megalite.training.per_token_loss import PerTokenLoss, apply_decoupled_lr, scale_main_grads, token_factor
from megalite.training.run_hooks import RunHooks, apply_deterministic_mode, check_weight_hash
from megalite.config.run_config import ParallelConfig, startup_notes
from megalite.training.setup_run import wrap_chunks
from tests.distributed import run_distributed
from tests.training.launch import BASE as LAUNCH_BASE
from tests.training.launch import drop_flags, run
from tests.config.test_arguments import BASE, parsed, refused

SAMPLES = drop_flags(BASE, "--train-iters") + ["--train-samples", "40"]


def validated(extra: list[str], world_size: int = 1, base=SAMPLES):
    return validate_args(parse_args(base + extra), world_size)


# --- batch size schedules -----------------------------------------------------------------------

def test_rampup_batch_size_per_iteration():
    """Megatron's ramp-up from 2 by 2 over 16 samples to 8: (8 - 2) / 2 = 3 increments of 16/3
    samples each; the batch grows when the consumed samples pass 16/3 and 32/3, reaches 8 after
    16 samples, and --train-samples 40 takes 6 ramp-up iterations + (40 - 20) // 8 = 8 in all."""
    args = validated(["--rampup-batch-size", "2", "2", "16", "--global-batch-size", "8"])
    schedule = BatchSchedule(8, rampup=(2, 2, 16))
    consumed, sizes = 0, []
    for _ in range(args.total_train_iters):
        sizes.append(schedule.at(consumed))
        consumed += sizes[-1]
    assert sizes == [2, 2, 2, 4, 4, 6, 8, 8] and args.total_train_iters == 8
    assert args.global_batch_size == 8 and args.num_micro_batches == 4


def test_step_batch_size_schedule_thresholds_in_tokens():
    """'0:2 320:4' at --seq-length 32: batch 2 until 320 tokens = 10 samples, then 4; 40 samples
    take 5 + ceil(30 / 4) = 13 iterations; the last batch size is the global batch size."""
    args = validated(["--step-batch-size-schedule", "0:2 320:4"])
    assert (args.global_batch_size, args.total_train_iters) == (4, 13)
    assert BatchSchedule(4, steps=[(0, 2), (10, 4)]).sizes(40) == [2, 4]
    assert validate_args(args, 1).total_train_iters == 13  # validating twice changes nothing


def test_step_batch_size_schedule_with_train_iters():
    """With --train-iters the schedule sets each iteration's batch (2 until 10 samples, then 4:
    10 iterations take 5 x 2 + 5 x 4 = 30 samples, which the data must hold), and the lr schedule
    counts Megatron's global batch size, --micro-batch-size x DP = 2, per iteration: decay over
    10 x 2 samples, warmup 3 x 2."""
    args = validated(["--step-batch-size-schedule", "0:2 320:4", "--lr-warmup-iters", "3"], base=BASE)
    schedule = batch_schedule_from_args(args)
    assert (args.total_train_iters, args.global_batch_size) == (10, 4)
    assert schedule.sizes(None, 10) == [2, 4] and schedule.samples(10) == 30
    assert schedule_lengths_from_args(args) == {"warmup_steps": 6, "decay_steps": 20, "wsd_decay_steps": None}
    constant = validated(["--global-batch-size", "4", "--lr-warmup-iters", "3"], base=BASE)
    assert schedule_lengths_from_args(constant)["decay_steps"] == 40


def test_step_batch_size_schedule_drives_an_iteration_based_run(tmp_path):
    """The metrics of a --train-iters run: batch 2 until 160 tokens (5 samples at --seq-length
    32) are consumed, i.e. for 3 iterations, then 4."""
    argv = drop_flags(LAUNCH_BASE, "--global-batch-size", "--lr-warmup-iters", "--micro-batch-size") + [
        "--step-batch-size-schedule", "0:2 160:4", "--train-iters", "4", "--eval-iters", "0",
        "--micro-batch-size", "1", "--metrics-file", str(tmp_path / "metrics.jsonl")]
    ranks = run(argv, 1, tmp_path / "logs")
    records = read_metrics(str(tmp_path / "metrics.jsonl"))[0]
    assert [records[i]["global_batch_size"] for i in (1, 2, 3, 4)] == [2, 2, 2, 4], ranks.output()
    assert records[4]["consumed_samples"] == 10


@pytest.mark.parametrize("extra, words", [
    (["--rampup-batch-size", "2", "2", "16", "--global-batch-size", "8", "--train-iters", "4"],
     ["--rampup-batch-size", "--train-samples"]),
    (["--rampup-batch-size", "3", "2", "16", "--global-batch-size", "8"], ["--rampup-batch-size", "multiple"]),
    (["--rampup-batch-size", "1", "1", "16", "--global-batch-size", "8"], ["--rampup-batch-size", "batch size 1"]),
    (["--step-batch-size-schedule", "0:2 320:4", "--global-batch-size", "4"],
     ["--step-batch-size-schedule", "--global-batch-size"]),
    (["--step-batch-size-schedule", "64:2"], ["--step-batch-size-schedule", "first threshold"]),
    (["--eval-global-batch-size", "3"], ["--eval-global-batch-size", "3"]),
])
def test_batch_schedule_refusals(extra, words):
    base = SAMPLES if "--train-iters" not in extra else drop_flags(BASE, "--train-iters")
    with pytest.raises(ValueError) as info:
        validated(extra, base=base)
    assert "\n" not in str(info.value) and all(w in str(info.value) for w in words), info.value


# --- per-token loss -------------------------------------------------------------------------------

def _tiny_config(**overrides) -> GPTConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=16,
                  attention_dropout=0.0, hidden_dropout=0.0, untie_embeddings_and_output_weights=True)
    return GPTConfig(**{**values, **overrides})


def _micro_batches(masks):
    generator = torch.Generator().manual_seed(3)
    out = []
    for mask in masks:
        tokens = torch.randint(0, 64, (2, 16), generator=generator)
        out.append({"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": mask,
                    "position_ids": torch.arange(16).expand(2, 16)})
    return out


def test_calculate_per_token_loss_reduction():
    """Two micro-batches holding 32 and 4 loss tokens: the per-token loss (and its gradient) is
    the mean over all 36 tokens, not the mean of the two micro-batch means."""
    state = ParallelState.create(ParallelLayout(1))
    masks = [torch.ones(2, 16), torch.zeros(2, 16)]
    masks[1][0, :4] = 1
    batches = _micro_batches(masks)
    reference = GPTModel(_tiny_config(), state)
    torch.manual_seed(0)
    reference.load_state_dict(build_model_chunks(_tiny_config(), state, init_seed=5)[0].state_dict())
    sums = [(reference(tokens=b["tokens"], labels=b["labels"], position_ids=b["position_ids"]) * b["loss_mask"]).sum()
            for b in batches]
    per_token = sum(sums) / 36
    per_token.backward()
    mean_of_means = (sums[0] / 32 + sums[1] / 4) / 2
    assert abs(per_token.item() - mean_of_means.item()) > 1e-3  # the two reductions differ here

    chunk = DistributedDataParallel(build_model_chunks(_tiny_config(), state, init_seed=5)[0], state)
    counter = PerTokenLoss()
    executor = PipelineExecutor([chunk], state, "none", num_microbatches=2, seq_length=16, micro_batch_size=2,
                                hidden_size=32, forward_step=counter)
    loss = executor.run(iter(batches))
    factor = token_factor(counter, state, 2, torch.device("cpu"))
    finalize_model_grads([chunk], state)
    scale_main_grads([chunk], factor)
    assert counter.tokens == 36 and factor == pytest.approx(2 / 36)
    assert (loss * factor).item() == pytest.approx(per_token.item(), rel=1e-6)
    for name, param in reference.named_parameters():
        got = chunk.module.get_parameter(name).main_grad
        torch.testing.assert_close(got, param.grad, rtol=1e-5, atol=1e-7, msg=name)


# --- decoupled learning rate ----------------------------------------------------------------------

def _sgd_step(decoupled_lr: float | None):
    """One plain SGD step (no momentum, decay or clipping) from the same weights and gradients:
    parameters before, after, and the optimizer's groups' learning rates."""
    state = ParallelState.create(ParallelLayout(1))
    chunk = DistributedDataParallel(build_model_chunks(_tiny_config(), state, init_seed=5)[0], state)
    optimizer = build_optimizer([chunk], state, optimizer="sgd", lr=0.1, sgd_momentum=0.0, weight_decay=0.0,
                                clip_grad=0.0)
    if decoupled_lr is not None:
        apply_decoupled_lr(optimizer, decoupled_lr, None)
    LRScheduler(optimizer, max_lr=0.1, decay_steps=100, decay_style="constant")
    before = {n: p.detach().clone() for n, p in chunk.module.named_parameters()}
    executor = PipelineExecutor([chunk], state, "none", num_microbatches=1, seq_length=16, micro_batch_size=2,
                                hidden_size=32, forward_step=gpt_forward_step)
    executor.run(iter(_micro_batches([torch.ones(2, 16)])))
    finalize_model_grads([chunk], state)
    optimizer.step()
    return before, dict(chunk.module.named_parameters())


def test_decoupled_lr_changes_embedding_and_output_updates_only():
    before, plain = _sgd_step(None)
    _, decoupled = _sgd_step(0.5)
    for name in before:
        step_plain = plain[name].detach() - before[name]
        step_decoupled = decoupled[name].detach() - before[name]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert step_plain.abs().max() > 0
            torch.testing.assert_close(step_decoupled, step_plain * 5, rtol=1e-4, atol=1e-7, msg=name)
        else:
            torch.testing.assert_close(step_decoupled, step_plain, rtol=0, atol=0, msg=name)


def test_decoupled_lr_follows_the_schedule_with_its_own_peak_and_minimum():
    state = ParallelState.create(ParallelLayout(1))
    chunk = DistributedDataParallel(build_model_chunks(_tiny_config(), state, init_seed=5)[0], state)
    optimizer = build_optimizer([chunk], state, lr=1e-3)
    assert apply_decoupled_lr(optimizer, 4e-3, 4e-4) == 2
    scheduler = LRScheduler(optimizer, max_lr=1e-3, min_lr=1e-4, decay_steps=100, warmup_steps=10,
                            decay_style="cosine")
    scheduler.step(55)  # half-way through the cosine decay
    rates = sorted({g["lr"] for g in optimizer.param_groups})
    assert rates == pytest.approx([1e-4 + 0.5 * (1e-3 - 1e-4), 4e-4 + 0.5 * (4e-3 - 4e-4)])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5.5e-4)  # the logged rate stays --lr's
    with pytest.raises(ValueError, match="--decoupled-min-lr needs --decoupled-lr"):
        parsed("--decoupled-min-lr 1e-4", 1)


# --- pipeline split, parallel notes ---------------------------------------------------------------

def test_account_for_embedding_and_loss_in_pipeline_split():
    """(6 layers + embedding + loss) / 4 stages = 2 each: the first and last stage build one
    transformer layer, the middle ones two."""
    args = parsed("--num-layers 6 --pipeline-model-parallel-size 4 --account-for-embedding-in-pipeline-split "
                  "--account-for-loss-in-pipeline-split", 4)
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (1, 1)
    assert layers_per_virtual_stage(6, 4, 1, 1, 1) == [1, 2, 2, 1]
    args = parsed("--num-layers 5 --pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split", 2)
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (2, None)
    assert "not divisible" in refused("--num-layers 4 --pipeline-model-parallel-size 2 "
                                      "--account-for-embedding-in-pipeline-split", 2)


def test_sequence_parallel_at_tp1_runs_without_it_and_says_so():
    args = parsed("--sequence-parallel", 1)
    assert model_config_from_args(args, 100).sequence_parallel is False
    assert [n for n in startup_notes(args) if n.startswith("--sequence-parallel")] == [
        "--sequence-parallel: no effect at --tensor-model-parallel-size 1 (nothing to split the sequence over); "
        "running without it, as Megatron does"]
    args = parsed("--sequence-parallel --tensor-model-parallel-size 2", 2)
    assert model_config_from_args(args, 100).sequence_parallel is True
    assert not [n for n in startup_notes(args) if n.startswith("--sequence-parallel")]


@pytest.mark.parametrize("extra, flag", [
    ("--ddp-average-in-collective", "--ddp-average-in-collective"),
    ("--overlap-p2p-communication", "--overlap-p2p-communication"),
    ("--no-overlap-p2p-communication", "--overlap-p2p-communication"),
    ("--overlap-p2p-communication-warmup-flush", "--overlap-p2p-communication"),
    ("--use-pytorch-profiler", "--use-pytorch-profiler"),
    ("--empty-unused-memory-level 2 --distributed-backend gloo", "--empty-unused-memory-level 2"),
])
def test_served_another_way_prints_one_line(extra, flag):
    notes = [n for n in startup_notes(parsed(extra, 1)) if n.startswith(flag)]
    assert len(notes) == 1 and "\n" not in notes[0]
    assert not [n for n in startup_notes(parsed("", 1)) if n.startswith(flag)]


def test_microbatch_group_size_reaches_the_interleaved_schedule():
    """Any group from the pipeline size to the micro-batches per step, as in Megatron (the
    schedule it gives: tests/parallel/pipeline); without virtual stages it has no effect and
    says so; groups Megatron refuses are refused."""
    interleaved = "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
    args = parsed(interleaved + "--microbatch-group-size-per-virtual-pipeline-stage 3 --global-batch-size 10", 2)
    assert interleaved_group_size(args) == 3 and args.num_micro_batches == 5
    assert not any(n.startswith("--microbatch-group-size") for n in startup_notes(args))
    plain = parsed("--pipeline-model-parallel-size 2 --microbatch-group-size-per-virtual-pipeline-stage 4", 2)
    assert interleaved_group_size(plain) is None
    assert any(n.startswith("--microbatch-group-size-per-virtual-pipeline-stage 4: no effect")
               for n in startup_notes(plain))
    message = refused(interleaved + "--microbatch-group-size-per-virtual-pipeline-stage 3 --global-batch-size 8", 2)
    assert "--microbatch-group-size-per-virtual-pipeline-stage 3: the last group would hold 1" in message
    message = refused(interleaved + "--microbatch-group-size-per-virtual-pipeline-stage 1 --global-batch-size 8", 2)
    assert "--microbatch-group-size-per-virtual-pipeline-stage 1 must lie between" in message


# --- deterministic mode, GC, memory, gradients in bf16 --------------------------------------------

def test_deterministic_mode_sets_torch_and_the_environment():
    environ = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    benchmark = torch.backends.cudnn.benchmark
    try:
        apply_deterministic_mode(environ)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = benchmark
    assert environ == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    with pytest.raises(ValueError, match="--deterministic-mode: NCCL_ALGO='Tree' is not deterministic"):
        apply_deterministic_mode({"NCCL_ALGO": "Tree"})
    assert not torch.are_deterministic_algorithms_enabled()


def _hooks(**overrides):
    values = dict(manual_gc=False, manual_gc_interval=0, manual_gc_eval=True, empty_unused_memory_level=0,
                  profile=False, profile_ranks=None, profile_step_start=10, profile_step_end=12,
                  check_weight_hash_across_dp_replicas_interval=None, progress_dir=None, profile_dir=None,
                  seq_length=16)
    state = SimpleNamespace(rank=0, world_size=1, dp_size=1)
    return SimpleNamespace(**{**values, **overrides}), state  # the run's TrainingConfig and LoggingConfig in one


def test_manual_gc_collects_only_at_its_interval_and_evaluation(monkeypatch):
    args, state = _hooks(manual_gc=True, manual_gc_interval=3)
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or 0)
    try:
        hooks = RunHooks(args, args, state, torch.device("cpu"))
        assert not gc.isenabled() and len(calls) == 1
        for iteration in range(1, 7):
            hooks.after_iteration(iteration, [], 2)
        assert len(calls) == 3  # iterations 3 and 6
        hooks.around_evaluation()
        assert len(calls) == 4
    finally:
        hooks.close()
    assert gc.isenabled()


def test_empty_unused_memory_level(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    for level, expected in ((0, 0), (1, 1), (2, 2)):
        emptied.clear()
        options, state = _hooks(empty_unused_memory_level=level)
        hooks = RunHooks(options, options, state, torch.device("cuda", 0))
        hooks.after_iteration(1, [], 2)
        hooks.around_evaluation()
        assert len(emptied) == expected, level


def test_grad_reduce_in_bf16_keeps_the_gradient_buffers_in_bf16():
    state = ParallelState.create(ParallelLayout(1))
    args = parsed("--bf16 --grad-reduce-in-bf16", 1)
    models = build_model_chunks(_tiny_config(params_dtype="bfloat16"), state, init_seed=5)
    assert {b.grad_dtype for c in wrap_chunks(models, ParallelConfig.from_args(args, 1), state) for b in c.buffers_} == {torch.bfloat16}
    args = parsed("--bf16", 1)
    assert {b.grad_dtype for c in wrap_chunks(models, ParallelConfig.from_args(args, 1), state) for b in c.buffers_} == {torch.float32}
    assert "--grad-reduce-in-bf16 needs --bf16" in refused("--grad-reduce-in-bf16", 1)


# --- weight hash across data-parallel replicas ----------------------------------------------------

def _weight_hash_worker(rank, world_size):
    state = ParallelState.create(ParallelLayout(world_size))
    model = build_model_chunks(_tiny_config(), state, init_seed=5)[0]
    check_weight_hash([model], state, 4)  # identical replicas pass
    if rank == 1:
        with torch.no_grad():
            model.output_layer.weight[0, 0] += 1e-6
    try:
        check_weight_hash([model], state, 8)
    except RuntimeError as error:
        return str(error)
    return ""


def test_check_weight_hash_across_dp_replicas_names_the_differing_rank():
    messages = run_distributed(_weight_hash_worker, 2)
    assert all("at iteration 8 the weights of data-parallel rank(s) [1] differ" in m for m in messages), messages
