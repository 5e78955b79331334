"""`python -m megalite.pretrain_gpt --dry-run [the run's flags] --dry-run-world-size N`: one
iteration of each distinct rank on a fake device, in this one process (see runner.py)."""

import math
import sys

import torch

from megalite.dryrun.fake_cuda import fake_cuda_ready, reexec_with_fake_cuda
from megalite.dryrun.probes import MixedTensorsError
from megalite.dryrun.report import format_report
from megalite.dryrun.runner import run_rank
from megalite.config.arguments import layout_from_args, validate_args
from megalite.config.arguments_megatron_model import tokenizer_from_args


def distinct_ranks(layout, all_stages: bool) -> list[int]:
    """TP rank 0, DP rank 0 of the first, a middle and the last pipeline stage (every stage
    with all_stages): other TP, CP and DP ranks hold the same shapes (every EP rank as many
    experts, and under the balanced-routing assumption as many tokens)."""
    p = layout.pipeline
    stages = range(p) if all_stages else sorted({0, p // 2, p - 1})
    return [layout.rank_of(0, 0, s) for s in stages]


def default_world_size(args) -> int:
    """The smallest world the layout needs: TP x CP x PP x DP, with the smallest DP whose
    stage of TP x CP x DP ranks the expert grid's ETP x EP blocks tile."""
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    block = 1
    if args.num_experts is not None:
        block = args.expert_model_parallel_size * (args.expert_tensor_parallel_size or tp)
    return tp * cp * args.pipeline_model_parallel_size * (block // math.gcd(block, tp * cp))


def run_dry(args, argv: list[str]) -> int:
    if args.dry_run_device == "cuda" and not fake_cuda_ready():
        reexec_with_fake_cuda(["-m", "megalite.pretrain_gpt", *argv])  # does not return
    world = args.dry_run_world_size or default_world_size(args)
    validate_args(args, world)
    tokenizer = tokenizer_from_args(args)
    layout = layout_from_args(args, world)
    device = torch.device(args.dry_run_device)
    reports = []
    for rank in distinct_ranks(layout, args.dry_run_all_stages):
        try:
            reports.append(run_rank(args, tokenizer.vocab_size, rank, world, device))
        except MixedTensorsError as error:
            print(f"pretrain_gpt: dry run: rank {rank}: {error}", file=sys.stderr, flush=True)
            return 1
    print(format_report(args, layout, reports), flush=True)
    return 0
