"""Candidate layouts: TP x CP x PP (x virtual stages) x DP (with EP carved from DP for MoE
models) x sequence parallelism x recompute x distributed optimizer or FSDP2 x micro-batch size
x pipeline schedule, each valid for the model and the batch as megalite validates a run.

FSDP2 (--use-torch-fsdp2, ZeRO-3) is searched for dense models without pipeline parallelism
(PP 1), with DP x CP > 1: the layouts its memory model (memory.py) was checked on against the
dry run.

`Space` restricts what is enumerated (every option of tools/plan.py that takes a list).
"""

from dataclasses import dataclass, field
from functools import lru_cache

from megalite.parallel.pipeline.schedules import default_schedule, validate_schedule
from megalite.parallel.state import ParallelLayout
from megalite.planner.workload import Workload

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch_size: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    distributed_optimizer: bool = False
    schedule: str = "none"
    fsdp2: bool = False
    """--use-torch-fsdp2: weights, gradients and optimizer state sharded over DP x CP."""

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.dp * self.micro_batch_size)

    def parallel_layout(self) -> ParallelLayout:
        return ParallelLayout(self.world_size, tensor=self.tp, pipeline=self.pp, virtual_pipeline=self.vp,
                              context=self.cp)

    def flags(self) -> list[str]:
        """pretrain_gpt's flags for this layout (the data-parallel size follows from the world)."""
        flags = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]
        if self.vp > 1:
            flags += ["--num-virtual-stages-per-pipeline-rank", str(self.vp)]
        if self.schedule not in ("none", default_schedule(self.pp, self.vp)):
            flags += ["--pipeline-schedule", self.schedule]
        if self.cp > 1:
            flags += ["--context-parallel-size", str(self.cp)]
        if self.ep > 1:
            flags += ["--expert-model-parallel-size", str(self.ep)]
        if self.sequence_parallel:
            flags.append("--sequence-parallel")
        if self.recompute != "none":
            flags += ["--recompute-granularity", self.recompute]
        if self.distributed_optimizer:
            flags.append("--use-distributed-optimizer")
        if self.fsdp2:  # FSDP2 overlaps its own all-gathers and reduce-scatters
            flags.append("--use-torch-fsdp2")
        elif self.dp * self.cp > 1:
            flags += ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if self.distributed_optimizer else [])
        return flags + ["--micro-batch-size", str(self.micro_batch_size)]

    def short(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"] + ([f"v{self.vp}"] if self.vp > 1 else []) + [f"DP{self.dp}"]
        parts += [f"CP{self.cp}"] if self.cp > 1 else []
        parts += [f"EP{self.ep}"] if self.ep > 1 else []
        parts += [f"mb{self.micro_batch_size}"]
        parts += ["SP"] if self.sequence_parallel else []
        parts += [{"none": "", "selective": "sel", "full": "full"}[self.recompute]] if self.recompute != "none" else []
        parts += ["DO"] if self.distributed_optimizer else []
        parts += ["FSDP2"] if self.fsdp2 else []
        parts += ["zb"] if self.schedule == "zb_h1" else []
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Space:
    """Allowed values per dimension; None allows every value the model and world admit."""

    tp: list | None = None
    pp: list | None = None
    vp: list | None = None
    cp: list | None = field(default_factory=lambda: [1])
    ep: list | None = None
    micro_batch_size: list | None = None
    sequence_parallel: list = field(default_factory=lambda: [False, True])
    recompute: list = field(default_factory=lambda: list(RECOMPUTE))
    distributed_optimizer: list = field(default_factory=lambda: [False, True])
    fsdp2: list = field(default_factory=lambda: [False, True])
    """Whether to search --use-torch-fsdp2 layouts (where fsdp2_allowed) and / or the others."""
    schedules: list = field(default_factory=lambda: ["default"])
    """'default' (Megatron's: 1f1b, interleaved with v > 1) and/or 'zb_h1' (v = 1 only)."""
    max_virtual_stages: int = 8

    def allows(self, name: str, value) -> bool:
        allowed = getattr(self, name)
        return allowed is None or value in allowed


@lru_cache(maxsize=None)
def _model_ok(heads: int, groups: int, seq: int, tp: int, cp: int) -> bool:
    """Heads and key/value groups split over TP; with CP each rank takes two of 2 x CP chunks."""
    return heads % tp == 0 and groups % tp == 0 and (cp == 1 or seq % (2 * cp) == 0)


def _splits(workload: Workload, pp: int, vp: int) -> bool:
    """Whether the model's layers split over `pp` x `vp` stages as pretrain_gpt splits them
    (evenly, or with the --account-for-*-in-pipeline-split split)."""
    try:
        workload.layer_split(pp, vp)
    except ValueError:
        return False
    return True


def enumerate_layouts(workload: Workload, world_size: int, space: Space):
    """Every layout of `world_size` ranks megalite can run for `workload`, within `space`."""
    config, batch = workload.config, workload.global_batch_size
    moe = config.moe
    for tp in _divisors(world_size):
        if not space.allows("tp", tp):
            continue
        for cp in _divisors(world_size // tp):
            shardable = _model_ok(config.num_attention_heads, config.num_query_groups, workload.seq_length, tp, cp) \
                and (config.gdn is None or config.gdn.linear_num_key_heads % (tp * cp) == 0)  # whole heads per rank
            if not space.allows("cp", cp) or not shardable or (cp > 1 and moe is not None):
                continue
            for pp in _divisors(world_size // (tp * cp)):
                dp = world_size // (tp * cp * pp)
                if not space.allows("pp", pp) or batch % dp:
                    continue
                for vp in range(1, min(space.max_virtual_stages, (config.num_layers + 2) // pp) + 1):
                    if (vp > 1 and pp == 1) or not space.allows("vp", vp) or not _splits(workload, pp, vp):
                        continue
                    for ep in (_divisors(dp) if moe is not None else [1]):
                        if not space.allows("ep", ep) or (moe is not None and moe.num_experts % ep):
                            continue
                        yield from _variants(workload, space, tp, pp, dp, vp, cp, ep)


def _variants(workload, space, tp, pp, dp, vp, cp, ep):
    batch = workload.global_batch_size
    schedules = []
    for name in space.schedules:
        schedule = default_schedule(pp, vp) if name == "default" else name
        if name == "zb_h1" and (pp == 1 or vp > 1):
            continue
        schedules.append(schedule)
    for mbs in _divisors(batch // dp):
        if not space.allows("micro_batch_size", mbs):
            continue
        m = batch // (dp * mbs)
        for schedule in schedules:
            try:
                validate_schedule(schedule, pp, m, vp)
            except ValueError:
                continue
            for sp in space.sequence_parallel if tp > 1 else [False]:  # SP at t = 1 is no SP
                for recompute in space.recompute:
                    if True in space.fsdp2 and fsdp2_allowed(workload, pp, dp, cp):
                        yield Layout(tp, pp, dp, vp, cp, ep, mbs, sp, recompute, False, schedule, fsdp2=True)
                    if False not in space.fsdp2:
                        continue
                    for distributed in space.distributed_optimizer:
                        if distributed and dp * cp == 1:
                            continue
                        yield Layout(tp, pp, dp, vp, cp, ep, mbs, sp, recompute, distributed, schedule)


def fsdp2_allowed(workload: Workload, pp: int, dp: int, cp: int) -> bool:
    """FSDP2 layouts the planner models: a dense model, no pipeline, something to shard over."""
    return pp == 1 and dp * cp > 1 and workload.config.moe is None
