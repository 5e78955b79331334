"""--pipeline-model-parallel-layout as Megatron's arguments take it: the virtual stage count is the
layout's stage count / PP, the flag excludes every other way of splitting the layers, and the string is
checked as Megatron-Core checks it (parallel.pipeline.layout_string)."""

from megalite.parallel.pipeline.layout_string import (LayoutError, build_layout, decoder_layers_per_virtual_stage,
                                                      validate_layout)

LAYOUT_FLAG = "--pipeline-model-parallel-layout"
_OTHER_SPLITS = ("num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
                 "account_for_loss_in_pipeline_split")


def layout_counts(args) -> list[int] | None:
    """Decoder layers of every global virtual stage (stage_layout's order), or None without the flag."""
    if args.pipeline_model_parallel_layout is None:
        return None
    layout = build_layout(args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size)
    validate_layout(layout, args.num_layers, args.mtp_num_layers)
    return decoder_layers_per_virtual_stage(layout)


def apply_pipeline_layout(args, fail) -> None:
    """Refuse the other split flags, check the string, and set the virtual stages it gives (None at 1),
    as Megatron sets its virtual pipeline size from the layout."""
    if args.pipeline_model_parallel_layout is None:
        return
    given = [name for name in _OTHER_SPLITS if getattr(args, name)]
    if args.num_virtual_stages_per_pipeline_rank is not None and not args.virtual_stages_from_layout:
        given.append("num_virtual_stages_per_pipeline_rank")
    if given:
        fail(f"{LAYOUT_FLAG} and --{given[0].replace('_', '-')} contradict each other (the layout places every "
             "layer and sets the virtual stages; give one)")
    try:
        counts = layout_counts(args)
    except LayoutError as error:
        fail(str(error))
    virtual = len(counts) // args.pipeline_model_parallel_size
    args.num_virtual_stages_per_pipeline_rank = virtual if virtual > 1 else None
    args.virtual_stages_from_layout = True
