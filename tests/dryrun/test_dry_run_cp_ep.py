"""--dry-run with context parallelism (each --cp-comm-type) and with MoE expert parallelism (each
dispatcher): every distinct rank runs on fake tensors with its cp / ep groups; bytes held equal
formulas.md's (every local expert counted), bytes moved equal independent formulas."""

import re
import sys

import pytest

from megalite.dryrun.balanced_routing import balanced_counts
from tests.dryrun.dry_run_json import reports
from tests import program_server
from tests.dryrun.test_fake_cuda import REPO, fake_cuda_env

S, B, H, L, HEAD_DIM, GROUPS = 32, 2, 64, 2, 16, 2
BASE = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 211 --num-layers 2 --hidden-size 64 "
        "--num-attention-heads 4 --group-query-attention --num-query-groups 2 --ffn-hidden-size 96 --swiglu "
        "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
        "--untie-embeddings-and-output-weights --seq-length 32 --micro-batch-size 2 --lr 3e-3 --train-iters 1 "
        "--bf16 --use-distributed-optimizer --attention-dropout 0 --dry-run --dry-run-device cpu").split()
E, K, F_MOE = 4, 2, 32
MOE = f"--num-experts {E} --moe-router-topk {K} --moe-ffn-hidden-size {F_MOE}".split()


