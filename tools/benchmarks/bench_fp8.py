"""FP8 training against bf16 on one GPU (issue 31): tokens/s and the loss after 8 steps of
megalite's driver (`python -m megalite.pretrain_gpt --mock-data`), each model in bf16 and with
`--fp8-format hybrid --fp8-recipe tensorwise`:

    python tools/benchmarks/bench_fp8.py [--json out.json]      # one H100/H200
    python tools/benchmarks/bench_fp8.py --cpu-smoke            # tiny shapes on the CPU (CI)

Models (gpu_check.sh's driver runs): Llama-3-8B layer shapes, 4 layers (hidden 4096, ffn 14336,
32 heads, 8 KV groups, s 8192, mb 1, vocab 128256, --use-distributed-optimizer), and the 1.1B
Llama (16 layers, hidden 2048, ffn 8192, 16 heads, 8 KV groups, s 4096, mb 2). tokens/s is the
median of iterations 3..8 (the first two warm up); the loss is iteration 8's, both runs from the
same seed on the same mock batches. Targets: the 8B layers >= 1.25x bf16's tokens/s with the loss
within 1%; the 1.1B >= 1.1x. All runs go one after another in one child process (one start-up:
torch, CUDA); a run that does not finish is a row that says so. Exit 0 when it measured (a missed
target is a line of the output), also without a GPU (it says so), 2 for bad options.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LLAMA = ("--group-query-attention --swiglu --normalization RMSNorm --position-embedding-type rope "
         "--disable-bias-linear --untie-embeddings-and-output-weights --tokenizer-type NullTokenizer").split()
MODELS = {  # name: (model and layout flags on a GPU, at --cpu-smoke size)
    "8b-layers": ("--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 "
                  "--ffn-hidden-size 14336 --seq-length 8192 --micro-batch-size 1 --global-batch-size 2 "
                  "--vocab-size 128256 --attention-backend flash --use-distributed-optimizer",
                  "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --num-query-groups 2 "
                  "--ffn-hidden-size 352 --seq-length 128 --micro-batch-size 1 --global-batch-size 2 "
                  "--vocab-size 2000 --use-distributed-optimizer"),
    "1b": ("--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --num-query-groups 8 "
           "--ffn-hidden-size 8192 --seq-length 4096 --micro-batch-size 2 --global-batch-size 4 "
           "--vocab-size 32000 --attention-backend flash",
           "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
           "--ffn-hidden-size 176 --seq-length 64 --micro-batch-size 2 --global-batch-size 4 --vocab-size 1000"),
}
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
TARGETS = {"8b-layers": (1.25, 0.01), "1b": (1.10, None)}  # (tokens/s ratio, |loss ratio - 1|)
# runs pretrain_gpt.main once per argument list (a JSON list of lists), stopping at a failure
RUNNER = """import json, sys
from megalite import pretrain_gpt
for argv in json.loads(sys.argv[1]):
    status = pretrain_gpt.main(argv)
    if status:
        sys.exit(status)
