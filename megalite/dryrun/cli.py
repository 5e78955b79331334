"""`python -m megalite.pretrain_gpt --dry-run [the run's flags] --dry-run-world-size N`: one
iteration of a rank of each distinct pipeline stage (stages.py) on a fake device, in this one
process (see runner.py); prints the tables and the verdict (report.py). Exits 0 once every
stage is measured, whether or not the layout fits (the verdict line says it), 1 when an op
mixes devices or dtypes, 2 on bad flags."""

import math
import sys
import time

import torch

from megalite.dryrun.fake_cuda import fake_cuda_ready, reexec_with_fake_cuda
from megalite.dryrun.probes import MixedTensorsError
from megalite.dryrun.report import format_report
from megalite.dryrun.runner import run_rank
from megalite.dryrun.stages import distinct_stages, every_stage, stage_name
from megalite.config.arguments import layout_from_args, model_config_from_args, validate_args
from megalite.config.megatron.model import tokenizer_from_args


def stages_to_measure(args, layout, vocab_size: int) -> list[list[int]]:
    """Groups of pipeline ranks, one measured per group (its first): the distinct stages, or
    with --dry-run-all-stages every stage alone."""
    if args.dry_run_all_stages:
        return every_stage(layout)
    return distinct_stages(args, model_config_from_args(args, vocab_size), layout, args.dry_run_device)


def measured_rank(layout, group: list[int]) -> int:
    """TP rank 0, DP rank 0 of the group's first stage: other TP, CP and DP ranks hold the same
    shapes (every EP rank as many experts, and under the balanced-routing assumption as many
    tokens)."""
    return layout.rank_of(0, 0, group[0])


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
    stages = stages_to_measure(args, layout, tokenizer.vocab_size)
    print(f"pretrain_gpt: dry run: measuring {len(stages)} of {layout.pipeline} pipeline stages", file=sys.stderr,
          flush=True)
    reports = []
    for group in stages:
        rank, start = measured_rank(layout, group), time.perf_counter()
        try:
            reports.append(run_rank(args, tokenizer.vocab_size, rank, world, device))
        except MixedTensorsError as error:
            print(f"pretrain_gpt: dry run: rank {rank}: {error}", file=sys.stderr, flush=True)
            return 1
        print(f"pretrain_gpt: dry run: {stage_name(group)} (rank {rank}) measured in "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print(format_report(args, layout, stages, reports), flush=True)
    return 0
