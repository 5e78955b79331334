"""Predicted peak device memory of one rank: parameters, gradients and optimizer state by the
bytes-per-parameter formulas (megalite.optimizer.memory_report, formulas.md), activations by
Korthikanti et al. 2022 (megalite.training.flops.activation_bytes_per_layer, formulas.md's
table; Gated DeltaNet layers by gdn_activation_bytes_per_layer) summed over the layers this
rank holds for every micro-batch in flight, as the schedule's own action lists keep them
(megalite.parallel.pipeline.simulator.held_activations).

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

FSDP2 (--use-torch-fsdp2, PP 1; `fsdp2_extras`): fp32 weights and Adam's two moments sharded
over DP x CP, 12 bytes per parameter / (DP x CP), whatever the precision (the fp32 gradient
shards, 4 more, come into being in backward as the activations are freed); the
root module's embedding, output layer and final norm unsharded in the compute dtype from the
first forward to the end of backward (FSDP2 does not reshard the root after forward); with
gradient accumulation the unsharded fp32 gradient of every parameter, accumulated under no_sync
until the last micro-batch (which FSDP2 layouts with several micro-batches per step pay); the 16-bit logits (the loss's gradient overwrites them) with one fp32 row chunk at the end of
the forward, or, later in backward when
they are freed, the recompute working set, the output layer's gradient and one layer gathered
twice (itself and the prefetched next) with its gradient and the fp32 reduce-scatter input.
Checked against the dry run (tests/planner/test_fsdp2.py).
"""

from dataclasses import dataclass
from functools import lru_cache

from megalite.kernels.cross_entropy_torch import TORCH_CHUNK_ELEMENTS
from megalite.optimizer.memory_report import bytes_per_parameter
from megalite.parallel.pipeline.schedules import schedule_actions
from megalite.parallel.pipeline.simulator import held_activations
from megalite.planner.fp8 import fp8_memory_bytes
from megalite.planner.layouts import Layout
from megalite.planner.optimizer import optimizer_state_bytes
from megalite.parallel.pipeline.stage_layout import stage_layers
from megalite.planner.parameters import layer_parameters, rank_parameters
from megalite.planner.workload import Workload
from megalite.training.flops import activation_bytes_of_layer, mtp_activation_bytes

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
    fp8: float = 0.0
    """--fp8-format: delayed-scaling states and the quantization working set (planner/fp8.py)."""

    @property
    def total(self) -> float:
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.recompute + self.logits
                + self.fp8)


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


def layer_activation_bytes(workload: Workload, layout: Layout, recompute: str | None = None,
                           layer: int = -1) -> float:
    """Bytes transformer layer `layer` (global, from 0; -1 an attention layer) keeps for one
    micro-batch on one rank: a Gated DeltaNet layer's own (--linear-attention-freq)."""
    config = workload.config
    recompute = layout.recompute if recompute is None else recompute
    s, b, t = workload.seq_length // layout.cp, layout.micro_batch_size, layout.tp
    per_layer = activation_bytes_of_layer(config, layer, s, b, t, layout.sequence_parallel,
                                          None if recompute == "none" else recompute, workload.flash_attention)
    if recompute == "full" and layout.sequence_parallel:
        per_layer /= t
    return per_layer * workload.activation_bytes / 2


def layer_kinds(workload: Workload, layers: list[int]) -> dict[int, int]:
    """{a layer of each kind among `layers`: how many}: -1 for the attention layers, the first
    Gated DeltaNet one for those (all of a kind keep the same activations)."""
    gdn, num_layers = workload.config.gdn, workload.config.num_layers
    pattern = gdn.layer_pattern(num_layers) if gdn is not None else ()
    linear = [layer for layer in layers if layer < len(pattern) and pattern[layer]]
    kinds = {linear[0]: len(linear)} if linear else {}
    if len(linear) < len(layers):
        kinds[-1] = len(layers) - len(linear)
    return kinds


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
    if layout.fsdp2:  # the sharded gradients come into being in backward as activations are freed
        w, g = 4 * dense / shards, 0.0
    o = optimizer_state_bytes(workload, layout, rank, dense, expert)  # per --optimizer (planner/optimizer.py)
    m = layout.num_microbatches(workload.global_batch_size)
    held = held_chunk_activations(layout.schedule, p, rank, m, v)
    # the rank's layers over its chunks (--account-for-*-in-pipeline-split: fewer on the first / last),
    # each by its kind (attention or Gated DeltaNet)
    layers = [layer for c in range(v) for layer in stage_layers(config.num_layers, p, rank, c, v, **split)]
    kinds = layer_kinds(workload, layers)
    activations = held * sum(count * layer_activation_bytes(workload, layout, layer=kind)
                             for kind, count in kinds.items()) / v
    recompute = max(layer_activation_bytes(workload, layout, "none", kind) for kind in kinds or [-1]) \
        if layout.recompute == "full" else 0.0
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
    if layout.fsdp2:
        root, accumulated, logits, recompute = fsdp2_extras(workload, layout, dense, m, recompute)
        w, g = w + root, g + accumulated
    fp8 = fp8_memory_bytes(workload, layout, layers)
    return RankMemory(rank, w, g, o, activations, recompute, logits, dense + expert, held / v, fp8)


def fsdp2_extras(workload: Workload, layout: Layout, params: int, m: int,
                 recompute: float) -> tuple[float, float, float, float]:
    """(unsharded root parameters, accumulated unsharded gradients, logits, backward's working set
    beyond the logits) of an FSDP2 rank holding `params` parameters (its TP shard, unsharded)."""
    config, t, compute = workload.config, layout.tp, workload.activation_bytes
    tokens, local_vocab = workload.seq_length // layout.cp * layout.micro_batch_size, config.padded_vocab_size(t) // t
    # the loss's gradient overwrites the 16-bit logits, one fp32 row chunk at a time
    # (megalite.kernels.cross_entropy_torch; the Triton kernel on a GPU needs no chunk)
    chunk = min(tokens, max(1, TORCH_CHUNK_ELEMENTS // local_vocab)) * local_vocab
    logits = tokens * local_vocab * compute + chunk * (4 + compute)
    vocab = config.padded_vocab_size(t) // t * config.hidden_size
    root = vocab * (2 if config.untie_embeddings_and_output_weights else 1) + config.hidden_size
    if config.position_embedding_type == "learned_absolute":
        root += config.max_position_embeddings * config.hidden_size
    accumulated = 4 * params if m > 1 else 0.0
    layer = max(layer_parameters(config, i, t)[0] for i in range(config.num_layers))
    # under accumulation the output layer's gradient and the reduce-scatter input add to the
    # accumulated fp32 gradients already counted
    backward = recompute + layer * 3 * compute + (compute * vocab + 4 * layer if m == 1 else 0.0)
    return compute * root, accumulated, logits, max(0.0, backward - logits)


def peak_memory(workload: Workload, layout: Layout) -> RankMemory:
    """The pipeline rank with the largest predicted total: the first and last stages (every
    stage for MoE models, whose layer pattern can make a middle stage the largest, and where
    --account-for-*-in-pipeline-split gives the first / last stage a layer fewer)."""
    p = layout.pp
    ranks = range(p) if workload.is_moe or workload.accounts_in_split else sorted({0, p - 1})
    return max((rank_memory(workload, layout, r) for r in ranks), key=lambda mem: mem.total)
