"""tools/plan.py: which layout fits and which is fastest.

    python tools/plan.py --cluster a100 --num-gpus 1024 -- --num-layers 96 --hidden-size 12288 \\
        --num-attention-heads 96 --seq-length 2048 --global-batch-size 1536 --bf16 \\
        --tokenizer-type NullTokenizer --vocab-size 51199
    python tools/plan.py --cluster h100 --num-gpus 64 --hf-config llama3_8b/config.json \\
        --seq-length 8192 --global-batch-size 512
    python tools/plan.py --calibrate cpu8.json --world-size 8        # measure this machine
    python tools/plan.py --cluster cpu8.json -- --config model.yaml  # plan for it
    python tools/plan.py --cluster h200 --kernel-rates kernel_rates.json -- ...  # gpu_check.sh's rates

The model is given by pretrain_gpt's own flags after `--` (Megatron flags, or `--config` YAML)
or by --hf-config; the cluster by a preset (a100, h100, h200) with optional overrides, or by a
JSON file --calibrate wrote; on h100 and h200 megalite's kernels run at the rates measured on an
H200 (megalite/planner/cluster.py), or at those of --kernel-rates.
"""

import argparse
import json
import sys

from megalite.config.arguments import accept_negative_numbers
from megalite.planner.cluster import GIB, PRESETS, Cluster, KernelRates, preset
from megalite.planner.layouts import RECOMPUTE, Space
from megalite.planner.report import finalists, table
from megalite.planner.search import plan
from megalite.planner.workload import PRECISIONS, from_flags, from_hf_config


def _ints(flag):
    def parse(text):
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers, got {text!r}") from None
        if any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{flag} values must be positive, got {text!r}")
        return values
    return parse


def _choices(flag, allowed, mapping=None):
    def parse(text):
        values = text.split(",")
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{flag}: {', '.join(bad)} not in {', '.join(allowed)}")
        return [mapping[v] if mapping else v for v in values]
    return parse


def _positive(flag: str, most: float | None = None):
    """A number > 0 (and <= `most`); negative ones reach this check (accept_negative_numbers)."""
    def parse(text: str) -> float:
        value = float(text)
        if not value > 0 or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"{flag} must be > 0{f' and <= {most:g}' if most else ''}, got {text}")
        return value
    return parse


class _Parser(argparse.ArgumentParser):
    """Errors as one line (`plan.py: error: ...`, exit status 2), not argparse's usage block."""

    def error(self, message):
        self.exit(2, f"plan.py: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = accept_negative_numbers(_Parser(prog="plan.py", description=__doc__.split("\n\n")[0],
                                             formatter_class=argparse.RawDescriptionHelpFormatter))
    model = parser.add_argument_group("model (else pretrain_gpt's flags after --)")
    model.add_argument("--hf-config", help="a Hugging Face config.json")
    model.add_argument("--seq-length", type=int, help="sequence length (overrides the model's flags)")
    model.add_argument("--global-batch-size", type=int, help="sequences per step (overrides the model's flags)")
    model.add_argument("--precision", choices=PRECISIONS, default="bf16", help="with --hf-config (default bf16)")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--cluster", default="h100", help=f"a preset ({', '.join(PRESETS)}) or a --calibrate JSON")
    cluster.add_argument("--num-gpus", type=int, help="devices (default: the JSON's, or 8)")
    cluster.add_argument("--gpus-per-node", type=int)
    cluster.add_argument("--gpu-memory-gib", type=_positive("--gpu-memory-gib"))
    cluster.add_argument("--peak-tflops", type=_positive("--peak-tflops"), help="dense 16-bit peak per device")
    cluster.add_argument("--intra-node-gbps", type=_positive("--intra-node-gbps"), help="collective bus bandwidth in a node, GB/s per device")
    cluster.add_argument("--inter-node-gbps", type=_positive("--inter-node-gbps"), help="network bandwidth per device across nodes, GB/s")
    cluster.add_argument("--kernel-rates", metavar="FILE",
                         help="megalite's kernels as measured on the GPU: the kernel_rates.json gpu_check.sh writes")
    search = parser.add_argument_group("search space (comma-separated lists; default: every valid value)")
    search.add_argument("--tp", type=_ints("--tp"))
    search.add_argument("--pp", type=_ints("--pp"))
    search.add_argument("--vp", type=_ints("--vp"), help="virtual stages per pipeline rank")
    search.add_argument("--cp", type=_ints("--cp"), default=[1], help="context-parallel sizes (default 1)")
    search.add_argument("--ep", type=_ints("--ep"), help="expert-parallel sizes (MoE models)")
    search.add_argument("--micro-batch-size", type=_ints("--micro-batch-size"))
    search.add_argument("--recompute", type=_choices("--recompute", RECOMPUTE), default=list(RECOMPUTE))
    onoff = {"on": True, "off": False}
    search.add_argument("--sequence-parallel", type=_choices("--sequence-parallel", onoff, onoff), default=[False, True])
    search.add_argument("--distributed-optimizer", type=_choices("--distributed-optimizer", onoff, onoff),
                        default=[False, True])
    search.add_argument("--fsdp2", type=_choices("--fsdp2", onoff, onoff), default=[False, True],
                        help="--use-torch-fsdp2 (ZeRO-3) layouts: on, off or on,off (default; PP 1, dense models)")
    search.add_argument("--schedules", type=_choices("--schedules", ("default", "zb_h1")), default=["default"])
    search.add_argument("--memory-fraction", type=_positive("--memory-fraction", 1.0), default=0.9,
                        help="share of device memory a layout may fill (default 0.9)")
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="layouts in the table (default 10)")
    out.add_argument("--simulate", type=int, default=48, help="layouts run through the schedule simulator")
    out.add_argument("--finalists", type=int, default=3, help="layouts printed as launch flags (default 3)")
    out.add_argument("--verify", action="store_true",
                     help="dry-run the finalists (megalite.dryrun), print measured beside predicted memory and "
                          "replace a finalist measured over the memory limit by the next layout")
    out.add_argument("--json", help="write the ranked predictions to this file")
    calibrate = parser.add_argument_group("calibration")
    calibrate.add_argument("--calibrate", metavar="OUT.json", help="measure this machine and write a cluster file")
    calibrate.add_argument("--world-size", type=int, default=8, help="processes to calibrate for (default 8)")
    return parser


