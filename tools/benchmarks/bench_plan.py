"""The layout planner against real runs on this machine: calibrate (plan.py --calibrate) for each
world size, predict the step time of a set of layouts of one small GPT, run each layout for real
with the planner's own launch line (scripts/pretrain_gpt.sh on gloo), and compare.

    python tools/benchmarks/bench_plan.py                     # world sizes 4 and 8, 10 layouts
    python tools/benchmarks/bench_plan.py --world-sizes 8 --json out.json
    python tools/benchmarks/bench_plan.py --calibrate-each    # a loaded machine: calibrate before every run

Reported: predicted and measured step time per layout (measured: median of the iterations after
the first --skip), the error of each prediction, the rank of each layout by both, and Spearman's
rank correlation. Targets: Spearman >= 0.8, every prediction within 25% of its measurement. The
machine's load (os.getloadavg) is printed before and after: on a shared machine both the
calibration and the runs see it. The exit status is 0 when every layout was measured, whether
the targets were met or not (the "targets met/missed" line says which); 1 when a run failed.
"""

import argparse
import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megalite.planner.calibrate import calibrate  # noqa: E402
from megalite.planner.cluster import Cluster  # noqa: E402
from megalite.planner.layouts import Layout  # noqa: E402
from megalite.planner.memory import peak_memory  # noqa: E402
from megalite.planner.report import command  # noqa: E402
from megalite.planner.search import Plan  # noqa: E402
from megalite.planner.step import predict  # noqa: E402
from megalite.planner.workload import from_flags  # noqa: E402

MODEL = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
         "--global-batch-size 16 --attention-dropout 0 --hidden-dropout 0 --tokenizer-type NullTokenizer "
         "--vocab-size 4095").split()
RUN = "--mock-data --lr 1e-4 --log-interval 1 --seed 1234".split()


def L(tp, pp, dp, mbs, vp=1, sp=False, recompute="none"):
    schedule = "none" if pp == 1 else "interleaved_1f1b" if vp > 1 else "1f1b"
    return Layout(tp, pp, dp, vp, 1, 1, mbs, sp, recompute, False, schedule)


LAYOUTS = {
    4: [L(1, 1, 4, 2), L(2, 1, 2, 2, sp=True), L(1, 2, 2, 1), L(4, 1, 1, 4)],
    8: [L(1, 1, 8, 2), L(1, 1, 8, 2, recompute="full"), L(2, 2, 2, 1), L(1, 4, 2, 1, vp=2), L(1, 8, 1, 2),
        L(8, 1, 1, 2)],
}


