"""gpu_check.sh's reader: the summary table from the steps' logs, and the kernel rates the
planner reads, from the profiled step.

    python tools/benchmarks/gpu_check_report.py table --logs DIR --out gpu_check.md --command "..." [--gpu NAME]
    python tools/benchmarks/gpu_check_report.py rates --trace TRACE.json --bench-kernels LOG --cluster h200 \\
        --out kernel_rates.json -- PRETRAIN_GPT_FLAGS (the profiled run's model and layout)

`rates` divides the profiled step's kernel time of each class (kernel names below) by what
megalite.planner.gpu_kernels counts for that class in the same step, as cluster.py's
ISSUE23_PROFILE does: the file is `plan.py --kernel-rates`' input; classes the step did not run
keep the preset's values and are listed as not measured.
"""

import argparse
import datetime
import importlib.metadata
import json
import re
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# kernel name (lowercase) -> class; the first match wins
KERNEL_CLASSES = (("flash_bwd_dq_dk_dv", "attention backward"), ("flash_fwd", "attention forward"),
                  ("flash", "attention auxiliary"), ("multi_tensor_apply", "optimizer"), ("_norm_", "norm"),
                  ("swiglu", "swiglu"), ("gelu", "bias_gelu"), ("_bda_", "bias_gelu"), ("rotary", "rotary"), ("_ce_", "cross_entropy"),
                  ("gemm", "gemm"), ("xmma", "gemm"), ("nvjet", "gemm"), ("cutlass", "gemm"), ("cublas", "gemm"))


def kernel_class(name: str) -> str:
    lower = name.lower()
    return next((kind for pattern, kind in KERNEL_CLASSES if pattern in lower), "torch")


def profile_summary(trace_path: Path) -> dict:
    """{'classes': {class: seconds}, 'kernels': count, 'busy': s, 'span': s} of a torch.profiler
    Chrome trace: kernel time by class; busy, the union of the kernels' intervals; span, from the
    first event to the last kernel's end (what the GPU did not spend in kernels waited)."""
    events = json.loads(Path(trace_path).read_text(encoding="utf-8")).get("traceEvents", [])
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    classes: dict[str, float] = {}
    for e in kernels:
        kind = kernel_class(e.get("name", ""))
        classes[kind] = classes.get(kind, 0.0) + e["dur"] * 1e-6
    busy, end = 0.0, None
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels):
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    first = min((e["ts"] for e in events if "ts" in e and e.get("ph") == "X"), default=0.0)
    span = (max(e["ts"] + e["dur"] for e in kernels) - first) * 1e-6 if kernels else 0.0
    return {"classes": classes, "kernels": len(kernels), "busy": busy * 1e-6, "span": span}


def copy_bandwidth(bench_kernels_log: Path) -> float | None:
    """bench_kernels.py's measured copy bandwidth, bytes/s."""
    if not Path(bench_kernels_log).exists():
        return None
    found = re.search(r"measured copy bandwidth: (\d+) GB/s", Path(bench_kernels_log).read_text(errors="replace"))
    return float(found.group(1)) * 1e9 if found else None