def _cp(comm_type, cp=2, pp=2, global_batch=8):
    world = cp * pp * 2
    return reports(BASE + f"--context-parallel-size {cp} --cp-comm-type {comm_type} --pipeline-model-parallel-size "
                          f"{pp} --dry-run-world-size {world} --global-batch-size {global_batch}".split())


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_context_parallel_dry_run(comm_type):
    got = _cp(comm_type)
    assert [r.coords for r in got] == [(0, 0, 0, 0), (0, 0, 1, 0)]
    micro_batches = 8 // (B * 2)
    for r in got:
        assert r.resident == r.formula and r.resident["parameters"] > 0
        # the pipeline carries this CP rank's half of the sequence: [s/cp, b, h] bf16 per micro-batch
        assert r.comm[("pp", "send")] == micro_batches * (S // 2) * B * H * 2
        # gradients are reduce-scattered, and parameters all-gathered, over DP x CP (d = 4)
        assert r.comm[("dp_cp", "reduce-scatter")] == r.formula["gradients"]
        assert r.comm[("dp_cp", "all-gather")] == r.formula["parameters"] // 4
        assert ("dp", "reduce-scatter") not in r.comm
        attention = {"p2p": "send", "all_gather": "all-gather", "a2a": "all-to-all"}[comm_type]
        assert r.comm[("cp", attention)] > 0
        if comm_type == "all_gather":
            # K and V of this rank ([b, groups, s/cp, d] bf16 each), per layer, forward and backward
            local_kv = 2 * B * GROUPS * (S // 2) * HEAD_DIM * 2
            assert r.comm[("cp", "all-gather")] == 2 * micro_batches * (L // 2) * local_kv
            assert r.checks["cp all-gather K,V"] == (r.comm[("cp", "all-gather")],) * 2
            # backward sends every rank's fp32 K,V gradients home
            assert r.comm[("cp", "reduce-scatter")] == micro_batches * (L // 2) * 2 * local_kv * 2
        if comm_type == "a2a":
            # q (4 heads), k, v (2 groups: split over CP as they are) there, the output back, and
            # the same in backward: [s/cp, b, heads, d] bf16 each
            per_layer = (4 + 2 + 2 + 4) * (S // 2) * B * HEAD_DIM * 2
            assert r.comm[("cp", "all-to-all")] == 2 * micro_batches * (L // 2) * per_layer


@pytest.mark.slow
def test_context_parallel_four_ranks_and_activation_memory():
    cp1 = reports(BASE + "--pipeline-model-parallel-size 1 --dry-run-world-size 2 --global-batch-size 4".split())
    for comm_type in ("p2p", "all_gather"):
        cp4 = _cp(comm_type, cp=4, pp=1, global_batch=4)
        assert all(r.resident == r.formula for r in cp4)
        assert cp4[0].resident["parameters"] == cp1[0].resident["parameters"]  # CP does not shard weights
        assert cp4[0].peak["activations"] < cp1[0].peak["activations"] / 2


def _moe(dispatcher, ep, extra=""):
    return reports(BASE + MOE + f"--moe-token-dispatcher-type {dispatcher} --expert-model-parallel-size {ep} "
                               f"--dry-run-world-size 4 --global-batch-size 8 {extra}".split())


def _expert_params(local_experts: int) -> int:
    return L * local_experts * (H * 2 * F_MOE + F_MOE * H)  # SwiGLU fc1 [2f, h], fc2 [h, f]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_expert_parallel_dry_run(dispatcher):
    ep1, = _moe(dispatcher, 1)
    ep2, = _moe(dispatcher, 2)
    # every local expert's parameters held: EP=2 holds half of EP=1's experts, the rest alike
    assert ep1.num_params - ep2.num_params == _expert_params(E) - _expert_params(E // 2)
    for r in (ep1, ep2):
        assert r.resident == r.formula
    # expert gradients reduce-scatter over the expert-data-parallel group (DP 4 / EP 2)
    assert ep2.comm[("edp", "reduce-scatter")] == 4 * _expert_params(E // 2)  # fp32 gradients
    assert ("ep", "all-to-all") not in ep1.comm and ("ep", "all-gather") not in ep1.comm
    tokens = S * B
    if dispatcher == "alltoall":
        # bench_moe.py's formula: 4 * m * L * T * k * (EP-1)/EP * h * 2 bytes, with balanced routing
        formula = 4 * 1 * L * tokens * K * (2 - 1) // 2 * H * 2
        assert ep2.checks["ep all-to-all tokens to other ranks"] == (formula, formula)
        # the c10d payload: every routed row (own rank's included) plus the count exchange
        assert ep2.comm[("ep", "all-to-all")] == 4 * L * tokens * K * H * 2 + L * E * 8
    else:
        # per layer: tokens forward and their gradient back in backward, the probabilities (bf16:
        # no --moe-router-dtype), the uint8 routing map and the row count
        per_layer = 2 * tokens * H * 2 + tokens * E * 2 + tokens * E + 8
        assert ep2.comm[("ep", "all-gather")] == L * per_layer


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("grid", ["tp2-sp-etp1-ep2", "cp2-ep2"])
def test_expert_grid_dry_run(grid, dispatcher):
    """ETP = 1 under TP = 2 (each TP rank holds 2 whole experts, routes its own half of the
    tokens), and EP carved from CP: every expert counted at its full size, gradients
    reduce-scattered over EDP = 2, the all-to-all as the formula says for this rank's tokens."""
    extra = {"tp2-sp-etp1-ep2": "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1",
             "cp2-ep2": "--context-parallel-size 2"}[grid]
    r, = _moe(dispatcher, 2, extra)
    assert r.resident == r.formula
    assert r.comm[("edp", "reduce-scatter")] == 4 * _expert_params(E // 2)  # fp32 gradients, EDP = 2
    tokens, micro_batches = S * B // 2, 8 // (B * 2)  # this rank's share: its TP or CP half; DP = 2
    if dispatcher == "alltoall":
        formula = 4 * micro_batches * L * tokens * K * (2 - 1) // 2 * H * 2
        assert r.checks["ep all-to-all tokens to other ranks"] == (formula, formula)
    else:
        assert r.comm[("ep", "all-gather")] == micro_batches * L * (2 * tokens * H * 2 + tokens * E * 2 + tokens * E + 8)


def test_balanced_counts():
    assert balanced_counts(128, 4) == [32] * 4
    assert balanced_counts(10, 4) == [3, 3, 2, 2]


@pytest.mark.parametrize("extra", [
    MOE + "--moe-token-dispatcher-type alltoall --expert-model-parallel-size 2 --moe-grouped-gemm "
          "--dry-run-world-size 4 --global-batch-size 8".split(),
    "--context-parallel-size 2 --cp-comm-type all_gather --tensor-model-parallel-size 2 --sequence-parallel "
    "--dry-run-world-size 8 --global-batch-size 4".split()], ids=["ep", "cp"])
def test_cp_and_ep_dry_runs_on_fake_cuda(extra):
    base = [a for a in BASE if a not in ("--dry-run-device", "cpu")]
    out = program_server.run([sys.executable, "-m", "megalite.pretrain_gpt", *base, *extra], env=fake_cuda_env(),
                             capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "device cuda (fake)" in out.stdout
    held = re.findall(r"^\s+0\s+\(0, 0, 0, 0\)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+formula\s+([\d,]+)\s+([\d,]+)\s+"
                      r"([\d,]+)", out.stdout, re.M)
    assert len(held) == 1 and held[0][:3] == held[0][3:], out.stdout
    check = re.search(r"^\s+0\s+(ep all-to-all tokens to other ranks|cp all-gather K,V): ([\d,]+) bytes, "
                      r"formula ([\d,]+)$", out.stdout, re.M)
    assert check and check.group(2) == check.group(3) and check.group(2) != "0", out.stdout
    if "--num-experts" in extra:
        assert "balanced routing assumed" in out.stdout


def test_default_world_size_holds_cp_and_ep():
    from megalite.dryrun.cli import default_world_size
    from megalite.config.arguments import parse_args

    base = [a for a in BASE if a != "--dry-run-device" and a != "cpu"]
    args = parse_args(base + "--context-parallel-size 2 --tensor-model-parallel-size 2 --global-batch-size 2".split())
    assert default_world_size(args) == 4
    args = parse_args(base + MOE + "--expert-model-parallel-size 4 --pipeline-model-parallel-size 2 "
                                   "--global-batch-size 8".split())
    assert default_world_size(args) == 8
    # the ETP x EP = 4 blocks tile TP 2 x CP 2 with DP 1, and TP 2 x DP 2
    args = parse_args(base + MOE + "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1 "
                                   "--tensor-model-parallel-size 2 --context-parallel-size 2 --global-batch-size 8".split())
    assert default_world_size(args) == 4
    args = parse_args(base + MOE + "--expert-model-parallel-size 2 --tensor-model-parallel-size 2 "
                                   "--global-batch-size 8".split())
    assert default_world_size(args) == 4
