"""Megatron-LM's data flags beyond --data-path and --split.

Names and defaults are Megatron-LM's. --data-args-path and --per-split-data-args-path are read
by `apply_megatron_data_args` (called from validate_args): their contents become
--data-path, or --train/valid/test-data-path, exactly as Megatron reads them.
"""

import json
from dataclasses import dataclass

from megalite.config.field import arg

SPLITS = ("train", "valid", "test")


@dataclass
class MegatronDataArgs:
    """Megatron's data options."""

    no_mmap_bin_files: bool = arg(
        False, "Read each dataset's .bin file into memory instead of memory-mapping it.")
    no_create_attention_mask_in_dataloader: bool = arg(
        False, "Build no attention mask in the data loader (causal attention needs none).")
    num_dataset_builder_threads: int = arg(1, "Threads per rank that open and index the datasets.")
    mid_level_dataset_surplus: float = arg(
        0.005, "Extra fraction of samples Megatron builds for each blended component dataset.")
    data_args_path: str | None = arg(
        None, "File holding the --data-path value (weights and prefixes separated by white space).")
    per_split_data_args_path: str | None = arg(
        None, "JSON file {\"train\": ..., \"valid\": ..., \"test\": ...} holding the "
        "--train/valid/test-data-path values (a string or a list each).")


def _read(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read it ({error.strerror})") from None


def _per_split_paths(path: str) -> dict:
    text = _read("--per-split-data-args-path", path)
    try:
        data = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{path}:{getattr(error, 'lineno', 1)}: not valid JSON "
                         f"({getattr(error, 'msg', error)})") from None
    if not isinstance(data, dict) or any(k not in data for k in SPLITS):
        raise ValueError(f"{path}: expected a JSON object with keys train, valid and test")
    out = {}
    for split in SPLITS:
        value = data[split]
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise ValueError(f"{path}: key '{split}' must be a string or a list of weights and prefixes")
        out[split] = [str(v) for v in value] or None
    return out


def apply_megatron_data_args(args, fail) -> None:
    """Fill --data-path / --train/valid/test-data-path from the files Megatron's flags name."""
    if args.data_args_path is not None:
        values = _read("--data-args-path", args.data_args_path).split()
        if not values:
            fail(f"--data-args-path {args.data_args_path}: the file is empty")
        if args.data_path is not None and args.data_path != values:
            fail("--data-path and --data-args-path contradict each other (give one)")
        args.data_path = values
    if args.per_split_data_args_path is not None:
        paths = _per_split_paths(args.per_split_data_args_path)
        for split in SPLITS:
            name = f"{split}_data_path"
            given = getattr(args, name)
            if given is not None and given != paths[split]:
                fail(f"--{split}-data-path and --per-split-data-args-path contradict each other (give one)")
            setattr(args, name, paths[split])
    if args.num_dataset_builder_threads <= 0:
        fail(f"--num-dataset-builder-threads must be positive, got {args.num_dataset_builder_threads}")
    if args.mid_level_dataset_surplus < 0:
        fail(f"--mid-level-dataset-surplus must not be negative, got {args.mid_level_dataset_surplus}")
    if args.no_create_attention_mask_in_dataloader and args.reset_attention_mask:
        fail("--no-create-attention-mask-in-dataloader and --reset-attention-mask contradict each other "
             "(the document mask is built in the data loader)")


def megatron_data_notes(args) -> list[str]:
    notes = []
    if args.no_create_attention_mask_in_dataloader:
        notes.append("--no-create-attention-mask-in-dataloader: megalite's data loader builds a mask "
                     "only for --reset-attention-mask; causal attention is the kernel's own (is_causal)")
    if args.num_dataset_builder_threads != 1:
        notes.append(f"--num-dataset-builder-threads {args.num_dataset_builder_threads}: megalite opens "
                     "datasets with memory maps and builds their indexes with vectorised numpy in one "
                     "thread; the datasets are the same")
    if args.mid_level_dataset_surplus != 0.005:
        notes.append("--mid-level-dataset-surplus: megalite's blend computes exactly how many samples it "
                     "draws from each dataset and builds those, so no surplus is needed")
    return notes