def measured_rates(summary: dict, flags: list[str], cluster_name: str, copy: float | None) -> dict:
    """The kernel-rates file: the preset's rates with every class the profiled step ran replaced by
    its measured kernel time over the planner's count for it."""
    from dataclasses import asdict

    from megalite.planner.cluster import preset
    from megalite.planner.gpu_kernels import attention_seconds, step_traffic
    from megalite.planner.layouts import Layout
    from megalite.planner.parameters import rank_parameters
    from megalite.planner.workload import from_flags
    from megalite.config.arguments import parse_args

    args = parse_args(flags)
    layout_flags = ("--micro-batch-size", "--use-distributed-optimizer", "--recompute-granularity",
                    "--recompute-method", "--recompute-num-layers")
    model, i = [], 0
    while i < len(flags):  # the model's flags without the layout's (the planner refuses those)
        takes = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if flags[i] not in layout_flags:
            model += flags[i:i + 1 + takes]
        i += 1 + takes
    workload = from_flags(model)
    layout = Layout(1, 1, 1, micro_batch_size=args.micro_batch_size, schedule="none")
    cluster = preset(cluster_name, 1)
    rates = asdict(cluster.kernels)
    copy = copy or rates["copy_bandwidth"]
    rates["copy_bandwidth"] = copy
    traffic = step_traffic(workload, layout)
    steps = layout.num_microbatches(workload.global_batch_size)
    passes = steps * workload.config.num_layers
    tokens = args.micro_batch_size * workload.seq_length
    forward, backward, aux = attention_seconds(cluster, workload, layout, tokens)
    params = sum(rank_parameters(workload.config, 1, 1, 1, 0))
    seconds, measured, notes = summary["classes"], [], {}
    if seconds.get("attention backward"):
        rates["attention"] = cluster.kernels.attention * passes * backward / seconds["attention backward"]
        measured.append("attention")
    if seconds.get("attention forward"):  # the preset assumes the backward's; shown, not used
        notes["attention_forward"] = cluster.kernels.attention * passes * forward / seconds["attention forward"]
    # the flash backward's auxiliary kernels run with the torch class (aux: their seconds at its rate)
    torch_bytes = sum(traffic.get("torch", [0, 0])) + passes * aux * cluster.kernels.rate("torch")
    torch_bytes += params * (4 + 4 + workload.activation_bytes)  # the optimizer's copy and zeroing
    amounts = {kind: sum(pair) for kind, pair in traffic.items() if kind != "torch"}
    amounts["torch"] = torch_bytes
    amounts["optimizer"] = params * (4 + 8 + 28)
    for kind, amount in amounts.items():
        spent = seconds.get(kind, 0.0) + (seconds.get("attention auxiliary", 0.0) if kind == "torch" else 0.0)
        if spent > 0 and amount > 0:
            notes[kind] = amount / spent / copy
            rates[kind] = min(1.0, notes[kind])  # above 1: the traffic model counts more than the kernels move
            measured.append(kind)
    return {"date": datetime.date.today().isoformat(), "measured": sorted(measured), "fractions": notes,
            "source": f"gpu_check.sh: profiled step of `{' '.join(flags)}`; unmeasured classes from the "
                      f"{cluster_name} preset",
            "kernels": dict(rates, source=f"gpu_check.sh {datetime.date.today().isoformat()}")}


def parse_steps(logs: Path) -> list[dict]:
    path = logs / "steps.tsv"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, seconds, budget = line.split("\t")
        rows.append(dict(name=name, status=status, seconds=int(seconds), budget=int(budget)))
    return rows


_OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_TEST_ID = re.compile(r"(tests/\S+::\S+)")


