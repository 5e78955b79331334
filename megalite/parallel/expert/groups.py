"""The expert grid: expert-tensor-parallel (ETP), expert-parallel (EP) and expert-data-parallel
(EDP) groups, laid over the same ranks as the dense TP x CP x DP grid of each pipeline stage.

As Megatron carves them (its expert RankGenerator, order "tp-ep-dp-pp"): number the ranks of
one pipeline stage L = (dp_rank * CP + cp_rank) * TP + tp_rank, dense order, TP fastest; the
expert grid reads the same index as L = (edp_rank * EP + ep_rank) * ETP + etp_rank. With TP = 2,
DP = 2 and ETP = 1, EP = 2: ranks {0, 1} and {2, 3} are EP groups (the two TP ranks of one
replica hold different experts, whole), {0, 2} and {1, 3} the EDP groups over which expert
gradients are averaged (dense gradients still average over DP x CP). With ETP = TP and CP = 1
the EP ranks are consecutive data-parallel ranks of one TP coordinate.

Every rank holds different tokens for the experts (its sequence-parallel slice, see
megalite.model.moe), so the ETP x EP ranks of one block together send all their tokens to one
complete set of experts: EP splits the experts, ETP splits each expert's weights.

    expert = ExpertState.create(pstate, expert_model_parallel_size, expert_tensor_parallel_size)
"""

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from megalite.parallel.state import ParallelLayout, ParallelState


