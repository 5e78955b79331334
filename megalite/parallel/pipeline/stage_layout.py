"""Which transformer layers each pipeline rank and chunk holds, checked before start-up.

As in Megatron, layers are cut into p*v consecutive blocks, one per global virtual stage, and
virtual stage s = c*p + r is local chunk c of pipeline rank r: chunk c of rank r holds the
(c*p + r)-th block. With p = 2, v = 2 and 8 layers:

    rank 0: chunk 0 = layers 0-1, chunk 1 = layers 4-5
    rank 1: chunk 0 = layers 2-3, chunk 1 = layers 6-7

--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers give pipeline rank 0
/ rank p-1 that many layers in total (split evenly over its v chunks); the remaining layers
are divided evenly over the other ranks and their chunks.

--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split with virtual
stages (`embedding_stage`, `loss_stage`), as Megatron-Core's get_num_layers_to_build and
get_transformer_layer_offset: the embedding and the loss count as one layer each, every virtual
stage gets (L + 1 [+ 1]) / (p*v) of them, and virtual stage 0 (rank 0, chunk 0) builds one
transformer layer fewer for the embedding, the last (rank p-1, chunk v-1) one fewer for the
loss; either may hold no transformer layer at all. (Without virtual stages megalite writes that
split as --decoder-first/last-pipeline-num-layers: config.megatron.training.) Layers keep their global numbers,
so a stage holding layers 8-15 still calls them layers.8 ... layers.15.
"""

from megalite.parallel.pipeline.schedules import default_schedule, validate_schedule

NUM_LAYERS_FLAG = "--num-layers"
PIPELINE_FLAG = "--pipeline-model-parallel-size"
VIRTUAL_FLAG = "--num-virtual-stages-per-pipeline-rank"
LAYERS_PER_VIRTUAL_FLAG = "--num-layers-per-virtual-pipeline-stage"
FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"


