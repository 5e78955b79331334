"""`python -m tests.dryrun.dry_run_json [pretrain_gpt flags]`: the dry run's per-rank reports as
JSON on stdout (for tests; run under the fake CUDA shim for --dry-run-device cuda)."""

import json
import sys

import torch

from megalite.dryrun.cli import measured_rank, stages_to_measure
from megalite.dryrun.fake_cuda import exit_now
from megalite.dryrun.runner import run_rank
from megalite.config.arguments import layout_from_args, parse_args, validate_args
from megalite.config.megatron.model import tokenizer_from_args


def reports(argv):
    args = parse_args(argv)
    world = args.dry_run_world_size
    validate_args(args, world)
    vocab = tokenizer_from_args(args).vocab_size
    layout = layout_from_args(args, world)
    return [run_rank(args, vocab, measured_rank(layout, group), world, torch.device(args.dry_run_device))
            for group in stages_to_measure(args, layout, vocab)]


if __name__ == "__main__":
    out = [{"rank": r.rank, "coords": list(r.coords), "peak": r.peak, "resident": r.resident, "formula": r.formula,
            "num_params": r.num_params, "num_buffer": r.num_buffer, "korthikanti": r.korthikanti,
            "activation_peak": r.activation_peak,
            "comm": {f"{g} {k}": b for (g, k), b in r.comm.items()}} for r in reports(sys.argv[1:])]
    json.dump(out, sys.stdout)
    exit_now(0)
