"""Enumerate layouts, keep those that fit in memory, estimate every one with the bubble formula,
then run the schedule simulator on the best `simulate` of them and rank by step time."""

from dataclasses import dataclass, field

from megalite.planner.cluster import Cluster
from megalite.planner.fp8 import check_fp8_plan
from megalite.planner.layouts import Layout, Space, enumerate_layouts
from megalite.planner.memory import RankMemory, peak_memory
from megalite.planner.step import Prediction, predict
from megalite.planner.workload import Workload


@dataclass
class Plan:
    workload: Workload
    cluster: Cluster
    ranked: list
    """Predictions of the simulated layouts, fastest first."""
    enumerated: int = 0
    fitting: int = 0
    memory_limit: float = 0.0
    rejected: list = field(default_factory=list)
    """(layout, memory) of the smallest-memory layouts that did not fit, when none did."""


def plan(workload: Workload, cluster: Cluster, space: Space | None = None, memory_fraction: float = 0.9,
         simulate: int = 48) -> Plan:
    """Every layout of cluster.num_gpus ranks in `space`, ranked by predicted step time."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"--memory-fraction must be in (0, 1], got {memory_fraction}")
    check_fp8_plan(workload, cluster)
    space = space or Space()
    limit = memory_fraction * cluster.memory_bytes
    fitting: list[tuple[Layout, RankMemory]] = []
    smallest: list[tuple[Layout, RankMemory]] = []
    enumerated = 0
    for layout in enumerate_layouts(workload, cluster.num_gpus, space):
        enumerated += 1
        memory = peak_memory(workload, layout)
        if memory.total <= limit:
            fitting.append((layout, memory))
        else:
            smallest = sorted(smallest + [(layout, memory)], key=lambda lm: lm[1].total)[:3]
    estimates = sorted((predict(cluster, workload, layout, memory, use_simulator=False).step_time, i)
                       for i, (layout, memory) in enumerate(fitting))
    chosen = [fitting[i] for _, i in estimates[:simulate]]
    ranked: list[Prediction] = sorted((predict(cluster, workload, layout, memory) for layout, memory in chosen),
                                      key=lambda prediction: prediction.step_time)
    return Plan(workload, cluster, ranked, enumerated, len(fitting), limit, [] if fitting else smallest)
