"""The distributed-optimizer, Megatron-FSDP and TP-overlap flags through `python -m
megalite.pretrain_gpt` (4 gloo ranks, fp32, dropout off): each run's losses equal the same run
without the flag within 1e-5 relative, and a run saved with 2 distributed-optimizer instances
resumes with 1 as the uninterrupted run goes on. The per-flag behaviour is tested against its
unsharded twin in tests/parallel and tests/optimizer; this checks that setup_run wires each
flag to it. Slow: every run is a full launch."""

import pytest

from tests.training.launch import BASE, run, train_losses

pytestmark = pytest.mark.slow
ITERS = ["--train-iters", "4", "--attention-dropout", "0", "--hidden-dropout", "0"]
TOL = 1e-5


def _losses(tmp_path, name, extra, world=4) -> dict:
    metrics = tmp_path / f"{name}.jsonl"
    run(BASE + ITERS + ["--metrics-file", str(metrics)] + extra, world, tmp_path / name)
    losses = train_losses(metrics)
    assert sorted(losses) == [1, 2, 3, 4], losses
    return losses


def _close(a: dict, b: dict) -> bool:
    return all(abs(a[i] - b[i]) <= TOL * abs(b[i]) for i in b)


def test_instances_and_tp_comm_overlap_train_as_the_plain_run_and_resume_at_another_count(tmp_path):
    tp_dp = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"]
    plain = _losses(tmp_path, "plain", tp_dp)
    ours = _losses(tmp_path, "ours", tp_dp + ["--num-distributed-optimizer-instances", "2", "--tp-comm-overlap",
                                              "--save", str(tmp_path / "ckpt"), "--save-interval", "2"])
    assert _close(ours, plain), (ours, plain)
    resumed_metrics = tmp_path / "resumed.jsonl"
    run(BASE + ITERS + ["--metrics-file", str(resumed_metrics), "--load", str(tmp_path / "ckpt"), "--ckpt-step", "2"] + tp_dp, 4,
        tmp_path / "resumed")
    resumed = train_losses(resumed_metrics)
    assert sorted(resumed) == [3, 4] and _close(resumed, {i: plain[i] for i in (3, 4)}), (resumed, plain)


def test_param_gather_with_step_and_deferred_wgrad_train_as_the_plain_run(tmp_path):
    pp = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
          "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    plain = _losses(tmp_path, "plain", pp)
    ours = _losses(tmp_path, "ours", pp + ["--overlap-param-gather-with-optimizer-step",
                                           "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "1"])
    assert _close(ours, plain), (ours, plain)


def test_megatron_fsdp_trains_as_torch_fsdp2(tmp_path):
    fsdp2 = _losses(tmp_path, "fsdp2", ["--use-torch-fsdp2", "--calculate-per-token-loss"])
    megatron = _losses(tmp_path, "megatron", ["--use-megatron-fsdp", "--calculate-per-token-loss",
                                              "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
                                              "--save", str(tmp_path / "ckpt"), "--save-interval", "4"])
    assert _close(megatron, fsdp2), (megatron, fsdp2)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()