def measure(cmd: str, iterations: int, skip: int, workdir: Path, timeout: float) -> tuple[float, list]:
    """Median step time (s) of iterations after the first `skip`, and all of them."""
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    full = f"{cmd} {' '.join(RUN)} --train-iters {iterations} --metrics-file {shlex.quote(str(metrics))}"
    log = open(workdir / "run.log", "w")
    env = dict(os.environ, PYTHON=sys.executable)  # the launch script's interpreter: this one, not PATH's
    proc = subprocess.Popen(full, shell=True, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    start, done_at = time.time(), None
    try:
        while proc.poll() is None:
            time.sleep(2)
            records = _records(metrics)
            if done_at is None and records and records[-1]["iteration"] >= iterations:
                done_at = time.time()
            # every iteration is logged: a process group slow to exit is not waited on for long
            if (done_at and time.time() - done_at > 60) or time.time() - start > timeout:
                os.killpg(proc.pid, signal.SIGTERM)
                break
    finally:
        if proc.poll() is None:
            time.sleep(5)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    records = _records(metrics)
    if len(records) < iterations:
        tail = (workdir / "run.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{full}: {len(records)} of {iterations} iterations logged; the run's output ends:\n{tail}")
    times = [r["elapsed_ms_per_iteration"] / 1000 for r in records]
    return statistics.median(times[skip:]), times


def _records(path: Path) -> list:
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [r for r in map(json.loads, lines) if "elapsed_ms_per_iteration" in r]


def spearman(a: list, b: list) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def targets_line(rho: float, worst: float) -> str:
    """The verdict on the targets, a line of the output (a missed target is a result, not a
    failure of the benchmark: the exit status is 0 whenever every run was measured)."""
    verdicts = [f"Spearman {rho:.2f} >= 0.8: {'met' if rho >= 0.8 else 'MISSED'}",
                f"largest error {worst:.0%} <= 25%: {'met' if worst <= 0.25 else 'MISSED'}"]
    missed = rho < 0.8 or worst > 0.25
    return f"targets {'missed' if missed else 'met'}: " + "; ".join(verdicts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="4,8")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--skip", type=int, default=3)
    parser.add_argument("--calibration-dir", help="reuse cpu<W>.json files from here (else calibrate now)")
    parser.add_argument("--calibrate-each", action="store_true",
                        help="calibrate again before every run (the load of a shared machine drifts)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per real run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    workload = from_flags(MODEL)
    load_before = os.getloadavg()
    print(f"load before: {load_before[0]:.1f} {load_before[1]:.1f} {load_before[2]:.1f} (1/5/15 min), "
          f"{os.cpu_count()} cores", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for world in worlds:
            if args.calibration_dir and (Path(args.calibration_dir) / f"cpu{world}.json").exists():
                cluster = Cluster.load(str(Path(args.calibration_dir) / f"cpu{world}.json"))
            else:
                cluster = calibrate(world)
                if args.calibration_dir:
                    Path(args.calibration_dir).mkdir(parents=True, exist_ok=True)
                    cluster.save(str(Path(args.calibration_dir) / f"cpu{world}.json"))
            for i, layout in enumerate(LAYOUTS[world]):
                if args.calibrate_each and i:
                    cluster = calibrate(world)
                if args.calibrate_each or not i:
                    print(f"calibrated {world} ranks: {cluster.peak_flops / 1e9:.1f} GFLOP/s matmul alone, slowdown "
                          f"{ {k: round(v, 2) for k, v in cluster.slowdown.items()} }, {cluster.memory_bandwidth / 1e9:.2f} "
                          f"GB/s, {cluster.op_overhead * 1e6:.1f} us/op ({cluster.source})", flush=True)
                prediction = predict(cluster, workload, layout, peak_memory(workload, layout))
                cmd = command(Plan(workload, cluster, [prediction]), prediction)
                try:
                    measured, times = measure(cmd, args.iterations, args.skip, workdir, args.timeout)
                except RuntimeError as error:  # a run that did not finish: nothing was measured
                    print(f"bench_plan: {error}", file=sys.stderr)
                    return 1
                rows.append({"world": world, "layout": layout.short(), "predicted": prediction.step_time,
                             "measured": measured, "times": times, "command": cmd, "breakdown": prediction.breakdown,
                             "load": os.getloadavg()[0], "calibration": dataclasses.asdict(cluster)})
                print(f"  W={world} {layout.short():28} predicted {prediction.step_time:7.3f} s  measured "
                      f"{measured:7.3f} s  ({prediction.step_time / measured - 1:+.0%})  load {rows[-1]['load']:.1f}",
                      flush=True)
    predicted, measured = [r["predicted"] for r in rows], [r["measured"] for r in rows]
    rho = spearman(predicted, measured)
    worst = max(abs(p / m - 1) for p, m in zip(predicted, measured))
    load_after = os.getloadavg()
    print(f"\n{'W':>2} {'layout':28} {'predicted s':>11} {'measured s':>10} {'error':>6}")
    for r in rows:
        print(f"{r['world']:>2} {r['layout']:28} {r['predicted']:>11.3f} {r['measured']:>10.3f} "
              f"{r['predicted'] / r['measured'] - 1:>+6.0%}")
    print(f"Spearman {rho:.2f} (target >= 0.8); largest error {worst:.0%} (target <= 25%); "
          f"load after: {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}")
    print(targets_line(rho, worst))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"rows": rows, "spearman": rho, "largest_error": worst, "load_before": load_before,
                       "load_after": load_after}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
