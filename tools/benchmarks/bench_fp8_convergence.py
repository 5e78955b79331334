"""FP8 training against bf16 on the demo corpus, on the CPU: three trainings of a toy Llama
(examples/demo_cpu.yaml's model made smaller by default: 2 layers, hidden 64, ffn 176, 4 heads
in 2 KV groups, sequence 64, batch 4, vocabulary 1024; one process) through megalite's own entry
point (`python -m megalite.pretrain_gpt`), each from the same seed on the same batches:

    bf16        --bf16
    tensorwise  --bf16 --fp8-format hybrid --fp8-recipe tensorwise
    delayed     --bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024
                --fp8-amax-compute-algo max   (the recipe of Megatron's Llama-3 FP8 example)

    python tools/benchmarks/bench_fp8_convergence.py --output-dir tools/benchmarks

On the CPU the FP8 GEMMs are megalite's Fp8Gemm on torch._scaled_mm's CPU kernel (quantized
e4m3 / e5m2 operands, fp32 accumulation), the same code a GPU runs. The corpus is the demo's
(tools/make_demo_corpus.py, a SentencePiece tokenizer, Megatron .bin/.idx), built in --work-dir
unless --data-path and --tokenizer-model name one already made (the demo's
/tmp/megalite-demo/data). The final loss of a run is the mean training loss of its last --window
iterations (the three runs see the same batches, so the comparison is paired). Writes
fp8_convergence.csv (loss per iteration), fp8_convergence.json (final losses, ratios, the
commands, date and machine) and fp8_convergence.png (the curves, with matplotlib: the `plot`
extra) to --output-dir, and prints each FP8 run's final loss over bf16's against --tolerance.
--from-metrics DIR writes the outputs from the metrics files of runs already made (a --work-dir)
without training. Exit 0 when it measured (a ratio outside the tolerance is a line of the
output), 1 when a training failed, 2 for bad options (a --from-metrics run short of
--train-iters too).
"""

import argparse
import importlib.util
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8 import run_trainings  # noqa: E402
RUNS = {
    "bf16": [],
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024",
                "--fp8-amax-compute-algo", "max"],
}
COLORS = {"bf16": "C0", "tensorwise": "C1", "delayed": "C2"}  # a run's colour in both panels
# options given to the demo config (in one process, no TP/PP: FP8 is the runs' only difference)
MODEL_OPTIONS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                 "micro_batch_size", "global_batch_size", "train_iters", "lr_warmup_iters")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default=".", help="where the CSV, JSON and PNG go (default: .)")
    p.add_argument("--work-dir", help="corpus and metrics files (default: a temporary folder)")
    p.add_argument("--data-path", help="a prepared Megatron corpus prefix (with --tokenizer-model)")
    p.add_argument("--tokenizer-model", help="the SentencePiece model of --data-path")
    p.add_argument("--corpus-mb", type=float, default=1.0, help="demo corpus size to build (default 1)")
    p.add_argument("--vocab-size", type=int, default=1024, help="tokenizer to train (default 1024)")
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--lr-warmup-iters", type=int, default=30)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--ffn-hidden-size", type=int, default=176)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=4)
    p.add_argument("--window", type=int, default=20, help="iterations averaged for the final loss (default 20)")
    p.add_argument("--tolerance", type=float, default=0.02, help="target |FP8 / bf16 - 1| (default 0.02)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--from-metrics", metavar="DIR",
                   help="no training: the outputs from DIR's metrics-{bf16,tensorwise,delayed}.jsonl (a --work-dir of an "
                        "earlier run, or runs made with the commands its JSON records)")
    args = p.parse_args(argv)
    if (args.data_path is None) != (args.tokenizer_model is None):
        p.error("--data-path and --tokenizer-model go together")
    if args.data_path and not Path(args.data_path + ".bin").exists():
        p.error(f"--data-path {args.data_path}: no {args.data_path}.bin")
    if not 1 <= args.window <= args.train_iters:
        p.error(f"--window {args.window} must be 1..--train-iters ({args.train_iters})")
    if args.from_metrics:
        missing = [n for n in RUNS if not (Path(args.from_metrics) / f"metrics-{n}.jsonl").exists()]
        if missing:
            p.error(f"--from-metrics {args.from_metrics}: no metrics-{missing[0]}.jsonl")
    if not 0 <= args.lr_warmup_iters < args.train_iters:
        p.error(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --train-iters ({args.train_iters})")
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:
        p.error("the PNG needs matplotlib (pip install -e '.[plot]'), or pass --no-plot")
    return args


def _tool(*argv) -> list[str]:
    return [sys.executable, str(REPO / "tools" / argv[0]), *map(str, argv[1:])]


def build_corpus(work: Path, megabytes: float, vocab: int) -> tuple[str, str]:
    """The demo's corpus at `megabytes`: (data prefix, tokenizer model)."""
    jsonl, prefix = work / "corpus.jsonl", work / "tokenizer"
    for command in (_tool("make_demo_corpus.py", "--output", jsonl, "--max-mb", megabytes),
                    _tool("train_tokenizer.py", "--input", jsonl, "--json-keys", "text", "--vocab-size", vocab,
                          "--model-prefix", prefix),
                    _tool("preprocess_data.py", "--input", jsonl, "--json-keys", "text", "--output-prefix",
                          work / "demo", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                          f"{prefix}.model", "--append-eod")):
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(command[1]).name} failed: {done.stderr.strip().splitlines()[-1:]}")
    return str(work / "demo_text_document"), f"{prefix}.model"


