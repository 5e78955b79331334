"""Expert-parallel (EP) groups and their expert-data-parallel (EDP) complements.

As Megatron carves them, the EP ranks are taken from the data-parallel ranks (DP x CP when
context parallelism exists) of one tensor- and pipeline-parallel coordinate, consecutive ranks
first: with DP = 4 and EP = 2, data ranks {0, 1} and {2, 3} form EP groups, and {0, 2},
{1, 3} the EDP groups over which expert gradients are averaged (dense gradients still average
over all of DP). Experts are tensor-parallel over the model's TP group (expert TP = TP).

    expert = ExpertState.create(pstate, expert_model_parallel_size)   # a collective
"""

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from megalite.parallel.state import ParallelLayout, ParallelState


def data_ranks(layout: ParallelLayout, tp_rank: int, pp_rank: int) -> list[int]:
    """Global ranks of the data-parallel dimension at one (TP, PP) coordinate, in the order EP
    is carved from (a context-parallel dimension would be one more factor here)."""
    return [layout.rank_of(tp_rank, d, pp_rank) for d in range(layout.data)]


@dataclass(frozen=True)
class ExpertLayout:
    """Sizes of the expert dimensions; refuses an EP size that does not divide the data ranks
    or the experts."""

    layout: ParallelLayout
    expert: int = 1
    num_experts: int | None = None

    def __post_init__(self):
        if not isinstance(self.expert, int) or self.expert < 1:
            raise ValueError(f"--expert-model-parallel-size must be a positive integer, got {self.expert!r}")
        if self.layout.data % self.expert:
            raise ValueError(
                f"--expert-model-parallel-size {self.expert} does not divide the data-parallel size "
                f"{self.layout.data} (world size / (TP x PP)) it is carved from")
        if self.num_experts is not None and self.num_experts % self.expert:
            raise ValueError(f"--num-experts {self.num_experts} is not divisible by "
                             f"--expert-model-parallel-size {self.expert}")

    @property
    def expert_data(self) -> int:
        return self.layout.data // self.expert

    def coords(self, rank: int) -> tuple[int, int]:
        """(ep_rank, edp_rank) of a global rank."""
        dp_rank = self.layout.coords(rank)[1]
        return dp_rank % self.expert, dp_rank // self.expert

    def _pairs(self):
        for p in range(self.layout.pipeline):
            for t in range(self.layout.tensor):
                yield data_ranks(self.layout, t, p)

    def ep_groups(self) -> list[list[int]]:
        return [ranks[i:i + self.expert] for ranks in self._pairs() for i in range(0, len(ranks), self.expert)]

    def edp_groups(self) -> list[list[int]]:
        return [ranks[j::self.expert] for ranks in self._pairs() for j in range(self.expert)]


class ExpertState:
    """One rank's expert-parallel coordinates and groups (None where the size is 1)."""

    def __init__(self, layout: ExpertLayout, rank: int, ep_group=None, edp_group=None):
        self.layout = layout
        self.ep_rank, self.edp_rank = layout.coords(rank)
        self.ep_group, self.edp_group = ep_group, edp_group

    @property
    def ep_size(self) -> int:
        return self.layout.expert

    @property
    def edp_size(self) -> int:
        return self.layout.expert_data

    @classmethod
    def single(cls) -> "ExpertState":
        return cls(ExpertLayout(ParallelLayout(1)), 0)

    @classmethod
    def create(cls, pstate: ParallelState, expert_size: int, num_experts: int | None = None,
               timeout_minutes: float | None = None) -> "ExpertState":
        """Build this layout's EP and EDP groups: a collective every rank calls."""
        layout = ExpertLayout(pstate.layout, expert_size, num_experts)
        if not dist.is_initialized():
            return cls(layout, pstate.rank)
        timeout = timedelta(minutes=timeout_minutes) if timeout_minutes else None
        groups = {}
        for name, ranks in (("ep", layout.ep_groups()), ("edp", layout.edp_groups())):
            groups[name], _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout)
        ep = groups["ep"] if layout.expert > 1 else None
        edp = groups["edp"] if layout.expert_data > 1 else None
        return cls(layout, pstate.rank, ep, edp)

    def dp_rank_of(self, edp_rank: int) -> int:
        """The data-parallel rank of this rank's EDP-group member `edp_rank`."""
        return edp_rank * self.ep_size + self.ep_rank

    def __repr__(self) -> str:
        return f"ExpertState(ep={self.ep_rank}/{self.ep_size}, edp={self.edp_rank}/{self.edp_size})"