def log_summary(log: Path) -> str:
    """A pytest run killed before it wrote its --junitxml: the outcomes its verbose log (-v, one
    line per test, with or without xdist's [gwN] prefix) names, the failures by name."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    outcomes = {}
    for line in lines:
        outcome, test = _OUTCOME.search(line), _TEST_ID.search(line)
        if outcome and test and not line.startswith(("FAILED ", "ERROR ")):  # not the short summary
            outcomes[test.group(1)] = outcome.group(1)
    if not outcomes:
        return f"no result file; the log ends: {lines[-1].strip()[:200]}" if lines else "no result file"
    count = {k: sum(v == k for v in outcomes.values()) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    failed = [t.split("/")[-1] for t, v in outcomes.items() if v in ("FAILED", "ERROR")]
    text = (f"killed before the end: {count['PASSED']} passed, {count['FAILED'] + count['ERROR']} failed, "
            f"{count['SKIPPED']} skipped")
    return text + (": " + ", ".join(failed[:12]) + (" ..." if len(failed) > 12 else "") if failed else "")


def junit_summary(path: Path) -> str:
    """Passed, failed and skipped tests of a --junitxml file (a run killed before writing it: what
    its stream file (<name>.results, pytest_stream.py) says, else its verbose log)."""
    if not path.exists():
        stream = path.with_suffix(".results")
        if stream.exists():
            from pytest_stream import killed_run_summary

            return killed_run_summary(stream)
        return log_summary(path.with_suffix(".log"))
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name')}" for c in root.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    text = f"{passed} passed, {count['failures'] + count['errors']} failed, {count['skipped']} skipped"
    return text + (": " + ", ".join(failed) if failed else "")


def kernels_summary(log: Path) -> str:
    if not log.exists():
        return "no log"
    text = log.read_text(errors="replace")
    parts = []
    copy = copy_bandwidth(log)
    if copy:
        parts.append(f"copy {copy / 1e9:.0f} GB/s")
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2] == "triton":
            parts.append(f"{cells[0]} {cells[1]} {cells[7]}% (fwd/bwd/both) {cells[-1]}")
    return "; ".join(parts) or "no table in the log"


def model_summary(report: Path) -> str:
    if not report.exists():
        return "no report"
    rows = []
    for line in report.read_text(errors="replace").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0] not in ("model", "---") and not cells[0].startswith("-"):
            rows.append(f"{cells[0]} {cells[1]}: " + (f"{cells[3]} ms, MFU {cells[6]}, {cells[7]} peer"
                                                      if cells[3][:1].isdigit() else cells[3]))
    return "; ".join(rows) or "no rows"


def run_metrics(path: Path, profiled: int | None) -> dict | None:
    """ms per step (median over the training iterations after the first two, the profiled one
    left out), MFU and the peak memory of a --metrics-file."""
    from megalite.training.metrics import read_metrics

    if not path.exists():
        return None
    train, _ = read_metrics(str(path))  # evaluation records (with a "split") are not steps
    records = [train[i] for i in sorted(train)]
    if not records:
        return None
    timed = [r for r in records if r["iteration"] > 2 and r["iteration"] != profiled] or records[-1:]
    middle = sorted(timed, key=lambda r: r["elapsed_ms_per_iteration"])[len(timed) // 2]
    return {"ms": statistics.median(r["elapsed_ms_per_iteration"] for r in timed), "mfu": middle.get("mfu"),
            "memory_mib": max(r.get("memory_mb") or 0 for r in records), "memory_kind": records[-1].get("memory_kind")}


def dry_run_peak(log: Path) -> float | None:
    if not log.exists():
        return None
    peaks = [json.loads(line)["peak_total"] for line in log.read_text().splitlines() if line.startswith("{")]
    return max(peaks) / 2**20 if peaks else None


def plan_ms(path: Path) -> float | None:
    if not path.exists():
        return None
    ranked = json.loads(path.read_text())
    return ranked[0]["step_time"] * 1e3 if ranked else None


def _against(value: float | None, measured: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    text = f"{value:,.1f} {unit}"
    return text + (f" ({value / measured - 1:+.1%})" if measured else "")


def run_row(logs: Path, name: str, cluster: str) -> str:
    profiled = json.loads((logs / "profiled.json").read_text()).get(name) if (logs / "profiled.json").exists() else None
    metrics = run_metrics(logs / f"run-{name}.jsonl", profiled)
    ms, memory = (metrics["ms"], metrics["memory_mib"]) if metrics else (None, None)
    mfu = "n/a" if not metrics or metrics["mfu"] is None else f"{100 * metrics['mfu']:.1f}%"
    kind = "" if not metrics or metrics["memory_kind"] == "cuda_max_allocated" else f" ({metrics['memory_kind']})"
    measured = "not measured" if metrics is None else f"{ms:.1f} ms/step, MFU {mfu}, peak {memory:,.1f} MiB{kind}"
    text = (f"measured {measured}; dry run {_against(dry_run_peak(logs / f'dry-{name}.log'), memory, 'MiB')}; "
            f"planner ({cluster}) {_against(plan_ms(logs / f'plan-{name}.json'), ms, 'ms')}")
    fresh = plan_ms(logs / f"plan-rates-{name}.json")
    text += f"; planner with this GPU's rates {_against(fresh, ms, 'ms')}" if fresh is not None else ""
    twin = TWINS.get(name)
    return text + (f"; {loss_difference(logs / f'run-{name}.jsonl', logs / f'run-{twin}.jsonl', twin)}" if twin else "")


# runs that differ from their twin in one setting only: their losses should agree
TWINS = {"1b-compile-graphs": "1b-compile"}


def loss_difference(path: Path, twin_path: Path, twin: str) -> str:
    """The largest relative difference between two runs' per-iteration training losses."""
    from megalite.training.metrics import read_metrics

    losses = [{i: r["lm_loss"] for i, r in read_metrics(str(p))[0].items() if "lm_loss" in r} if p.exists() else {}
              for p in (path, twin_path)]
    common = sorted(set(losses[0]) & set(losses[1]))
    if not common:
        return f"losses against {twin}: n/a"
    worst = max(abs(losses[0][i] - losses[1][i]) / abs(losses[1][i]) for i in common)
    return f"losses against {twin}: largest relative difference {worst:.1e} over {len(common)} iterations"


