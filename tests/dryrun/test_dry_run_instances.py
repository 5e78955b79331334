"""--dry-run with --num-distributed-optimizer-instances: at TP = 2, PP = 2, DP = 2 two instances
of one rank each hold the whole optimizer state (twice the 2-way shard's, bucket padding
aside), measured equal to formulas.md's bytes, and the gradients are all-reduced across the
instances instead of reduce-scattered over DP (megatron/core/distributed/param_and_grad_buffer.py: reduce-scatter
within the instance, here of one rank, then all-reduce of the shard across instances)."""

from tests.dryrun.dry_run_json import reports
from tests.dryrun.test_dry_run import SMALL


def test_two_instances_of_one_rank_hold_the_whole_optimizer_state():
    one = reports(SMALL + ["--dry-run-device", "cpu"])
    two = reports(SMALL + ["--dry-run-device", "cpu", "--num-distributed-optimizer-instances", "2"])
    for a, b in zip(one, two):
        assert b.resident == b.formula and a.resident == a.formula
        assert abs(b.formula["optimizer"] / a.formula["optimizer"] - 2) < 0.01, (a.formula, b.formula)
        assert b.formula["gradients"] == a.formula["gradients"]
        assert b.comm[("dp_cp_replica", "all-reduce")] == b.formula["gradients"]
        assert ("dp", "reduce-scatter") not in b.comm and ("dp", "reduce-scatter") in a.comm
