"""Which pipeline stages a dry run measures: one rank of every distinct stage.

Two pipeline stages hold the same memory at every moment of a step when everything a rank's
iteration depends on is the same for both: the layers of each chunk (their count, and per
layer what differs between layers: context-parallel comm type, dense or MoE), whether the
stage holds the first or the last virtual stage (embedding, output layer, data), its schedule
(the ordered actions, which encode how many micro-batches are in flight) and, on the fake
CUDA device, after which of its own compute actions each send is freed (pipeline_sends.py).
`stage_signature` is that tuple; stages with equal signatures are one distinct stage and the
dry run measures its lowest pipeline rank (tests/dryrun/test_dry_run_stages.py measures every
stage of a layout and checks that the members of each group measure the same).

Layer counts alone do not make two stages equal: under 1F1B a lower pipeline rank keeps more
micro-batches in flight, so Llama-3 405B's middle stages (8 layers each) differ from each
other where their warm-up differs.
"""

from megalite.dryrun.pipeline_sends import send_completion_times
from megalite.parallel.pipeline.schedules import schedule_actions
from megalite.parallel.pipeline.stage_layout import stage_layers
from megalite.config.megatron.training import interleaved_group_size, split_accounting


def _send_release_points(args, p: int, v: int, rank: int) -> tuple:
    """Per send of `rank`, in list order, the index of the compute action before whose poll
    ScheduledSendsP2P frees it (len(computes): held to the step's end)."""
    done, starts = send_completion_times(args.pipeline_schedule, p, args.num_micro_batches, v,
                                         interleaved_group_size(args), args.recompute_granularity == "full", rank)
    sends = [a for a in schedule_actions(args.pipeline_schedule, p, rank, args.num_micro_batches, v,
                                         interleaved_group_size(args)) if a.is_send]
    return tuple(next((k for k, start in enumerate(starts) if start >= done[a]), len(starts)) for a in sends)


def stage_signature(args, config, p: int, v: int, rank: int, device_type: str) -> tuple:
    """What pipeline rank `rank`'s memory in a dry-run iteration is a function of (module
    docstring); `config` the run's GPTConfig, `args` validated."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    chunks = []
    for c in range(v):
        layers = stage_layers(config.num_layers, p, rank, c, v, first, last, **split_accounting(args))
        chunks.append(tuple((config.cp_comm_type_for(n),
                             config.moe is not None and config.moe.is_moe_layer(n, config.num_layers))
                            for n in layers))
    actions = tuple(schedule_actions(args.pipeline_schedule, p, rank, args.num_micro_batches, v,
                                     interleaved_group_size(args)))
    sends = _send_release_points(args, p, v, rank) if p > 1 and device_type != "cpu" else ()
    return (tuple(chunks), rank == 0, rank == p - 1, actions, sends)


def distinct_stages(args, config, layout, device_type: str) -> list[list[int]]:
    """The pipeline ranks grouped by stage_signature, each group in rank order, the groups in
    the order of their first rank (measure group[0] for all of them)."""
    groups: dict[tuple, list[int]] = {}
    for rank in range(layout.pipeline):
        signature = stage_signature(args, config, layout.pipeline, layout.virtual_pipeline, rank, device_type)
        groups.setdefault(signature, []).append(rank)
    return sorted(groups.values())


def every_stage(layout) -> list[list[int]]:
    """--dry-run-all-stages: every pipeline rank measured, each standing for itself."""
    return [[s] for s in range(layout.pipeline)]


def first_middle_last(layout) -> list[int]:
    """Pipeline ranks 0, p // 2 and p - 1 (tools/plan.py --verify's check on its finalists)."""
    p = layout.pipeline
    return sorted({0, p // 2, p - 1})


def stage_name(pp_ranks: list[int]) -> str:
    """'stage 3' or 'stages 1-7'."""
    return f"stage{'s' if len(pp_ranks) > 1 else ''} {stage_label(pp_ranks)}"


def stage_label(pp_ranks: list[int]) -> str:
    """'3', '1-7' or '1-3, 5' for the pipeline ranks a measured stage stands for."""
    runs, start = [], pp_ranks[0]
    for previous, current in zip(pp_ranks, pp_ranks[1:] + [None]):
        if current != previous + 1:
            runs.append(str(start) if start == previous else f"{start}-{previous}")
            start = current
    return ", ".join(runs)