def load_cluster(args) -> Cluster:
    cluster = _cluster(args)
    if args.kernel_rates:
        cluster = cluster.replace(kernels=KernelRates.load(args.kernel_rates))
    return cluster


def _cluster(args) -> Cluster:
    if args.cluster.endswith(".json"):
        cluster = Cluster.load(args.cluster)
        changes = {"num_gpus": args.num_gpus, "gpus_per_node": args.gpus_per_node}
        return cluster.replace(**{k: v for k, v in changes.items() if v is not None})
    gbps = {k: None if v is None else v * 1e9 for k, v in
            (("intra_node_bandwidth", args.intra_node_gbps), ("inter_node_bandwidth", args.inter_node_gbps))}
    return preset(args.cluster, args.num_gpus or 8, gpus_per_node=args.gpus_per_node,
                  memory_bytes=None if args.gpu_memory_gib is None else args.gpu_memory_gib * GIB,
                  peak_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12, **gbps)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, model_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = build_parser()
    args = parser.parse_args(own)
    try:
        if args.calibrate:
            from megalite.planner.calibrate import calibrate
            cluster = calibrate(args.world_size)
            cluster.save(args.calibrate)
            print(f"plan.py: wrote {args.calibrate}: {cluster.source}")
            return 0
        if args.hf_config and model_flags:
            raise ValueError("give the model either as --hf-config or as flags after --, not both")
        if args.hf_config:
            workload = from_hf_config(args.hf_config, args.seq_length, args.global_batch_size, args.precision)
        elif model_flags:
            workload = from_flags(model_flags, args.seq_length, args.global_batch_size)
        else:
            raise ValueError("no model: give --hf-config, or pretrain_gpt's model flags after --")
        cluster = load_cluster(args)
        space = Space(tp=args.tp, pp=args.pp, vp=args.vp, cp=args.cp, ep=args.ep,
                      micro_batch_size=args.micro_batch_size, sequence_parallel=args.sequence_parallel,
                      recompute=args.recompute, distributed_optimizer=args.distributed_optimizer,
                      fsdp2=args.fsdp2, schedules=args.schedules)
        result = plan(workload, cluster, space, args.memory_fraction, args.simulate)
    except ValueError as error:
        print(f"plan.py: error: {error}", file=sys.stderr)
        return 2
    print(table(result, args.top))
    confirmed = None
    if args.verify and result.ranked:
        from megalite.planner.verify import verify
        confirmed, report = verify(result, args.finalists)
        print()
        print(report)
    if result.ranked:
        print()
        print(finalists(result, args.finalists, confirmed))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump([{"layout": p.layout.short(), "flags": p.layout.flags(), "step_time": p.step_time,
                        "breakdown": p.breakdown, "memory_bytes": p.memory.total,
                        "tokens_per_second_per_gpu": p.tokens_per_second_per_gpu} for p in result.ranked],
                      handle, indent=1)
    return 0 if result.ranked and confirmed != [] else 1
