"""Predicted peak device memory of one rank: parameters, gradients and optimizer state by the
bytes-per-parameter formulas (megalite.optimizer.memory_report, formulas.md), activations by
Korthikanti et al. 2022 (megalite.training.flops.activation_bytes_per_layer, formulas.md's
table) times the layers this rank holds for every micro-batch in flight, as the schedule's own
action lists keep them (megalite.parallel.pipeline.simulator.held_activations).

Beyond formulas.md's table, and labelled so:
- context parallelism splits the sequence: each rank keeps s / CP of it;
- with full recompute and sequence parallelism the kept layer input is sequence-split (/t);
- full recompute re-creates one layer's activations during its backward ("recompute");
- the last stage keeps one micro-batch's logits, 16-bit plus the fp32 copy the loss
  takes ("logits");
- 32-bit activations take twice the table's 16-bit bytes (dropout masks included: an upper
  bound);
- multi-latent attention's terms, and each MTP depth on the last stage as one more layer plus
  its own inputs and logits (megalite/dryrun/README.md, "FLOPs and memory of MLA and MTP").
"""

from dataclasses import dataclass
from functools import lru_cache

from megalite.optimizer.memory_report import bytes_per_parameter
from megalite.parallel.pipeline.schedules import schedule_actions
from megalite.parallel.pipeline.simulator import held_activations
from megalite.planner.layouts import Layout
from megalite.parallel.pipeline.stage_layout import stage_layers
from megalite.planner.parameters import rank_parameters
from megalite.planner.workload import Workload
from megalite.training.flops import activation_bytes_per_layer, mtp_activation_bytes

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")


@dataclass
class RankMemory:
    rank: int
    """Pipeline rank."""
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    """Layer activations of the micro-batches in flight, plus the extras below."""
    recompute: float = 0.0
    logits: float = 0.0
    num_parameters: int = 0
    held_microbatches: float = 0.0
    """Micro-batches in flight at the peak, in whole-stage equivalents (chunk activations / v)."""

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.recompute + self.logits


@lru_cache(maxsize=4096)
def held_chunk_activations(schedule: str, p: int, rank: int, m: int, v: int) -> int:
    """Peak (chunk, micro-batch) activations rank `rank` holds under `schedule`."""
    return held_activations(schedule_actions(schedule, p, rank, m, v))


def _weight_and_grad_bytes(precision: str) -> tuple[int, int]:
    """Bytes per parameter of the weights and of the main gradients (formulas.md's rows)."""
    return {"bf16": (2, 4), "fp16": (2, 2), "fp32": (4, 4)}[precision]


def state_bytes(precision: str, num_params: int, distributed: bool, shards: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of `num_params` parameters whose optimizer state is
    sharded over `shards` ranks by the distributed optimizer."""
    total = bytes_per_parameter(precision, distributed, shards) * num_params
    weight, grad = _weight_and_grad_bytes(precision)
    return weight * num_params, grad * num_params, total - (weight + grad) * num_params


def layer_activation_bytes(workload: Workload, layout: Layout, recompute: str | None = None) -> float:
    """Bytes one transformer layer keeps for one micro-batch on one rank."""
    config = workload.config
    recompute = layout.recompute if recompute is None else recompute
    s, b, t = workload.seq_length // layout.cp, layout.micro_batch_size, layout.tp
    per_layer = activation_bytes_per_layer(s, b, config.hidden_size, config.num_attention_heads, t,
                                           layout.sequence_parallel, None if recompute == "none" else recompute,
                                           workload.flash_attention, mla=config.mla, latent_norms=config.qk_layernorm)
    if recompute == "full" and layout.sequence_parallel:
        per_layer /= t
    return per_layer * workload.activation_bytes / 2


def rank_memory(workload: Workload, layout: Layout, rank: int) -> RankMemory:
    config = workload.config
    t, p, v = layout.tp, layout.pp, layout.vp
    split = workload.layer_split(p, v)
    dense, expert = rank_parameters(config, t, p, v, rank, layout.ep, split)
    shards = layout.dp * layout.cp
    w, g, o = state_bytes(workload.precision, dense, layout.distributed_optimizer, shards)
    if expert:
        ew, eg, eo = state_bytes(workload.precision, expert, layout.distributed_optimizer, shards // layout.ep)
        w, g, o = w + ew, g + eg, o + eo
    m = layout.num_microbatches(workload.global_batch_size)
    held = held_chunk_activations(layout.schedule, p, rank, m, v)
    # the rank's layers over its chunks (--account-for-*-in-pipeline-split: fewer on the first / last)
    layers_per_chunk = sum(len(stage_layers(config.num_layers, p, rank, c, v, **split)) for c in range(v)) / v
    activations = held * layers_per_chunk * layer_activation_bytes(workload, layout)
    recompute = layer_activation_bytes(workload, layout, "none") if layout.recompute == "full" else 0.0
    logits = 0.0
    if rank == p - 1:
        tokens = workload.seq_length // layout.cp * layout.micro_batch_size
        depths = config.mtp_num_layers or 0
        logits = (1 + depths) * tokens * config.padded_vocab_size(t) // t * (workload.activation_bytes + 4)
        if depths:  # the last chunk's micro-batches in flight hold each MTP depth too
            last = held_chunk_activations(layout.schedule, p, rank, m, v) / v
            extra = mtp_activation_bytes(tokens, 1, config.hidden_size, t, layout.sequence_parallel)
            activations += last * depths * (layer_activation_bytes(workload, layout)
                                            + extra * workload.activation_bytes / 2)
    return RankMemory(rank, w, g, o, activations, recompute, logits, dense + expert, held / v)


def peak_memory(workload: Workload, layout: Layout) -> RankMemory:
    """The pipeline rank with the largest predicted total: the first and last stages (every
    stage for MoE models, whose layer pattern can make a middle stage the largest, and where
    --account-for-*-in-pipeline-split gives the first / last stage a layer fewer)."""
    p = layout.pp
    ranks = range(p) if workload.is_moe or workload.accounts_in_split else sorted({0, p - 1})
    return max((rank_memory(workload, layout, r) for r in ranks), key=lambda mem: mem.total)