def profile_row(logs: Path) -> str:
    path = logs / "profile.json"
    if not path.exists():
        return "no profile"
    summary = json.loads(path.read_text())
    if not summary["kernels"]:
        return "no GPU kernels in the trace (CPU run): kernel rates not measured"
    classes = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(summary["classes"].items(), key=lambda kv: -kv[1]))
    idle = summary["span"] - summary["busy"]
    rates = logs.parent / "kernel_rates.json"
    written = f"; rates: {rates.name} (measured: {', '.join(json.loads(rates.read_text())['measured'])})" \
        if rates.exists() else ""
    return (f"{summary['kernels']} kernels; GPU busy {1e3 * summary['busy']:.1f} ms of {1e3 * summary['span']:.1f} ms "
            f"(idle {1e3 * idle:.1f} ms); ms by class: {classes}{written}")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def host_summary(path: Path) -> str:
    """Per op, each implementation's host time per forward and backward call (bench_host_overhead.py's
    table), and where the launches were counted (no GPU) the time added to them. On a GPU launches
    are not counted and the added columns are '-': the report printed '+- us' for every row."""
    if not path.exists():
        return "no log"
    rows = [line.split("|")[1:-1] for line in path.read_text().splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in row] for row in rows if len(row) == 8 and row[0].strip() not in ("op", "---")]
    by_op = {}
    for op, impl, fwd, _, fwd_added, bwd, _, bwd_added in rows:
        signed = [v if v.startswith("-") else "+" + v for v in (fwd_added, bwd_added)]
        added = f" ({signed[0]}/{signed[1]} over its launches)" if "-" not in (fwd_added, bwd_added) else ""
        by_op.setdefault(op, []).append(f"{impl} {fwd}/{bwd} us{added}")
    parts = [f"{op}: {', '.join(impls)}" for op, impls in by_op.items()]
    return "us per call, forward/backward: " + "; ".join(parts) if parts else "no table in the log"


