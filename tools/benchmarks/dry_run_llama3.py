"""Dry runs of Llama-3 8B (TP=1, TP=2 with SP), 70B (TP=8 PP=4 SP) and 405B (TP=8 PP=16, two
virtual stages, SP) in bf16 with the distributed optimizer, at s = 8192, b = 1: a rank of every
distinct pipeline stage, as `python -m megalite.pretrain_gpt --dry-run` measures them
(megalite/dryrun/stages.py). Prints megalite/dryrun/README.md's table, a row per distinct stage: held bytes
beside formulas.md's, the peak of a steady iteration, and the most activations held at once
beside Korthikanti et al.'s formula for the layers in flight (megalite/dryrun/formulas.py); then
each model's verdict against an 80 GiB GPU.

    python tools/benchmarks/dry_run_llama3.py [8b-tp1 8b-tp2 70b 405b]

On a CPU-only torch it restarts itself with the fake CUDA device (megalite/dryrun/fake_cuda.py).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, without `pip install -e .`

import torch  # noqa: E402

from megalite.dryrun.fake_cuda import exit_now, fake_cuda_ready, reexec_with_fake_cuda  # noqa: E402

MIB = 2 ** 20
COMMON = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --group-query-attention "
          "--num-query-groups 8 --swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 "
          "--disable-bias-linear --untie-embeddings-and-output-weights --seq-length 8192 --micro-batch-size 1 "
          "--lr 3e-4 --train-iters 1 --attention-dropout 0 --hidden-dropout 0 --bf16 --use-distributed-optimizer "
          "--dry-run")
LLAMA_8B = "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 14336"
RUNS = {
    "8b-tp1": ("8B", "TP1 DP8", f"{LLAMA_8B} --global-batch-size 8 --dry-run-world-size 8"),
    "8b-tp2": ("8B", "TP2 SP DP4", f"{LLAMA_8B} --tensor-model-parallel-size 2 --sequence-parallel "
                                   "--global-batch-size 8 --dry-run-world-size 8"),
    "70b": ("70B", "TP8 PP4 SP DP2", "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 "
            "--ffn-hidden-size 28672 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 "
            "--sequence-parallel --global-batch-size 16 --dry-run-world-size 64"),
    "405b": ("405B", "TP8 PP16 v2 SP DP8", "--num-layers 126 --hidden-size 16384 --num-attention-heads 128 "
             "--ffn-hidden-size 53248 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 "
             "--num-virtual-stages-per-pipeline-rank 2 --decoder-first-pipeline-num-layers 6 "
             "--decoder-last-pipeline-num-layers 8 --sequence-parallel --global-batch-size 128 "
             "--dry-run-world-size 1024"),
}


def run(name: str) -> tuple[list[str], str]:
    """The table's rows for model `name`, one per distinct pipeline stage, and its verdict."""
    from megalite.dryrun.cli import measured_rank, stages_to_measure
    from megalite.dryrun.report import verdict
    from megalite.dryrun.runner import run_rank
    from megalite.dryrun.stages import stage_label
    from megalite.config.arguments import layout_from_args, parse_args, validate_args
    from megalite.config.megatron.model import tokenizer_from_args

    model, layout_name, flags = RUNS[name]
    args = parse_args(f"{COMMON} {flags}".split())
    world = args.dry_run_world_size
    validate_args(args, world)
    vocab = tokenizer_from_args(args).vocab_size
    layout = layout_from_args(args, world)
    stages = stages_to_measure(args, layout, vocab)
    rows, reports = [], []
    for group in stages:
        start = time.perf_counter()
        r = run_rank(args, vocab, measured_rank(layout, group), world, torch.device("cuda"))
        seconds = time.perf_counter() - start
        reports.append(r)
        held = " / ".join(f"{r.resident[c] / MIB:,.1f}" for c in ("parameters", "gradients", "optimizer"))
        rows.append(f"| {model} | {layout_name} ({world}) | {stage_label(group)} | {seconds:.0f} s | {held} | "
                    f"{'exactly' if r.resident == r.formula else 'NO: ' + str(r.formula)} | {r.peak_total / MIB:,.0f} | "
                    f"{r.activation_peak / MIB:,.0f} | {r.korthikanti / MIB:,.0f} | "
                    f"{r.activation_peak / r.korthikanti:.3f} |")
    return rows, f"{model} {layout_name}: {verdict(stages, reports, args.dry_run_gpu_memory_gib)}"


def main(names: list[str]) -> int:
    if not fake_cuda_ready():
        reexec_with_fake_cuda([__file__, *names])  # does not return
    print("| model | layout (world) | pipeline stages | wall time | params / grads / optimizer held (MiB) | "
          "= formulas.md | peak (MiB) | most activations (MiB) | Korthikanti (MiB) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for name in names or list(RUNS):
        rows, line = run(name)
        print("\n".join(rows), flush=True)
        verdicts.append(line)
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
