"""Megatron-LM checkpoints (torch or torch_dist, any layout) to megalite and to Hugging Face,
streaming one full tensor at a time as the other converters do.

    megatron_to_megalite(load_dir, save_dir, TargetLayout(tp, pp, vp))
    megatron_to_hf(load_dir, save_dir, max_shard_bytes)

The model weights, the iteration and the consumed samples are carried over; Megatron's
optimizer state and RNG states are not (a run loading the result uses --no-load-optim or
--finetune, as with a converted Hugging Face model).
"""

import json
from pathlib import Path

from megalite.convert.converters import (
    PARAMS_DTYPES, Summary, _hf_config, _meta_getter, _publish_checkpoint, _stream_to_dcp, write_hf_weights,
)
from megalite.checkpoint.dcp.writer import StreamingDCPWriter
from megalite.convert.hints import args_dict, training_flags
from megalite.checkpoint.megatron.reader import MegatronCheckpoint
from megalite.checkpoint.publish import ConversionError, staged_output
from megalite.checkpoint.dcp.target_layout import TargetLayout, TensorPlacement
from megalite.convert.tokenizer_files import NO_TOKENIZER
from megalite.checkpoint.hf import mapping as hf_mapping
from megalite.checkpoint.dcp.format import CheckpointError
from megalite.checkpoint.dcp.checkpoint import iteration_dir


def _open(load_dir) -> MegatronCheckpoint:
    try:
        return MegatronCheckpoint(load_dir)
    except CheckpointError as e:
        raise ConversionError(str(e)) from None


def _tokenizer_entry(args) -> dict:
    """The Megatron run's tokenizer, paths as it gave them (not copied)."""
    entry = dict(NO_TOKENIZER)
    entry.update(type=getattr(args, "tokenizer_type", None), model=getattr(args, "tokenizer_model", None),
                 vocab_file=getattr(args, "vocab_file", None), merge_file=getattr(args, "merge_file", None))
    return entry


def _source_notes(source: MegatronCheckpoint) -> list[str]:
    return [f"read Megatron {source.format} checkpoint {source.path} (iteration {source.iteration}); "
            "its optimizer and RNG states are not converted", *source.notes]


def megatron_to_megalite(load_dir, save_dir, layout: TargetLayout) -> Summary:
    """A Megatron checkpoint -> a megalite checkpoint at `layout`, same iteration."""
    source = _open(load_dir)
    config = source.config
    placement = TensorPlacement(config, layout)
    source.check_all_used()  # pass 1: every tensor is there, and no stored one is left without a place
    final = Path(save_dir).absolute()
    summary = Summary(final, config=config)
    args = source.args
    with staged_output(final) as staging:
        stream = ((f"model/{name}", source.get(name)) for name in source.names())
        files = _stream_to_dcp(StreamingDCPWriter(iteration_dir(staging, source.iteration)), placement, stream, summary)
        config = config.replace(params_dtype=PARAMS_DTYPES.get(summary.dtype, "float32"))
        tokenizer = _tokenizer_entry(args)
        flags = training_flags(config, layout, tokenizer, final)
        common = {"consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
                  "consumed_valid_samples": int(getattr(args, "consumed_valid_samples", 0) or 0),
                  "model_config": config.to_dict(), "tokenizer": tokenizer, "layout": layout.as_dict(),
                  "args": args_dict(flags),
                  "converted_from": {"format": f"megatron-{source.format}", "path": str(source.root.absolute()),
                                     "iteration": source.iteration}}
        _publish_checkpoint(staging, source.iteration, files, common)
    summary.config, summary.flags, summary.tokenizer = config, flags, tokenizer
    summary.notes += _source_notes(source)
    return summary


def megatron_to_hf(load_dir, save_dir, max_shard_bytes: int = 5 * 10**9) -> Summary:
    """A Megatron checkpoint -> a transformers directory (config.json and safetensors)."""
    source = _open(load_dir)
    config = source.config
    meta = _meta_getter(source.spec)  # pass 1: names, shapes and dtypes, no tensor data
    try:
        specs = [(name, tuple(t.shape), t.dtype) for name, t in hf_mapping.megalite_to_hf(meta, config)]
    except ValueError as e:
        raise ConversionError(f"the checkpoint's model cannot be a Hugging Face model: {e}") from None
    source.check_all_used()
    final = Path(save_dir).absolute()
    summary = Summary(final, config=config)
    with staged_output(final) as staging:
        write_hf_weights(staging, specs, hf_mapping.megalite_to_hf(source.get, config), max_shard_bytes, summary)
        (staging / "config.json").write_text(json.dumps(_hf_config(config, summary.dtype, None), indent=1))
    summary.notes += _source_notes(source)
    return summary
