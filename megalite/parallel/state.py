"""Parallel layout and process groups, as an explicit object (no module-level globals).

Ranks are ordered as Megatron orders them: tensor-parallel innermost, then context-parallel,
then data-parallel, then pipeline-parallel:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

or, with `tp_pp_dp_mapping` (Megatron's --use-tp-pp-dp-mapping), pipeline before data:

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

With `optimizer_instances` N > 1 (Megatron's --num-distributed-optimizer-instances) each DP x CP
group is cut into N contiguous blocks of s = DP x CP / N ranks: the distributed optimizer
shards within a block (its "instance") and the N instances hold replicas of it, as
Megatron's intra- and inter-instance groups (parallel_state.initialize_model_parallel).

`ParallelLayout` is pure arithmetic and validates itself when constructed, so an impossible
layout is refused before any process group exists. `ParallelState` is one rank's view of a
layout: its coordinates, its neighbours and the process groups it belongs to.
"""

import itertools
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


def _require_positive(*flags_and_values) -> None:
    for flag, value in flags_and_values:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel dimensions; the data-parallel size is inferred."""

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int = 1
    context: int = 1
    tp_pp_dp_mapping: bool = False
    optimizer_instances: int = 1

    def __post_init__(self):
        _require_positive(
            ("world size", self.world_size),
            ("--tensor-model-parallel-size", self.tensor),
            ("--pipeline-model-parallel-size", self.pipeline),
            ("--num-virtual-stages-per-pipeline-rank", self.virtual_pipeline),
            ("--context-parallel-size", self.context),
            ("--num-distributed-optimizer-instances", self.optimizer_instances),
        )
        if self.world_size % (self.tensor * self.context * self.pipeline):
            cp = f" x --context-parallel-size {self.context}" if self.context > 1 else ""
            raise ValueError(
                f"world size {self.world_size} is not divisible by --tensor-model-parallel-size "
                f"{self.tensor}{cp} x --pipeline-model-parallel-size {self.pipeline} = "
                f"{self.tensor * self.context * self.pipeline}"
            )
        if self.virtual_pipeline > 1 and self.pipeline == 1:
            raise ValueError(
                f"--num-virtual-stages-per-pipeline-rank {self.virtual_pipeline} needs "
                "--pipeline-model-parallel-size > 1"
            )
        if (self.data * self.context) % self.optimizer_instances:
            cp = f" x --context-parallel-size {self.context}" if self.context > 1 else ""
            raise ValueError(
                f"--num-distributed-optimizer-instances {self.optimizer_instances} does not divide the "
                f"data-parallel size {self.data}{cp} (world size {self.world_size} / (TP x CP x PP))"
            )

    @property
    def data(self) -> int:
        return self.world_size // (self.tensor * self.context * self.pipeline)

    @property
    def instance_size(self) -> int:
        """DP x CP ranks of one distributed-optimizer instance, s = DP x CP / N."""
        return self.data * self.context // self.optimizer_instances

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        if self.tp_pp_dp_mapping:
            outer = dp_rank * self.pipeline + pp_rank
        else:
            outer = pp_rank * self.data + dp_rank
        return (outer * self.context + cp_rank) * self.tensor + tp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank (its CP rank: `cp_rank_of`)."""
        outer = rank // (self.tensor * self.context)
        if self.tp_pp_dp_mapping:
            return rank % self.tensor, outer // self.pipeline, outer % self.pipeline
        return rank % self.tensor, outer % self.data, outer // self.data

    def cp_rank_of(self, rank: int) -> int:
        return (rank // self.tensor) % self.context

    def _groups(self, inner: str, *more_inner: str) -> list[list[int]]:
        """Rank lists varying the named dimensions (`inner` fastest), the others fixed."""
        sizes = {"t": self.tensor, "c": self.context, "d": self.data, "p": self.pipeline}
        varying = (inner, *more_inner)
        fixed = [d for d in "pdct" if d not in varying]
        groups = []
        for fixed_coords in itertools.product(*[range(sizes[d]) for d in fixed]):
            at = dict(zip(fixed, fixed_coords))
            group = []
            for coords in itertools.product(*[range(sizes[d]) for d in reversed(varying)]):
                at.update(zip(reversed(varying), coords))
                group.append(self.rank_of(at["t"], at["d"], at["p"], at["c"]))
            groups.append(group)
        return groups

    def tp_groups(self) -> list[list[int]]:
        return self._groups("t")

    def cp_groups(self) -> list[list[int]]:
        """Context-parallel groups: the ranks each sequence is split over."""
        return self._groups("c")

    def dp_groups(self) -> list[list[int]]:
        return self._groups("d")

    def dp_cp_groups(self) -> list[list[int]]:
        """DP x CP: the ranks over which gradients of parameters are reduced and the
        distributed optimizer's state is sharded (every CP rank holds the same parameters and a
        different part of each sequence); group rank dp_rank x CP + cp_rank."""
        return self._groups("c", "d")

    def dp_cp_instance_groups(self) -> list[list[int]]:
        """Each DP x CP group cut into its N contiguous blocks of s ranks: the ranks one
        distributed-optimizer instance shards over (Megatron's intra-partial DP x CP group)."""
        s = self.instance_size
        return [g[i * s:(i + 1) * s] for g in self.dp_cp_groups() for i in range(self.optimizer_instances)]

    def dp_cp_replica_groups(self) -> list[list[int]]:
        """The ranks at one position of every instance of a DP x CP group: they hold the same
        optimizer shard and all-reduce its gradient (Megatron's inter-instance group)."""
        s = self.instance_size
        return [g[j::s] for g in self.dp_cp_groups() for j in range(s)]

    def optimizer_instance_groups(self) -> list[list[int]]:
        """Every rank (all TP, PP, and the instance's DP x CP ranks) of one instance: each
        element of the optimizer state once, so gradient norms are summed over it (Megatron's
        intra distributed-optimizer instance group)."""
        s, groups = self.instance_size, [[] for _ in range(self.optimizer_instances)]
        for rank in range(self.world_size):
            _, dp_rank, _ = self.coords(rank)
            groups[(dp_rank * self.context + self.cp_rank_of(rank)) // s].append(rank)
        return groups

    def pp_groups(self) -> list[list[int]]:
        return self._groups("p")

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: every TP x PP rank holding one replica of the model."""
        return self._groups("t", "p")

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline (they hold the tied embeddings)."""
        return [sorted({ranks[0], ranks[-1]}) for ranks in self.pp_groups()]

    def check_model(
        self,
        num_layers: int,
        hidden_size: int,
        num_attention_heads: int,
        num_query_groups: int | None = None,
        kv_channels: int | None = None,
    ) -> None:
        """Refuse model shapes this layout cannot shard, naming the flags involved.
        `num_query_groups` None means one group per head (multi-head attention);
        `kv_channels` None means hidden_size / num_attention_heads. How the layers split over
        pipeline stages is parallel.pipeline.stage_layout's check (it knows every split)."""
        _require_positive(
            ("--num-layers", num_layers),
            ("--hidden-size", hidden_size),
            ("--num-attention-heads", num_attention_heads),
            *([("--num-query-groups", num_query_groups)] if num_query_groups is not None else []),
            *([("--kv-channels", kv_channels)] if kv_channels is not None else []),
        )
        if kv_channels is None and hidden_size % num_attention_heads:
            raise ValueError(
                f"--hidden-size {hidden_size} is not divisible by --num-attention-heads "
                f"{num_attention_heads}"
            )
        if num_attention_heads % self.tensor:
            raise ValueError(
                f"--num-attention-heads {num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {self.tensor}"
            )
        groups = num_query_groups or num_attention_heads
        if num_attention_heads % groups:
            raise ValueError(
                f"--num-attention-heads {num_attention_heads} is not divisible by "
                f"--num-query-groups {groups}"
            )
        if groups % self.tensor:
            raise ValueError(
                f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size "
                f"{self.tensor}"
            )


class ParallelState:
    """One rank's coordinates, neighbours and process groups within a `ParallelLayout`.

    Groups are None when their size is 1 and no process group was created for them, so a
    single process without torch.distributed works (`ParallelState.single()`).
    """

    def __init__(self, layout: ParallelLayout, rank: int, groups: dict | None = None):
        self.layout = layout
        self.rank = rank
        self.tp_rank, self.dp_rank, self.pp_rank = layout.coords(rank)
        self.cp_rank = layout.cp_rank_of(rank)
        groups = groups or {}
        self.tp_group = groups.get("tp")
        self.cp_group = groups.get("cp")
        self.dp_group = groups.get("dp")
        # Gradients are reduced over DP x CP; without CP that is the DP group itself.
        self.dp_cp_group = groups.get("dp_cp", self.dp_group) if layout.context > 1 else self.dp_group
        self.pp_group = groups.get("pp")
        self.mp_group = groups.get("mp")
        self.embedding_group = groups.get("embedding")
        self.world_group = groups.get("world")
        # distributed-optimizer instances: with one, the instance is the whole DP x CP group
        several = layout.optimizer_instances > 1
        self.dp_cp_instance_group = groups.get("dp_cp_instance") if several else self.dp_cp_group
        self.dp_cp_replica_group = groups.get("dp_cp_replica") if several else None
        self.instance_group = groups.get("instance") if several else self.world_group
        self.expert = None  # megalite.parallel.expert.groups.ExpertState when the model has experts

    @classmethod
    def single(cls) -> "ParallelState":
        """A one-process state: every dimension of size 1, no process groups."""
        return cls(ParallelLayout(1), 0)

    @classmethod
    def create(cls, layout: ParallelLayout, timeout_minutes: float | None = None) -> "ParallelState":
        """Build every group of `layout`. Call on all ranks after init_process_group."""
        if not dist.is_initialized():
            if layout.world_size == 1:
                return cls(layout, 0)
            raise RuntimeError("torch.distributed must be initialised before ParallelState.create")
        if dist.get_world_size() != layout.world_size:
            raise ValueError(
                f"layout expects world size {layout.world_size} but torch.distributed has "
                f"{dist.get_world_size()} processes"
            )
        timeout = timedelta(minutes=timeout_minutes) if timeout_minutes else None
        groups = {"world": dist.group.WORLD}
        for name, ranks in (
            ("tp", layout.tp_groups()),
            *([("cp", layout.cp_groups()), ("dp_cp", layout.dp_cp_groups())] if layout.context > 1 else []),
            ("dp", layout.dp_groups()),
            ("pp", layout.pp_groups()),
            ("mp", layout.mp_groups()),
            *([("dp_cp_instance", layout.dp_cp_instance_groups()), ("dp_cp_replica", layout.dp_cp_replica_groups()),
               ("instance", layout.optimizer_instance_groups())] if layout.optimizer_instances > 1 else []),
        ):
            groups[name], _ = dist.new_subgroups_by_enumeration(ranks, timeout=timeout)
        # Embedding groups may repeat a rank list (pp == 1), so they are built one by one;
        # every rank must take part in creating every group.
        rank = dist.get_rank()
        for ranks in layout.embedding_groups():
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                groups["embedding"] = group
        return cls(layout, rank, groups)

    # sizes
    @property
    def tp_size(self) -> int:
        return self.layout.tensor

    @property
    def cp_size(self) -> int:
        return self.layout.context

    @property
    def dp_size(self) -> int:
        return self.layout.data

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in the DP x CP group (dp_cp_groups)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def optimizer_instances(self) -> int:
        return self.layout.optimizer_instances

    @property
    def instance_dp_cp_size(self) -> int:
        """s: the DP x CP ranks the distributed optimizer shards over (all of them with one instance)."""
        return self.layout.instance_size

    @property
    def instance_rank(self) -> int:
        """Which distributed-optimizer instance this rank belongs to."""
        return self.dp_cp_rank // self.instance_dp_cp_size

    @property
    def instance_dp_cp_rank(self) -> int:
        """This rank's index among its instance's DP x CP ranks (its optimizer shard)."""
        return self.dp_cp_rank % self.instance_dp_cp_size

    def dp_cp_coords(self, dp_cp_rank: int) -> tuple[int, int]:
        """(dp_rank, cp_rank) of the DP x CP group member `dp_cp_rank`."""
        return divmod(dp_cp_rank, self.cp_size)

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline

    @property
    def vp_size(self) -> int:
        return self.layout.virtual_pipeline

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    # pipeline position
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, stage 0 first."""
        return [self.layout.rank_of(self.tp_rank, self.dp_rank, p, self.cp_rank) for p in range(self.pp_size)]

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around, as interleaving needs)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def tp_src_rank(self) -> int:
        """Global rank of tensor-parallel rank 0 in this rank's TP group."""
        return self.layout.rank_of(0, self.dp_rank, self.pp_rank, self.cp_rank)

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank={self.rank}, tp={self.tp_rank}/{self.tp_size}, "
            f"cp={self.cp_rank}/{self.cp_size}, dp={self.dp_rank}/{self.dp_size}, pp={self.pp_rank}/{self.pp_size}, vp={self.vp_size})"
        )
