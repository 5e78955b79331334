"""Command line of tools/checkpoint/convert.py (Megatron's converter flag names).

    python tools/checkpoint/convert.py --loader hf --saver megalite --load-dir HF_DIR --save-dir OUT \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    python tools/checkpoint/convert.py --loader megalite --saver hf --load-dir CKPT --save-dir HF_OUT
    python tools/checkpoint/convert.py --loader megalite --saver megalite --load-dir CKPT --save-dir OUT \\
        --target-tensor-parallel-size 4
    python tools/checkpoint/convert.py --loader megatron --saver {megalite,hf} --load-dir MEGATRON_SAVE --save-dir OUT
    python tools/checkpoint/convert.py --loader hf --saver megalite --load-dir MIXTRAL_DIR --save-dir OUT \\
        --target-tensor-parallel-size 2 --target-expert-parallel-size 2 --target-expert-tensor-parallel-size 1

Exit status 0 on success; 2 with one line on stderr naming the file, tensor, flag or config
field for bad input (nothing is then left under --save-dir).
"""

import argparse
import ctypes
import sys

from megalite.convert.converters import hf_to_megalite, megalite_to_hf, megalite_to_megalite
from megalite.convert.hints import hint_text
from megalite.checkpoint.megalite_reader import read_common
from megalite.convert.megatron_converters import megatron_to_hf, megatron_to_megalite
from megalite.checkpoint.publish import ConversionError
from megalite.checkpoint.hf.safetensors_io import parse_size
from megalite.checkpoint.dcp.target_layout import TargetLayout
from megalite.checkpoint.dcp.format import CheckpointError
from megalite.checkpoint.detect import LOADERS, checkpoint_kind


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConversionError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tools/checkpoint/convert.py", description="Convert GPT checkpoints between Hugging Face "
                "transformers and megalite, and between megalite parallel layouts, on CPU.")
    p.add_argument("--loader", required=True, choices=("hf", "megalite", "megatron"),
                   help="format of --load-dir (megatron: a Megatron-LM --save directory, torch or torch_dist)")
    p.add_argument("--saver", required=True, choices=("hf", "megalite"), help="format to write to --save-dir")
    p.add_argument("--load-dir", required=True, help="Hugging Face model directory or megalite --save directory")
    p.add_argument("--save-dir", required=True, help="output directory (must not exist, or be empty)")
    p.add_argument("--target-tensor-parallel-size", type=int,
                   help="TP size of the megalite checkpoint (default: 1 from hf, the source's from megalite)")
    p.add_argument("--target-pipeline-parallel-size", type=int,
                   help="PP size of the megalite checkpoint (default: 1 from hf, the source's from megalite)")
    p.add_argument("--target-num-virtual-stages", type=int,
                   help="virtual pipeline stages per PP rank (default: 1 from hf, the source's from megalite)")
    p.add_argument("--target-expert-parallel-size", type=int,
                   help="MoE models: expert-parallel size of the megalite checkpoint (default: 1 from hf and "
                        "megatron, the source's from megalite)")
    p.add_argument("--target-expert-tensor-parallel-size", type=int,
                   help="MoE models: ranks each expert's weights are split over (default: the target TP size, "
                        "or the source's where TP is unchanged)")
    p.add_argument("--iteration", type=int, help="megalite loader: this iteration instead of the latest")
    p.add_argument("--max-shard-size", default="5GB", help="hf saver: safetensors shard size (default 5GB)")
    p.add_argument("--model-type", choices=("GPT",), default="GPT", help="accepted for Megatron scripts (GPT only)")
    return p


def _target(args, source_layout: dict | None, source_args: dict | None = None) -> TargetLayout:
    """The target layout: the flags given (0 and negative sizes too, refused by TargetLayout),
    else the source's (a megalite checkpoint's layout and run arguments), else one rank."""
    source_layout, source_args = source_layout or {}, source_args or {}

    def given(value, default):
        return default if value is None else value

    tp = given(args.target_tensor_parallel_size, source_layout.get("tp", 1))
    pp = given(args.target_pipeline_parallel_size, source_layout.get("pp", 1))
    vp = given(args.target_num_virtual_stages, source_layout.get("vp", 1) if pp == source_layout.get("pp") else 1)
    ep = given(args.target_expert_parallel_size, source_args.get("expert_model_parallel_size") or 1)
    etp = given(args.target_expert_tensor_parallel_size,
                source_args.get("expert_tensor_parallel_size") if tp == source_layout.get("tp") else None)
    return TargetLayout(tp, pp, vp, ep, etp)


def convert(args) -> list[str]:
    """Run the conversion `args` asks for; the lines to print."""
    kind = checkpoint_kind(args.load_dir)
    if kind is not None and LOADERS[kind] != args.loader:
        raise ConversionError(f"--loader {args.loader}: {args.load_dir} is a {kind} checkpoint "
                              f"(use --loader {LOADERS[kind]})")
    if args.loader == "hf" and args.saver == "hf":
        raise ConversionError("--loader hf --saver hf: nothing to convert (one side must be megalite)")
    if args.loader == "megatron" and args.iteration is not None:
        raise ConversionError("--iteration: the megatron loader reads the iteration latest_checkpointed_iteration.txt names")
    if args.saver == "hf":
        if any(v is not None for v in (args.target_tensor_parallel_size, args.target_pipeline_parallel_size,
                                       args.target_num_virtual_stages, args.target_expert_parallel_size,
                                       args.target_expert_tensor_parallel_size)):
            raise ConversionError("--target-* sizes apply to --saver megalite only")
        if args.loader == "megatron":
            summary = megatron_to_hf(args.load_dir, args.save_dir, parse_size(args.max_shard_size))
        else:
            summary = megalite_to_hf(args.load_dir, args.save_dir, parse_size(args.max_shard_size), args.iteration)
        lines = [f"wrote {summary.tensors} tensors ({summary.bytes / 2**20:.1f} MiB) to {summary.output}"]
        return lines + [f"  {n}" for n in summary.notes]
    if args.loader in ("hf", "megatron"):
        layout = _target(args, None)
        convert_to = hf_to_megalite if args.loader == "hf" else megatron_to_megalite
        summary = convert_to(args.load_dir, args.save_dir, layout)
    else:
        try:
            common, _ = read_common(args.load_dir, args.iteration)
        except CheckpointError as e:
            raise ConversionError(str(e)) from None
        layout = _target(args, common.get("layout"), common.get("args"))
        summary = megalite_to_megalite(args.load_dir, args.save_dir, layout, args.iteration)
    where = f"at TP={layout.tp} PP={layout.pp}" + (f" VP={layout.vp}" if layout.vp > 1 else "")
    if summary.config is not None and summary.config.moe is not None:
        where += f" EP={layout.ep} ETP={layout.expert_tp}"
    lines = [f"wrote {summary.tensors} tensors ({summary.bytes / 2**20:.1f} MiB) to {summary.output} {where}"]
    lines += [f"  note: {n}" for n in summary.notes]
    return lines + [hint_text(summary.flags, layout)]


def return_freed_memory_to_the_os() -> None:
    """glibc raises its mmap threshold each time a large block is freed; from then on freed
    tensor buffers stay in the heap, fragmented, and the converter's resident memory creeps up
    by tens of megabytes. A fixed 1 MiB threshold hands every tensor-sized buffer back to the
    OS when it is freed, so peak memory stays near one tensor. No-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def main(argv=None) -> int:
    return_freed_memory_to_the_os()
    try:
        args = build_parser().parse_args(argv)
        lines = convert(args)
    except (ConversionError, CheckpointError) as error:
        print(f"convert: error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0