def training_command(args, name: str, data: str, tokenizer: str, metrics: Path) -> list[str]:
    """The arguments of `python -m megalite.pretrain_gpt` for the run `name`."""
    model = [f"--{option.replace('_', '-')}={getattr(args, option)}" for option in MODEL_OPTIONS]
    return ["--config", str(REPO / "examples" / "demo_cpu.yaml"),
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--num-query-groups", str(max(1, args.num_attention_heads // 2)), "--max-position-embeddings",
            str(args.seq_length), *model, "--data-path", data, "--tokenizer-model", tokenizer,
            "--log-interval", "1", "--eval-iters", "0", "--bf16", *RUNS[name], "--metrics-file", str(metrics)]


def losses(metrics: Path) -> dict[int, float]:
    """lm loss by iteration of a --metrics-file."""
    records = (json.loads(line) for line in metrics.read_text().splitlines() if line.strip())
    return {r["iteration"]: r["lm_loss"] for r in records if "split" not in r}


def final_loss(curve: dict[int, float], window: int) -> float:
    last = sorted(curve)[-window:]
    return sum(curve[i] for i in last) / len(last)


def plot(curves: dict[str, dict[int, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_ax, ratio_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                               gridspec_kw={"height_ratios": [3, 2]})
    for name, curve in curves.items():
        loss_ax.plot(sorted(curve), [curve[i] for i in sorted(curve)], label=name, linewidth=1, color=COLORS[name])
    base = curves["bf16"]
    for name, curve in curves.items():
        if name != "bf16":
            its = sorted(set(curve) & set(base))
            ratio_ax.plot(its, [curve[i] / base[i] for i in its], label=f"{name} / bf16", linewidth=1,
                          color=COLORS[name])
    ratio_ax.axhline(1.0, color="gray", linewidth=0.5)
    loss_ax.set_ylabel("training lm loss")
    ratio_ax.set_ylabel("loss / bf16 loss")
    ratio_ax.set_xlabel("iteration")
    loss_ax.set_title(title)
    loss_ax.legend()
    ratio_ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def train(args):
    """The three trainings (the corpus built first unless given): (curves, commands, seconds), or
    None after saying what failed."""
    with tempfile.TemporaryDirectory(prefix="bench_fp8_") as scratch:
        work = Path(args.work_dir or scratch)
        work.mkdir(parents=True, exist_ok=True)
        try:
            data, tokenizer = ((args.data_path, args.tokenizer_model) if args.data_path
                               else build_corpus(work, args.corpus_mb, args.vocab_size))
        except RuntimeError as error:
            print(f"bench_fp8_convergence: building the demo corpus: {error}", file=sys.stderr)
            return None
        metrics = {name: work / f"metrics-{name}.jsonl" for name in RUNS}
        commands = {name: training_command(args, name, data, tokenizer, metrics[name]) for name in RUNS}
        for path in metrics.values():
            path.unlink(missing_ok=True)
        log = work / "trainings.log"
        start = time.perf_counter()  # the three trainings one after another in one process: one start-up
        status = run_trainings(list(commands.values()), log)
        seconds = time.perf_counter() - start
        if status != 0:
            failed = next((n for n in RUNS if not metrics[n].exists() or len(losses(metrics[n])) < args.train_iters),
                          "last")
            print(f"bench_fp8_convergence: the {failed} training failed (status {status}):\n"
                  + log.read_text()[-3000:], file=sys.stderr)
            return None
        curves = {name: losses(path) for name, path in metrics.items()}
        print(f"trained {', '.join(f'{n} ({len(c)} iterations)' for n, c in curves.items())} in {seconds:.0f} s",
              flush=True)
    return curves, commands, seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_metrics:
        work = Path(args.from_metrics)
        data, tokenizer = (args.data_path or str(work / "demo_text_document"),
                           args.tokenizer_model or str(work / "tokenizer.model"))
        metrics = {name: work / f"metrics-{name}.jsonl" for name in RUNS}
        commands = {name: training_command(args, name, data, tokenizer, metrics[name]) for name in RUNS}
        curves, seconds = {name: losses(path) for name, path in metrics.items()}, None
    else:
        trained = train(args)
        if trained is None:
            return 1
        curves, commands, seconds = trained
    short = [n for n in RUNS if len(curves[n]) < args.train_iters]
    if short:
        print(f"bench_fp8_convergence: the {short[0]} run logged {len(curves[short[0]])} of {args.train_iters} "
              "iterations", file=sys.stderr)
        return 2 if args.from_metrics else 1
    iterations = sorted(curves["bf16"])
    with open(out / "fp8_convergence.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["iteration", *RUNS])
        for i in iterations:
            writer.writerow([i, *(f"{curves[name].get(i, float('nan')):.6f}" for name in RUNS)])
    finals = {name: final_loss(curve, args.window) for name, curve in curves.items()}
    ratios = {name: finals[name] / finals["bf16"] for name in RUNS if name != "bf16"}
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.system()}"
    import torch

    summary = {"date": when, "machine": machine, "torch": torch.__version__, "window": args.window,
               "tolerance": args.tolerance, "final_loss": finals, "ratio_to_bf16": ratios,
               "within_tolerance": {n: abs(r - 1) <= args.tolerance for n, r in ratios.items()},
               "seconds": seconds,
               "commands": {n: "python -m megalite.pretrain_gpt " + " ".join(c) for n, c in commands.items()},
               "command": "python tools/benchmarks/bench_fp8_convergence.py " + " ".join(argv or sys.argv[1:])}
    (out / "fp8_convergence.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not args.no_plot:
        plot(curves, out / "fp8_convergence.png",
             f"FP8 vs bf16, demo corpus, {args.train_iters} iterations (CPU, {when[:10]})")
    print(f"final loss (mean of the last {args.window} iterations): "
          + ", ".join(f"{n} {v:.4f}" for n, v in finals.items()))
    for name, ratio in ratios.items():
        verdict = "met" if summary["within_tolerance"][name] else "NOT met"
        print(f"{name} / bf16 = {ratio:.4f} ({(ratio - 1) * 100:+.2f}%): target within "
              f"{args.tolerance * 100:g}% {verdict}")
    print(f"wrote {out / 'fp8_convergence.csv'}, {out / 'fp8_convergence.json'}"
          + ("" if args.no_plot else f", {out / 'fp8_convergence.png'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
