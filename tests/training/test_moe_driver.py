"""Mixture of experts through the training driver (four rank processes on gloo): an 8-iteration
run at DP = 4 with EP = 2 (alltoall, distributed optimizer, MoE on every other layer, the
auxiliary and z-losses logged per layer) saves at iteration 4; resuming that checkpoint at
EP = 4 with the allgather dispatcher, at TP = 2 with EP = 2, at TP = 2 with ETP = 1 and EP = 4,
and at CP = 2 with EP = 2 and ETP = 2 gives the same losses as the uninterrupted run (1e-5
relative: only the order of floating-point sums differs); so do the whole run under FSDP2 and
with --calculate-per-token-loss."""

import shutil

import pytest

from megalite.training.metrics import read_metrics
from tests.training.launch import BASE, run, train_losses

ITERS = 8
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--moe-ffn-hidden-size", "48",
       "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--use-distributed-optimizer",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(ITERS),
       "--eval-iters", "0", "--eval-interval", "1000"]


def _copy_iteration(src, dst, iteration):
    (dst / "ckpt").mkdir(parents=True)
    name = f"iter_{iteration:07d}"
    shutil.copytree(src / "ckpt" / name, dst / "ckpt" / name)
    (dst / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(iteration))


@pytest.mark.slow
def test_moe_driver_resume_at_another_ep_size(tmp_path):
    original = tmp_path / "original"
    run(BASE + MOE + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                      "--save", str(original / "ckpt"), "--save-interval", "4",
                      "--metrics-file", str(original / "metrics.jsonl")], 4, original / "logs")
    a = train_losses(original / "metrics.jsonl")
    assert sorted(a) == list(range(1, ITERS + 1))
    records = list(read_metrics(original / "metrics.jsonl")[0].values())
    assert all(0.5 < r["load_balancing_loss"] < 4 and r["z_loss"] > 0 for r in records)
    assert {"load_balancing_loss/layer_0", "load_balancing_loss/layer_2"} <= set(records[0])
    assert "load_balancing_loss/layer_1" not in records[0]
    for name, extra in (("ep4", ["--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "allgather"]),
                        ("tp2-ep2", ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                     "--sequence-parallel"]),
                        ("tp2-etp1-ep4", ["--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
                                          "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                        ("cp2-ep2-etp2", ["--context-parallel-size", "2", "--expert-model-parallel-size", "2",
                                          "--expert-tensor-parallel-size", "2"])):
        resumed = tmp_path / name
        _copy_iteration(original, resumed, 4)
        run(BASE + MOE + extra + ["--load", str(resumed / "ckpt"), "--metrics-file",
                                  str(resumed / "metrics.jsonl")], 4, resumed / "logs")
        b = train_losses(resumed / "metrics.jsonl")
        assert sorted(b) == list(range(5, ITERS + 1))
        for it in b:
            assert abs(b[it] - a[it]) <= 1e-5 * abs(a[it]), f"{name} iteration {it}: {b[it]} vs {a[it]}"
    # the whole run again under FSDP2 (experts sharded over EDP = 2) and with
    # --calculate-per-token-loss (every mock token counts in the loss, so per-token weighting of the
    # auxiliary losses is the default mode's): the same losses
    dist_opt = [a for a in MOE if a != "--use-distributed-optimizer"]
    for name, extra in (("fsdp2", ["--use-torch-fsdp2"]), ("per-token", ["--calculate-per-token-loss",
                                                                         "--use-distributed-optimizer"])):
        again = tmp_path / name
        run(BASE + dist_opt + extra + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                                       "--metrics-file", str(again / "metrics.jsonl")], 4, again / "logs")
        b = train_losses(again / "metrics.jsonl")
        assert sorted(b) == list(range(1, ITERS + 1))
        for it in b:
            assert abs(b[it] - a[it]) <= 1e-5 * abs(a[it]), f"{name} iteration {it}: {b[it]} vs {a[it]}"