def _positive(flag: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")


def virtual_stages_per_rank(num_layers: int, pipeline_size: int,
                            num_layers_per_virtual_pipeline_stage: int | None = None,
                            num_virtual_stages_per_pipeline_rank: int | None = None,
                            uneven: bool = False) -> int:
    """v from either interleaving flag (at most one may be given; neither means v = 1).

    `uneven` says --decoder-first/last-pipeline-num-layers is in use, with which only the
    chunk count can be given (a fixed layer count per virtual stage would contradict it).
    """
    per_stage, chunks = num_layers_per_virtual_pipeline_stage, num_virtual_stages_per_pipeline_rank
    if per_stage is not None and chunks is not None:
        raise ValueError(f"{LAYERS_PER_VIRTUAL_FLAG} and {VIRTUAL_FLAG} contradict each other "
                         "(give one)")
    if chunks is not None:
        _positive(VIRTUAL_FLAG, chunks)
        return chunks
    if per_stage is None:
        return 1
    _positive(LAYERS_PER_VIRTUAL_FLAG, per_stage)
    if pipeline_size == 1:
        raise ValueError(f"{LAYERS_PER_VIRTUAL_FLAG} needs {PIPELINE_FLAG} > 1")
    if uneven:
        raise ValueError(f"{LAYERS_PER_VIRTUAL_FLAG} cannot be combined with {FIRST_FLAG} or "
                         f"{LAST_FLAG}; give {VIRTUAL_FLAG} instead")
    if num_layers % (pipeline_size * per_stage):
        raise ValueError(f"{NUM_LAYERS_FLAG} {num_layers} is not divisible by {PIPELINE_FLAG} "
                         f"{pipeline_size} x {LAYERS_PER_VIRTUAL_FLAG} {per_stage} = "
                         f"{pipeline_size * per_stage}")
    return num_layers // (pipeline_size * per_stage)


def _accounted_split(num_layers: int, p: int, v: int, embedding_stage: bool, loss_stage: bool) -> list[int]:
    counted = num_layers + embedding_stage + loss_stage
    named = " and ".join(flag for flag, on in ((EMBEDDING_FLAG, embedding_stage), (LOSS_FLAG, loss_stage)) if on)
    if counted % (p * v):
        raise ValueError(f"{named}: {NUM_LAYERS_FLAG} {num_layers} plus the accounted embedding/loss ({counted}) "
                         f"is not divisible by {PIPELINE_FLAG} {p} x {VIRTUAL_FLAG} {v} = {p * v} virtual stages")
    counts = [counted // (p * v)] * (p * v)
    counts[0] -= embedding_stage
    counts[-1] -= loss_stage
    if min(counts) < 0:
        raise ValueError(f"{named}: the first or last virtual stage would hold fewer than no transformer layers")
    return counts


def _checked_layout_counts(counts: list[int], num_layers: int, p: int, v: int, other_split: bool) -> list[int]:
    if other_split:
        raise ValueError(f"{LAYOUT_FLAG} and {FIRST_FLAG}/{LAST_FLAG}/{EMBEDDING_FLAG}/{LOSS_FLAG} contradict "
                         "each other (give one)")
    if len(counts) != p * v or sum(counts) != num_layers:
        raise ValueError(f"{LAYOUT_FLAG}: {len(counts)} stages with {sum(counts)} layers, expected {PIPELINE_FLAG} "
                         f"{p} x {VIRTUAL_FLAG} {v} stages with {NUM_LAYERS_FLAG} {num_layers}")
    return list(counts)


def layers_per_virtual_stage(num_layers: int, pipeline_size: int, num_chunks: int = 1,
                             first_stage_layers: int | None = None,
                             last_stage_layers: int | None = None, *,
                             embedding_stage: bool = False, loss_stage: bool = False,
                             layout_counts: list[int] | None = None) -> list[int]:
    """Number of layers of every global virtual stage s = c*p + r (index s), validated.
    `embedding_stage` / `loss_stage`: the --account-for-* split (module docstring);
    `layout_counts`: the counts a --pipeline-model-parallel-layout string gives
    (layout_string.decoder_layers_per_virtual_stage), checked against the other flags.

    Raises ValueError naming the flags when the layers cannot be divided as asked.
    """
    p, v = pipeline_size, num_chunks
    _positive(NUM_LAYERS_FLAG, num_layers)
    _positive(PIPELINE_FLAG, p)
    _positive(VIRTUAL_FLAG, v)
    if layout_counts is not None:
        return _checked_layout_counts(layout_counts, num_layers, p, v, first_stage_layers is not None
                                      or last_stage_layers is not None or embedding_stage or loss_stage)
    if embedding_stage or loss_stage:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise ValueError(f"{EMBEDDING_FLAG}/{LOSS_FLAG} and {FIRST_FLAG}/{LAST_FLAG} contradict each other "
                             "(give one)")
        return _accounted_split(num_layers, p, v, embedding_stage, loss_stage)
    given = [(flag, value) for flag, value in
             ((FIRST_FLAG, first_stage_layers), (LAST_FLAG, last_stage_layers)) if value is not None]
    if not given:
        if num_layers % (p * v):
            raise ValueError(
                f"{NUM_LAYERS_FLAG} {num_layers} is not divisible by {PIPELINE_FLAG} {p} x "
                f"{VIRTUAL_FLAG} {v} = {p * v} virtual pipeline stages; change the layer count or "
                f"set {FIRST_FLAG}/{LAST_FLAG}")
        return [num_layers // (p * v)] * (p * v)
    if p == 1:
        raise ValueError(f"{' and '.join(flag for flag, _ in given)} "
                         f"need{'s' if len(given) == 1 else ''} {PIPELINE_FLAG} > 1")
    middle_layers, middle_ranks = num_layers, p
    for flag, value in given:
        _positive(flag, value)
        if value % v:
            raise ValueError(f"{flag} {value} is not divisible by {VIRTUAL_FLAG} {v} (the stage's "
                             "layers are split evenly over its chunks)")
        middle_layers -= value
        middle_ranks -= 1
    named = " and ".join(f"{flag} {value}" for flag, value in given)
    if middle_layers < 0 or (middle_ranks == 0 and middle_layers > 0) or (
            middle_ranks > 0 and middle_layers == 0):
        raise ValueError(f"{named} leaves {middle_layers} of {NUM_LAYERS_FLAG} {num_layers} for "
                         f"the {middle_ranks} other pipeline rank(s) of {PIPELINE_FLAG} {p}; each "
                         "needs at least one layer per chunk, and no layer may be left over")
    if middle_ranks and middle_layers % (middle_ranks * v):
        raise ValueError(f"{NUM_LAYERS_FLAG} {num_layers} minus {named} leaves {middle_layers} "
                         f"layers, not divisible by the {middle_ranks} middle pipeline rank(s) x "
                         f"{VIRTUAL_FLAG} {v} = {middle_ranks * v} chunks")

    def rank_layers(rank: int) -> int:
        if rank == 0 and first_stage_layers is not None:
            return first_stage_layers
        if rank == p - 1 and last_stage_layers is not None:
            return last_stage_layers
        return middle_layers // middle_ranks

    return [rank_layers(s % p) // v for s in range(p * v)]


def stage_layers(num_layers: int, pipeline_size: int, rank: int, chunk: int = 0,
                 num_chunks: int = 1, first_stage_layers: int | None = None,
                 last_stage_layers: int | None = None, **accounting) -> range:
    """Global layer numbers held by local `chunk` of pipeline `rank` (`accounting`:
    embedding_stage / loss_stage, as layers_per_virtual_stage takes them)."""
    if not 0 <= rank < pipeline_size or not 0 <= chunk < num_chunks:
        raise ValueError(f"(rank {rank}, chunk {chunk}) outside {pipeline_size} ranks x "
                         f"{num_chunks} chunks")
    counts = layers_per_virtual_stage(num_layers, pipeline_size, num_chunks,
                                      first_stage_layers, last_stage_layers, **accounting)
    stage = chunk * pipeline_size + rank
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def layer_owners(num_layers: int, pipeline_size: int, num_chunks: int = 1,
                 first_stage_layers: int | None = None,
                 last_stage_layers: int | None = None, **accounting) -> list[tuple[int, int]]:
    """(pipeline rank, chunk) owning each global layer, indexed by layer number."""
    counts = layers_per_virtual_stage(num_layers, pipeline_size, num_chunks,
                                      first_stage_layers, last_stage_layers, **accounting)
    return [(stage % pipeline_size, stage // pipeline_size)
            for stage, count in enumerate(counts) for _ in range(count)]


def validate_pipeline(num_layers: int, pipeline_size: int, num_chunks: int, num_microbatches: int,
                      schedule: str | None = None, first_stage_layers: int | None = None,
                      last_stage_layers: int | None = None) -> str:
    """Every start-up check of a pipeline configuration (layer split, schedule, micro-batch
    count), each failing with a ValueError that names the flags. Returns the schedule to run:
    `schedule` (a --pipeline-schedule value), or Megatron's default when it is None."""
    layers_per_virtual_stage(num_layers, pipeline_size, num_chunks, first_stage_layers,
                             last_stage_layers)
    name = schedule if schedule is not None else default_schedule(pipeline_size, num_chunks)
    validate_schedule(name, pipeline_size, num_microbatches, num_chunks)
    return name