"""


def run_trainings(argv_lists: list[list[str]], log: Path, timeout: float | None = None) -> int:
    """`python -m megalite.pretrain_gpt ARGV` for each list, in order, in one child process
    (megalite from this checkout), its output to `log`: the exit status (124 past `timeout`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as f:
        try:
            return subprocess.run([sys.executable, "-c", RUNNER, json.dumps(argv_lists)], cwd=REPO, env=env,
                                  stdout=f, stderr=subprocess.STDOUT,
                                  timeout=None if timeout is None else max(timeout, 1.0)).returncode
        except subprocess.TimeoutExpired:
            return 124


def training_argv(model: str, fp8: bool, smoke: bool, iterations: int, metrics: Path) -> list[str]:
    flags = MODELS[model][1 if smoke else 0].split()
    return [*LLAMA, *flags, "--bf16", "--mock-data", "--lr", "1e-4", "--train-iters", str(iterations),
            "--log-interval", "1", "--eval-iters", "0", "--metrics-file", str(metrics), *(FP8 if fp8 else [])]


def run_result(metrics: Path, warmup: int) -> dict | None:
    """tokens/s (median after `warmup` iterations) and the last iteration's loss of a metrics file."""
    if not metrics.exists():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = sorted((r for r in records if "split" not in r), key=lambda r: r["iteration"])
    timed = [r["tokens_per_second_per_gpu"] for r in steps if r["iteration"] > warmup]
    if not timed:
        return None
    return {"tokens_per_s": statistics.median(timed), "loss": steps[-1]["lm_loss"], "iterations": len(steps)}


def compare(model: str, bf16: dict | None, fp8: dict | None) -> dict:
    """The FP8 run against bf16's and against the model's targets."""
    speed_target, loss_tolerance = TARGETS[model]
    if bf16 is None or fp8 is None:
        missing = " and ".join(n for n, r in (("bf16", bf16), ("FP8", fp8)) if r is None)
        return {"model": model, "line": f"{model}: not measured ({missing} run did not finish)", "met": None}
    speedup, loss_ratio = fp8["tokens_per_s"] / bf16["tokens_per_s"], fp8["loss"] / bf16["loss"]
    met = speedup >= speed_target and (loss_tolerance is None or abs(loss_ratio - 1) <= loss_tolerance)
    target = f">= {speed_target:g}x" + (f", loss within {loss_tolerance:.0%}" if loss_tolerance else "")
    line = (f"{model}: FP8 {fp8['tokens_per_s']:,.0f} tokens/s, bf16 {bf16['tokens_per_s']:,.0f}: {speedup:.3f}x; "
            f"loss after {fp8['iterations']} steps {fp8['loss']:.4f} vs {bf16['loss']:.4f} "
            f"({(loss_ratio - 1) * 100:+.2f}%); target {target}: {'met' if met else 'NOT met'}")
    return {"model": model, "speedup": speedup, "loss_ratio": loss_ratio, "bf16": bf16, "fp8": fp8, "met": met,
            "line": line}


def main(argv=None) -> int:
    started = time.monotonic()  # --time-limit counts from here (importing torch takes a while too)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, 3 iterations, on the CPU")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--iterations", type=int, help="training steps per run (default 8; 3 with --cpu-smoke)")
    p.add_argument("--time-limit", type=float,
                   help="seconds for this script (the runs unfinished then are not measured; 5 s kept to report)")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown model {unknown[0]} (choose from {', '.join(MODELS)})")
    iterations = args.iterations or (3 if args.cpu_smoke else 8)
    if iterations < 3:
        p.error(f"--iterations {iterations}: at least 3 (the first 2 are warm-up)")
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_fp8: no CUDA GPU on this machine, nothing to measure (--cpu-smoke runs tiny shapes on the CPU)")
        return 0
    warmup = 2
    with tempfile.TemporaryDirectory(prefix="bench_fp8_") as work:
        work = Path(work)
        plan = [(m, fp8, work / f"{m}-{'fp8' if fp8 else 'bf16'}.jsonl") for m in models for fp8 in (False, True)]
        status = run_trainings([training_argv(m, fp8, args.cpu_smoke, iterations, path) for m, fp8, path in plan],
                               work / "trainings.log",
                               None if args.time_limit is None else args.time_limit - 5 - (time.monotonic() - started))
        results = {(m, fp8): run_result(path, warmup) for m, fp8, path in plan}
        tail = (work / "trainings.log").read_text(errors="replace")[-2000:]
    device = "CPU (smoke run: the numbers mean nothing)" if args.cpu_smoke else torch.cuda.get_device_name(0)
    print(f"bench_fp8: {device}, torch {torch.__version__}; FP8 = {' '.join(FP8)}; {iterations} steps, "
          f"tokens/s the median of steps {warmup + 1}..{iterations}")
    if status != 0:
        print(f"bench_fp8: the trainings stopped with status {status}"
              + (" (time limit)" if status == 124 else "") + "; the log ends:\n" + tail)
    rows = [compare(m, results[m, False], results[m, True]) for m in models]
    for row in rows:
        print(row["line"])
    if args.json:
        args.json.write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