@dataclass(frozen=True)
class ExpertLayout:
    """Sizes of the expert dimensions (expert_tensor None: the layout's TP size); refuses a grid
    that does not tile the ranks of a pipeline stage, or experts that do not split over EP."""

    layout: ParallelLayout
    expert: int = 1
    num_experts: int | None = None
    expert_tensor: int | None = None

    def __post_init__(self):
        if self.expert_tensor is None:
            object.__setattr__(self, "expert_tensor", self.layout.tensor)
        for flag, value in (("--expert-model-parallel-size", self.expert),
                            ("--expert-tensor-parallel-size", self.expert_tensor)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if self.stage_size % (self.expert * self.expert_tensor):
            raise ValueError(
                f"--expert-tensor-parallel-size {self.expert_tensor} x --expert-model-parallel-size "
                f"{self.expert} does not divide the {self.stage_size} ranks of a pipeline stage "
                "(TP x CP x DP) the expert grid is carved from")
        if self.layout.tp_pp_dp_mapping and self.layout.pipeline > 1 and \
                self.expert * self.expert_tensor != self.layout.tensor * self.layout.context:
            raise ValueError(
                f"--use-tp-pp-dp-mapping with pipeline parallelism needs --expert-tensor-parallel-size x "
                f"--expert-model-parallel-size ({self.expert_tensor} x {self.expert}) = TP x CP "
                f"({self.layout.tensor} x {self.layout.context}), as in Megatron")
        if self.num_experts is not None and self.num_experts % self.expert:
            raise ValueError(f"--num-experts {self.num_experts} is not divisible by "
                             f"--expert-model-parallel-size {self.expert}")
        if self.expert_data % self.layout.optimizer_instances:
            raise ValueError(f"--num-distributed-optimizer-instances {self.layout.optimizer_instances} does not "
                             f"divide the expert-data-parallel size {self.expert_data} (Megatron splits it into "
                             "instances as it splits DP x CP)")

    @property
    def stage_size(self) -> int:
        return self.layout.tensor * self.layout.context * self.layout.data

    @property
    def expert_data(self) -> int:
        return self.stage_size // (self.expert * self.expert_tensor)

    @property
    def differs_from_dense(self) -> bool:
        """Whether expert weights are laid out or reduced unlike dense ones: different experts
        on different ranks (EP > 1), a tensor split other than TP's, or an expert-data-parallel
        group spanning CP (which dense weights sum over before averaging over DP). Otherwise
        every model replica holds every expert, split as TP splits it, reduced over DP."""
        return self.expert > 1 or self.expert_tensor != self.layout.tensor or self.layout.context > 1

    def _stage_index(self, rank: int) -> int:
        tp_rank, dp_rank, _ = self.layout.coords(rank)
        return (dp_rank * self.layout.context + self.layout.cp_rank_of(rank)) * self.layout.tensor + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(etp_rank, ep_rank, edp_rank) of a global rank."""
        index = self._stage_index(rank)
        return index % self.expert_tensor, (index // self.expert_tensor) % self.expert, \
            index // (self.expert_tensor * self.expert)

    def rank_of(self, etp_rank: int, ep_rank: int, edp_rank: int, pp_rank: int) -> int:
        index = (edp_rank * self.expert + ep_rank) * self.expert_tensor + etp_rank
        tp, cp = self.layout.tensor, self.layout.context
        return self.layout.rank_of(index % tp, index // (tp * cp), pp_rank, (index // tp) % cp)

    def _groups(self, *varying: str) -> list[list[int]]:
        """Rank lists varying the named expert dimensions ('t', 'e', 'd'; TP fastest), the
        others and the pipeline stage fixed."""
        sizes = {"t": self.expert_tensor, "e": self.expert, "d": self.expert_data}
        fixed = [d for d in "det" if d not in varying]
        groups = []
        for p in range(self.layout.pipeline):
            for at in _product({d: sizes[d] for d in fixed}):
                group = []
                for inner in _product({d: sizes[d] for d in "det" if d in varying}):
                    c = {**at, **inner}
                    group.append(self.rank_of(c["t"], c["e"], c["d"], p))
                groups.append(group)
        return groups

    def etp_groups(self) -> list[list[int]]:
        return self._groups("t")

    def ep_groups(self) -> list[list[int]]:
        return self._groups("e")

    def etp_ep_groups(self) -> list[list[int]]:
        """ETP x EP blocks: the ranks that share one complete set of experts."""
        return self._groups("t", "e")

    def edp_groups(self) -> list[list[int]]:
        return self._groups("d")

    @property
    def instance_size(self) -> int:
        """Expert-data-parallel ranks of one distributed-optimizer instance (EDP / N): its
        ranks are exactly those of the dense instance (both are contiguous blocks of a stage)."""
        return self.expert_data // self.layout.optimizer_instances

    def edp_instance_groups(self) -> list[list[int]]:
        """Each EDP group cut into its N contiguous blocks (Megatron's intra-partial EDP group)."""
        s, n = self.instance_size, self.layout.optimizer_instances
        return [g[i * s:(i + 1) * s] for g in self.edp_groups() for i in range(n)]

    def edp_replica_groups(self) -> list[list[int]]:
        """One position of every instance of an EDP group (Megatron's inter-partial EDP group)."""
        s = self.instance_size
        return [g[j::s] for g in self.edp_groups() for j in range(s)]


def _product(sizes: dict) -> list[dict]:
    """Every coordinate of the named dimensions, the last name fastest."""
    out = [{}]
    for name, size in sizes.items():
        out = [{**c, name: i} for c in out for i in range(size)]
    return out


GROUP_NAMES = ("etp", "ep", "etp_ep", "edp")


class ExpertState:
    """One rank's expert-grid coordinates and groups (None where the size is 1)."""

    def __init__(self, layout: ExpertLayout, rank: int, groups: dict | None = None):
        self.layout, self.rank = layout, rank
        self.etp_rank, self.ep_rank, self.edp_rank = layout.coords(rank)
        self.pp_rank = layout.layout.coords(rank)[2]
        groups = groups or {}
        self.etp_group, self.ep_group, self.edp_group = groups.get("etp"), groups.get("ep"), groups.get("edp")
        several = layout.layout.optimizer_instances > 1  # distributed-optimizer instances (see state.py)
        self.edp_instance_group = groups.get("edp_instance") if several else self.edp_group
        self.edp_replica_group = groups.get("edp_replica") if several else None
        # the ETP x EP block is the EP group when ETP = 1, the ETP group when EP = 1
        self.etp_ep_group = groups["etp_ep"] if "etp_ep" in groups else \
            self.ep_group if layout.expert_tensor == 1 else self.etp_group

    @property
    def etp_size(self) -> int:
        return self.layout.expert_tensor

    @property
    def ep_size(self) -> int:
        return self.layout.expert

    @property
    def edp_size(self) -> int:
        return self.layout.expert_data

    @property
    def edp_instance_size(self) -> int:
        return self.layout.instance_size

    @property
    def grad_scale(self) -> float:
        """Factor on expert gradients before their average over EDP, so that the result is the
        dense rule's (a sum over CP, an average over DP): EDP / DP. Each EDP rank's gradient
        already sums the tokens of its whole ETP x EP block."""
        return self.edp_size / self.layout.layout.data

    @classmethod
    def single(cls) -> "ExpertState":
        return cls(ExpertLayout(ParallelLayout(1)), 0)

    @staticmethod
    def group_lists(layout: ExpertLayout) -> dict[str, list[list[int]]]:
        """{name: rank lists} of every group of size > 1 (the ETP x EP block only when it is
        neither the ETP nor the EP group)."""
        lists = {"etp": layout.etp_groups(), "ep": layout.ep_groups(), "edp": layout.edp_groups()}
        if layout.expert > 1 and layout.expert_tensor > 1:
            lists["etp_ep"] = layout.etp_ep_groups()
        lists = {name: ranks for name, ranks in lists.items() if len(ranks[0]) > 1}
        if layout.layout.optimizer_instances > 1:  # kept even at one rank: the instance's shard group
            lists.update(edp_instance=layout.edp_instance_groups(), edp_replica=layout.edp_replica_groups())
        return lists

    @classmethod
    def create(cls, pstate: ParallelState, expert_size: int, num_experts: int | None = None,
               timeout_minutes: float | None = None, expert_tensor_size: int | None = None) -> "ExpertState":
        """Build this layout's expert groups: a collective every rank calls."""
        layout = ExpertLayout(pstate.layout, expert_size, num_experts, expert_tensor_size)
        if not dist.is_initialized():
            return cls(layout, pstate.rank)
        timeout = timedelta(minutes=timeout_minutes) if timeout_minutes else None
        groups = {name: dist.new_subgroups_by_enumeration(ranks, timeout=timeout)[0]
                  for name, ranks in cls.group_lists(layout).items()}
        return cls(layout, pstate.rank, groups)

    def holder_rank(self, etp_rank: int, edp_rank: int) -> int:
        """Global rank of the holder of this rank's experts at (etp_rank, edp_rank)."""
        return self.layout.rank_of(etp_rank, self.ep_rank, edp_rank, self.pp_rank)


def is_expert_param(param) -> bool:
    return getattr(param, "expert_parallel", False)


def tensor_split_of(pstate: ParallelState, param) -> tuple:
    """(group, size, rank) over which `param`'s tensor-parallel shards are split: the ETP group
    for expert weights, the TP group otherwise. Without an expert grid (`pstate.expert` None) an
    MoE layer builds its experts on ExpertState.single(): whole on every rank, whatever the TP."""
    expert = pstate.expert
    if is_expert_param(param):
        return (expert.etp_group, expert.etp_size, expert.etp_rank) if expert is not None else (None, 1, 0)
    return pstate.tp_group, pstate.tp_size, pstate.tp_rank


def reduction_index(pstate: ParallelState, param) -> int:
    """This rank's index in the group `param`'s optimizer state is sharded over: the DP x CP
    rank, or for expert weights the expert-data-parallel rank; within its distributed-optimizer
    instance when there are several (the instances hold replicas of one layout)."""
    expert = pstate.expert
    if expert is not None and is_expert_param(param):
        return expert.edp_rank % expert.edp_instance_size
    return pstate.instance_dp_cp_rank


def holder_rank(pstate: ParallelState, param, shard_rank: int, reduction_rank: int) -> int:
    """Global rank holding `param`'s tensor-parallel shard `shard_rank` at index `reduction_rank`
    of its reduction group (see reduction_index; this rank's instance and other coordinates)."""
    expert = pstate.expert
    if expert is not None and is_expert_param(param):
        return expert.holder_rank(shard_rank, pstate.instance_rank * expert.edp_instance_size + reduction_rank)
    dp_rank, cp_rank = pstate.dp_cp_coords(pstate.instance_rank * pstate.instance_dp_cp_size + reduction_rank)
    return pstate.layout.rank_of(shard_rank, dp_rank, pstate.pp_rank, cp_rank)
