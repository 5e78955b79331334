"""--calibrate's fit recovers a collective's latency and bandwidth from its timings; a
calibrated cluster file round-trips; the measurement itself runs on gloo (slow)."""

import pytest

from megalite.planner.calibrate import SIZES, calibrate, fit
from megalite.planner.cluster import Cluster


@pytest.mark.parametrize("kind, n, hops, share", [("all_reduce", 4, 6, 1.5), ("all_gather", 8, 7, 7 / 8),
                                                   ("p2p", 2, 1, 1.0)])
def test_fit_recovers_latency_and_bandwidth(kind, n, hops, share):
    latency, bandwidth = 2e-4, 3e8
    seconds = [hops * latency + share * size / bandwidth for size in SIZES]
    assert fit(kind, n, SIZES, seconds) == pytest.approx([latency, bandwidth], rel=1e-9)
    noisy = [t * (1.05 if i % 2 else 0.95) for i, t in enumerate(seconds)]
    got = fit(kind, n, SIZES, noisy)
    assert got[1] == pytest.approx(bandwidth, rel=0.2) and got[0] >= 0


def test_a_fit_never_goes_negative():
    latency, bandwidth = fit("all_reduce", 2, SIZES, [1e-3, 1e-3, 1e-3, 0.9e-3])
    assert latency > 0 and bandwidth > 0


@pytest.mark.slow
def test_calibrate_measures_this_machine(tmp_path):
    cluster = calibrate(2, repeats=3)
    assert cluster.num_gpus == cluster.gpus_per_node == 2 and cluster.peak_flops > 1e8
    assert set(cluster.measured) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    assert cluster.slowdown and all(v > 0 for v in cluster.slowdown.values())
    path = tmp_path / "cpu2.json"
    cluster.save(str(path))
    loaded = Cluster.load(str(path))
    assert loaded.measured == {k: {n: tuple(v) for n, v in t.items()} for k, t in cluster.measured.items()}
    assert loaded.slowdown == cluster.slowdown and loaded.peak_flops == cluster.peak_flops