def attention_summary(log: Path) -> str:
    """Per shape, bench_attention.py's fastest kernel (forward + backward) with its shares of the
    bf16 peak, and megalite's auto beside it."""
    if not log.exists():
        return "no log"
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in log.read_text(errors="replace").splitlines()
            if line.startswith("| ") and not line.startswith("| shape")]
    timed = [r for r in rows if len(r) == 9 and r[-1].startswith("ok")]
    parts = []
    for shape in dict.fromkeys(r[0] for r in timed):
        mine = [r for r in timed if r[0] == shape]
        kernels = [r for r in mine if not r[1].startswith("megalite")]
        if not kernels:
            continue
        best = min(kernels, key=lambda r: float(r[2]) + float(r[3]))
        auto = next((r for r in mine if r[1] == "megalite auto"), None)
        text = f"{shape}: {best[1]} {best[2]}/{best[3]} ms ({best[6]}/{best[7]} of peak)"
        parts.append(text + (f", auto {auto[2]}/{auto[3]} ms" if auto else ""))
    return "; ".join(parts) or "no table in the log"


SUMMARIES = {"tests-kernels": lambda logs: junit_summary(logs / "tests-kernels.xml"),
             "bench-host-overhead": lambda logs: host_summary(logs / "bench-host-overhead.log"),
             "tests-tp-cuda": lambda logs: junit_summary(logs / "tests-tp-cuda.xml"),
             "bench-kernels": lambda logs: kernels_summary(logs / "bench-kernels.log"),
             "bench-attention": lambda logs: attention_summary(logs / "bench-attention.log"),
             "bench-model": lambda logs: model_summary(logs / "bench-model.md"),
             # bench_fp8.py's --json: each model's line (FP8 against bf16 and its targets)
             "bench-fp8": lambda logs: "; ".join(r["line"] for r in json.loads((logs / "bench-fp8.json").read_text())["rows"])
             if (logs / "bench-fp8.json").exists() else "no result file",
             "profile": profile_row}


def table(logs: Path, command: str, gpu: str, cluster: str) -> str:
    import torch

    lines = [f"# gpu_check, {datetime.date.today().isoformat()}", "",
             f"GPU: {gpu}; torch {torch.__version__}; triton {_version('triton')}; transformers "
             f"{_version('transformers')}", f"command: `{command}`", "",
             "| step | status | seconds (budget) | result |", "|---|---|---:|---|"]
    for step in parse_steps(logs):
        name = step["name"]
        if name.startswith("run-"):
            result = run_row(logs, name[4:], cluster)
        elif name.startswith(("dry-", "plan-")):
            continue  # shown in their run's row
        else:
            result = SUMMARIES.get(name, lambda _: "")(logs)
        lines.append(f"| {name} | {step['status']} | {step['seconds']} ({step['budget']}) | {result} |")
    failed = [s for s in parse_steps(logs) if s["name"].startswith(("dry-", "plan-")) and s["status"] != "ok"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} ({s['budget']}) | see its log |" for s in failed]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("table", help="the summary table of a gpu_check.sh run")
    t.add_argument("--logs", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--command", dest="cmdline", required=True)
    t.add_argument("--gpu", default="CPU (smoke run: the numbers mean nothing)")
    t.add_argument("--cluster", default="h200")
    r = sub.add_parser("rates", help="kernel rates from a profiled step")
    r.add_argument("--trace", type=Path, required=True)
    r.add_argument("--bench-kernels", type=Path)
    r.add_argument("--cluster", default="h200")
    r.add_argument("--summary", type=Path, required=True, help="write the trace's summary here")
    r.add_argument("--out", type=Path, required=True)
    own, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if argv and "--" in argv else (argv, [])
    args = parser.parse_args(own)
    if args.command == "table":
        text = table(args.logs, args.cmdline, args.gpu, args.cluster)
        args.out.write_text(text)
        print(text, end="")
        return 0
    summary = profile_summary(args.trace)
    args.summary.write_text(json.dumps(summary, indent=1))
    if not summary["kernels"]:
        print(f"gpu_check_report: {args.trace}: no GPU kernels in the trace, no rates written")
        return 0
    rates = measured_rates(summary, flags, args.cluster, copy_bandwidth(args.bench_kernels) if args.bench_kernels else None)
    args.out.write_text(json.dumps(rates, indent=1))
    print(f"gpu_check_report: wrote {args.out} (measured: {', '.join(rates['measured'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
