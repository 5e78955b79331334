"""The expert grid beyond ETP = TP, CP = 1, against the single-process EP = 1 run (fp32, gloo,
dropping off), each token dispatcher: expert tensor parallelism independent of TP (TP = 2 with
ETP = 1 and EP = 2 or 4, with and without sequence parallelism and with the distributed
optimizer; ETP = 2 over data-parallel ranks at TP = 1), and MoE with context parallelism (EP
carved from DP x CP; CP = 2 with EP = 2, and CP = 2 x TP = 2 with ETP = 1, EP = 4), both routers
(the softmax one with the micro-batch auxiliary and z-losses, the sigmoid one with the
sequence auxiliary loss and expert bias, whose token counts span the CP-split sequences). The
tiny MoE GPT of ep_harness trains 2 Adam steps: per-step losses, the first step's gradients,
the final parameters and expert biases, and eval logits equal the reference within 1e-5
relative. The expert groups equal those megatron-core's RankGenerator carves (slow: importing
megatron.core takes ~15 s)."""

import pytest

from megalite.parallel.expert.groups import ExpertLayout
from megalite.parallel.state import ParallelLayout
from tests.distributed import run_distributed
from tests.parallel.expert.ep_harness import check_run, train_runs

LAYOUTS = {
    "tp2-sp-etp1-ep2": dict(tp=2, ep=2, etp=1, sp=True),
    "tp2-etp1-ep4-distopt": dict(tp=2, ep=4, etp=1, dist_opt=True),
    "tp1-etp2-ep2": dict(ep=2, etp=2),
    "cp2-ep2": dict(cp=2, ep=2),
    "cp2-tp2-sp-etp1-ep4-distopt": dict(tp=2, cp=2, ep=4, etp=1, sp=True, dist_opt=True),
}
RUNS = [(layout, "alltoall", "softmax") for layout in LAYOUTS] + \
       [(layout, "allgather", "sigmoid") for layout in LAYOUTS] + \
       [("cp2-ep2", "alltoall", "sigmoid"), ("cp2-ep2", "allgather", "softmax")]


@pytest.fixture(scope="module")
def results():
    return run_distributed(train_runs, 4, LAYOUTS, RUNS, timeout=900)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: "/".join(r))
def test_expert_grid_equals_ep1(results, run, reference_runs):
    check_run(results, LAYOUTS, run, reference_runs)


def test_memory_report_shards_experts_over_edp(results):
    """TP = 2, ETP = 1, EP = 4 with the distributed optimizer: dense weights' state is sharded over
    DP = 2, the experts' over EDP = 1; the measured bytes per parameter follow that blend of
    formulas.md (within the buckets' padding), not the dense formula alone."""
    for r in results:
        info = r["tp2-etp1-ep4-distopt/alltoall/softmax"]["memory"]
        dense, experts = info["num_params"] - info["expert_params"], info["expert_params"]
        blended = (dense * (8 + 8 / 2) + experts * (8 + 8 / 1)) / (dense + experts)  # fp32: 8 + 8/d
        assert info["formula_bytes_per_param"] == pytest.approx(blended)
        assert abs(info["bytes_per_param"] - blended) < 0.05 * blended
        assert abs(info["bytes_per_param"] - 12.0) > 0.1 * 12.0
        assert "experts d=1" in info["formula"]


def test_expert_grid_by_hand():
    """TP = 2, DP = 2, ETP = 1, EP = 2: the two TP ranks of a replica hold different experts."""
    grid = ExpertLayout(ParallelLayout(4, tensor=2), expert=2, expert_tensor=1)
    assert grid.ep_groups() == [[0, 1], [2, 3]] and grid.edp_groups() == [[0, 2], [1, 3]]
    assert grid.etp_groups() == [[0], [1], [2], [3]]
    # CP = 2, TP = 2, ETP = TP, EP = 2: EP takes the CP ranks of one TP coordinate first
    grid = ExpertLayout(ParallelLayout(8, tensor=2, context=2), expert=2)
    assert grid.ep_groups()[:2] == [[0, 2], [1, 3]] and grid.edp_groups()[:2] == [[0, 4], [1, 5]]
    assert grid.etp_ep_groups()[0] == [0, 1, 2, 3]


@pytest.mark.parametrize("kwargs, message", [
    (dict(layout=ParallelLayout(4, tensor=2), expert=4, expert_tensor=2), "does not divide the 4 ranks"),
    (dict(layout=ParallelLayout(8, tensor=2, pipeline=2, tp_pp_dp_mapping=True), expert=1, expert_tensor=1),
     "--use-tp-pp-dp-mapping with pipeline parallelism"),
    (dict(layout=ParallelLayout(4), expert=2, num_experts=3), "--num-experts 3 is not divisible"),
])
def test_impossible_grids_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpertLayout(**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("tp, cp, dp, pp, ep, etp", [
    (2, 1, 2, 1, 2, 1), (2, 2, 2, 2, 4, 1), (1, 2, 4, 1, 2, 2), (4, 1, 2, 1, 8, 1), (2, 2, 1, 3, 2, 2),
])
def test_groups_equal_megatron_rank_generator(tp, cp, dp, pp, ep, etp):
    from megatron.core.parallel_state import RankGenerator

    world = tp * cp * dp * pp
    grid = ExpertLayout(ParallelLayout(world, tensor=tp, pipeline=pp, context=cp), expert=ep, expert_tensor=etp)
    megatron = RankGenerator(tp=etp, ep=ep, dp=grid.expert_data, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for mine, token in ((grid.etp_groups, "tp"), (grid.ep_groups, "ep"), (grid.etp_ep_groups, "tp-ep"),
                        (grid.edp_groups, "dp")):
        assert sorted(mine()) == sorted(megatron.get_ranks(token)), token
