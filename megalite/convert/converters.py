"""The three conversions, each streaming one tensor at a time and publishing atomically.

    hf_to_megalite(hf_dir, save_dir, TargetLayout(tp, pp, vp))
    megalite_to_hf(load_dir, save_dir, max_shard_bytes)
    megalite_to_megalite(load_dir, save_dir, TargetLayout(tp, pp, vp))

Each returns a Summary. Peak memory is about the largest tensor (plus the pieces a fused
tensor is built from), never the model.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megalite.checkpoint.dcp.writer import StreamingDCPWriter
from megalite.checkpoint.hf.reader import HFCheckpoint
from megalite.convert.hints import args_dict, training_flags
from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
from megalite.checkpoint.publish import ConversionError, staged_output
from megalite.checkpoint.hf.safetensors_io import SafetensorsWriter, plan_shards
from megalite.checkpoint.dcp.target_layout import TargetLayout, TensorPlacement
from megalite.convert.tokenizer_files import (
    copy_hf_tokenizer, export_tokenizer, relocate_tokenizer, resolved_entry, tokenizer_eod,
)
from megalite.checkpoint.hf import mapping as hf_mapping
from megalite.checkpoint.dcp.format import and_more
from megalite.checkpoint.dcp.checkpoint import TRACKER, iteration_dir, write_text_atomic

PARAMS_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class Summary:
    """What a conversion wrote."""

    output: Path
    tensors: int = 0
    bytes: int = 0
    largest_bytes: int = 0
    dtype: torch.dtype | None = None  # of the first (embedding) tensor
    config: object = None
    flags: list = field(default_factory=list)
    tokenizer: dict | None = None
    notes: list = field(default_factory=list)

    def count(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.tensors += 1
        self.bytes += nbytes
        self.largest_bytes = max(self.largest_bytes, nbytes)
        self.dtype = self.dtype or tensor.dtype


def _meta_getter(spec):
    """A getter for hf_mapping that returns meta tensors of `spec(name)`'s (shape, dtype): the
    mapping runs over names, shapes and dtypes without any tensor data being read."""
    def meta(name: str) -> torch.Tensor:
        shape, dtype = spec(name)
        return torch.empty(shape, dtype=dtype, device="meta")
    return meta


def _stream_to_dcp(writer: StreamingDCPWriter, placement: TensorPlacement, tensors, summary: Summary):
    try:
        for key, tensor in tensors:
            writer.add(key, tensor, placement.chunks(key, tensor.shape))
            summary.count(tensor)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _publish_checkpoint(staging: Path, iteration: int, digests: dict, common: dict) -> None:
    """common.json (with the file digests) in the iteration folder, then the tracker file."""
    folder = iteration_dir(staging, iteration)
    common = {**common, "iteration": iteration, "files": digests}
    write_text_atomic(folder / "common.json", json.dumps(common, indent=1, sort_keys=True))
    write_text_atomic(staging / TRACKER, str(iteration))


def _vocab_note(tokenizer: dict, config) -> str | None:
    _, size = tokenizer_eod(tokenizer)
    if size is not None and size != config.vocab_size:
        return (f"the tokenizer has {size} tokens but the model's vocabulary is {config.vocab_size}; megalite "
                f"sizes the embedding from the tokenizer, so loading needs a tokenizer of {config.vocab_size}")
    return None


def hf_to_megalite(load_dir, save_dir, layout: TargetLayout) -> Summary:
    """A Hugging Face GPT-2 / Llama directory -> a megalite checkpoint (iteration 0) at `layout`."""
    source = HFCheckpoint(load_dir)
    placement = TensorPlacement(source.config, layout)
    final = Path(save_dir).absolute()
    summary = Summary(final)
    for _ in hf_mapping.hf_to_megalite(_meta_getter(source.spec), source.config):
        pass  # pass 1: which stored tensors the mapping reads, before anything is written
    # A stored tensor megalite has no place for is a part of the model it lacks (q/k norms, say):
    # converting without it would give a model that computes something else.
    unused = source.unused()
    if unused:
        raise ConversionError(f"{source.files[unused[0]]}: tensor {unused[0]} has no place in megalite's "
                              f"{source.hf_config.get('model_type')} model{and_more(unused)}")
    with staged_output(final) as staging:
        stream = ((f"model/{name}", t) for name, t in hf_mapping.hf_to_megalite(source.get, source.config))
        files = _stream_to_dcp(StreamingDCPWriter(iteration_dir(staging, 0)), placement, stream, summary)
        config = source.config.replace(params_dtype=PARAMS_DTYPES.get(summary.dtype, "float32"))
        tokenizer = copy_hf_tokenizer(source.dir, staging, final)
        flags = training_flags(config, layout, tokenizer, final)
        common = {"consumed_train_samples": 0, "consumed_valid_samples": 0, "model_config": config.to_dict(),
                  "tokenizer": tokenizer, "layout": layout.as_dict(), "args": args_dict(flags),
                  "converted_from": {"format": "huggingface", "path": str(source.dir.absolute()),
                                     "architectures": source.hf_config.get("architectures")}}
        _publish_checkpoint(staging, 0, files, common)
    summary.config, summary.flags, summary.tokenizer = config, flags, tokenizer
    note = _vocab_note(tokenizer, config)
    if note:
        summary.notes.append(note)
    return summary


def _relayout_args(args: dict | None, layout: TargetLayout, tokenizer: dict, config, final: Path) -> dict:
    """The source run's arguments with the new layout (derived values are recomputed by the
    next run)."""
    if not args:
        return args_dict(training_flags(config, layout, tokenizer, final))
    args = dict(args)
    args.update(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                num_virtual_stages_per_pipeline_rank=layout.vp if layout.vp > 1 else None,
                num_layers_per_virtual_pipeline_stage=None, virtual_pipeline_model_parallel_size=layout.vp,
                decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
                world_size=None, data_parallel_size=None, num_micro_batches=None,
                tokenizer_type=tokenizer.get("type"), tokenizer_model=tokenizer.get("model"),
                vocab_file=tokenizer.get("vocab_file"), merge_file=tokenizer.get("merge_file"))
    if layout.tp == 1:
        args["sequence_parallel"] = False
    if layout.vp == 1 and args.get("pipeline_schedule") == "interleaved_1f1b":
        args["pipeline_schedule"] = None
    return args


def megalite_to_megalite(load_dir, save_dir, layout: TargetLayout, iteration: int | None = None) -> Summary:
    """A megalite checkpoint -> the same checkpoint (model and optimizer state, iteration,
    scheduler) as a run at `layout` writes it. RNG states are per rank and not carried over."""
    source = MegaliteCheckpoint(load_dir, iteration)
    config = source.config
    placement = TensorPlacement(config, layout)
    final = Path(save_dir).absolute()
    summary = Summary(final, config=config)
    with staged_output(final) as staging:
        stream = ((key, source.get(key)) for key in source.keys())
        files = _stream_to_dcp(StreamingDCPWriter(iteration_dir(staging, source.iteration)), placement, stream, summary)
        tokenizer, missing = relocate_tokenizer(source.common.get("tokenizer"), source.root, staging, final)
        common = {k: v for k, v in source.common.items() if k not in ("files", "layout", "path", "iteration")}
        common.update(layout=layout.as_dict(), tokenizer=tokenizer,
                      args=_relayout_args(source.common.get("args"), layout, tokenizer, config, final),
                      converted_from={"format": "megalite", "path": str(source.path.absolute()),
                                      "layout": source.common.get("layout")})
        _publish_checkpoint(staging, source.iteration, files, common)
    summary.flags = training_flags(config, layout, tokenizer, final)
    summary.tokenizer = tokenizer
    summary.notes += [f"tokenizer file {m} not found: not copied" for m in missing]
    return summary


def _hf_config(config, dtype: torch.dtype, eod: int | None) -> dict:
    try:
        out = hf_mapping.hf_config_dict(config)
    except ValueError as e:
        raise ConversionError(f"the checkpoint's model cannot be a Hugging Face model: {e}") from None
    out["torch_dtype"] = str(dtype).removeprefix("torch.")
    if out["model_type"] == "gpt2":  # transformers' GPT-2 default, 50256, may lie outside the vocabulary
        out["bos_token_id"] = out["eos_token_id"] = eod
    elif eod is not None:
        out["eos_token_id"] = eod
    return out


def write_hf_weights(staging: Path, specs, stream, max_shard_bytes: int, summary: Summary) -> None:
    """Write the (name, tensor) `stream`, whose names, shapes and dtypes `specs` lists in order,
    as Hugging Face safetensors shards of at most `max_shard_bytes` (with their index when there
    are several) under `staging`, one tensor in memory at a time."""
    shards = plan_shards(specs, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for file_name, shard in zip(names, shards):
        writer = SafetensorsWriter(staging / file_name, shard)
        for _ in shard:
            name, tensor = next(stream)
            writer.write(name, tensor)
            summary.count(tensor)
            weight_map[name] = file_name
        writer.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": summary.bytes}, "weight_map": weight_map}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def megalite_to_hf(load_dir, save_dir, max_shard_bytes: int = 5 * 10**9, iteration: int | None = None) -> Summary:
    """A megalite checkpoint -> a transformers directory: config.json, safetensors (sharded
    with model.safetensors.index.json beyond `max_shard_bytes`) and the tokenizer files."""
    source = MegaliteCheckpoint(load_dir, iteration)
    config = source.config
    meta = _meta_getter(lambda name: source.spec(f"model/{name}"))  # pass 1: names, shapes and dtypes
    try:
        specs = [(name, tuple(t.shape), t.dtype) for name, t in hf_mapping.megalite_to_hf(meta, config)]
    except ValueError as e:
        raise ConversionError(f"the checkpoint's model cannot be a Hugging Face model: {e}") from None
    # A model tensor the mapping never read would be silently dropped: the exported model would
    # compute something else.
    unused = source.unused()
    if unused:
        raise ConversionError(f"{source.path}: model tensor {unused[0].removeprefix('model/')} has no place in the "
                              f"Hugging Face {hf_mapping.family_of(config)} model{and_more(unused)}")
    final = Path(save_dir).absolute()
    summary = Summary(final, config=config)
    with staged_output(final) as staging:
        write_hf_weights(staging, specs, hf_mapping.megalite_to_hf(source.get_model, config), max_shard_bytes,
                         summary)
        entry = source.common.get("tokenizer") or {}
        copied, missing = export_tokenizer(entry, source.root, staging)
        eod, _ = tokenizer_eod(resolved_entry(entry, source.root), (source.common.get("args") or {}).get("vocab_size"))
        (staging / "config.json").write_text(json.dumps(_hf_config(config, summary.dtype, eod), indent=1))
    summary.notes += [f"tokenizer files copied: {', '.join(copied)}"] if copied else []
    summary.notes += [f"tokenizer file {m} not found: not copied" for m in missing]
    return summary
