"""A Megatron MoE functional-test style command line through the training driver (two rank
processes on gloo, TP = 2 with sequence parallelism, EP = 2): sinkhorn routing, the flex
dispatcher, Megatron's fusion / schedule / logging switches and selective recompute of
layernorm, mlp, moe_act and shared_experts train, each served flag says so in one start-up
line, and the losses equal those of the same run with the alltoall dispatcher, no recompute and
none of those switches (they change nothing but the schedule and memory)."""

from pathlib import Path

import pytest

from tests.training.launch import BASE, run, train_losses

ITERS = 5
MOE = ["--num-experts", "4", "--moe-router-topk", "1", "--moe-layer-freq", "2", "--moe-ffn-hidden-size", "48",
       "--moe-router-load-balancing-type", "sinkhorn", "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size",
       "32", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
       "--expert-tensor-parallel-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
       "--train-iters", str(ITERS), "--eval-iters", "0", "--eval-interval", "1000"]
SERVED = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep", "--moe-permute-fusion",
          "--moe-router-fusion", "--logging-level", "20", "--enable-experimental", "--use-transformer-engine-op-fuser",
          "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "layernorm", "mlp", "moe_act",
          "shared_experts"]


@pytest.mark.slow
def test_moe_functional_style_flags_train_as_without_them(tmp_path):
    plain = run(BASE + MOE + ["--moe-token-dispatcher-type", "alltoall", "--metrics-file", str(tmp_path / "plain.jsonl")],
                2, tmp_path / "plain")
    served = run(BASE + MOE + SERVED + ["--metrics-file", str(tmp_path / "served.jsonl")], 2, tmp_path / "served")
    want, got = train_losses(tmp_path / "plain.jsonl"), train_losses(tmp_path / "served.jsonl")
    assert sorted(want) == list(range(1, ITERS + 1)) and got.keys() == want.keys()
    for iteration in want:
        assert got[iteration] == pytest.approx(want[iteration], rel=1e-6), iteration
    output = Path(served.logs[0]).read_text() + served.stderr(0)
    for flag in ("--moe-token-dispatcher-type flex", "--moe-permute-fusion:", "--moe-router-fusion:",
                 "--logging-level 20:", "--enable-experimental:", "--use-transformer-engine-op-fuser:"):
        assert flag in output, flag
    assert "--moe-permute-fusion:" not in Path(plain.logs[0]).read_text() + plain.stderr(0)
