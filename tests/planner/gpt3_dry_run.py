"""`python -m tests.planner.gpt3_dry_run TP V`: the dry run of pipeline stage 0's first rank of
GPT-3 175B at TP, PP 16 with V virtual stages, DP filling 1024 GPUs (the paper's software:
fp16, full recompute, unfused attention), as JSON {category: bytes} of its peak, on stdout.
Run under the fake CUDA shim."""

import json
import sys

import torch

from megalite.dryrun.fake_cuda import exit_now
from megalite.dryrun.runner import run_rank
from megalite.training.arguments import parse_args, validate_args
from megalite.training.arguments_megatron_model import tokenizer_from_args

FLAGS = ("--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --max-position-embeddings 2048 --fp16 "
         "--tokenizer-type NullTokenizer --vocab-size 51199 --attention-backend unfused --seq-length 2048 "
         "--global-batch-size 1536 --pipeline-model-parallel-size 16 --recompute-granularity full "
         "--recompute-method uniform --recompute-num-layers 1 --overlap-grad-reduce --micro-batch-size 1 "
         "--mock-data --lr 1e-4 --train-iters 1 --dry-run --dry-run-world-size 1024")


def main(tp: str, v: str) -> None:
    virtual = f" --num-virtual-stages-per-pipeline-rank {v}" if int(v) > 1 else ""
    args = parse_args(f"{FLAGS} --tensor-model-parallel-size {tp}{virtual}".split())
    validate_args(args, 1024)
    report = run_rank(args, tokenizer_from_args(args).vocab_size, 0, 1024, torch.device("cuda"))
    json.dump(report.peak, sys.stdout)


if __name__ == "__main__":
    main(*sys.argv[1:3])
    exit_now(0)
