"""`python -m tests.planner.fsdp2_dry_runs FLAGS [--next FLAGS ...]`: one dry run per group of
pretrain_gpt flags, all in this one process (under the fake CUDA shim), a JSON line each:
{'peak_total', 'peak', 'resident', 'formula', 'activation_peak', 'korthikanti'} of the first
stage. `measure` runs it from a test."""

import json
import subprocess
import sys

from megalite.dryrun.fake_cuda import exit_now, fake_cuda_ready, reexec_with_fake_cuda


def main(argv: list[str]) -> int:
    if not fake_cuda_ready():
        reexec_with_fake_cuda(["-m", "tests.planner.fsdp2_dry_runs", *argv])  # does not return
    from tests.dryrun.dry_run_json import reports

    groups, current = [], []
    for arg in argv + ["--next"]:
        if arg == "--next":
            groups.append(current)
            current = []
        else:
            current.append(arg)
    for flags in groups:
        report = reports(flags)[0]
        print(json.dumps({"peak_total": report.peak_total, "peak": report.peak, "resident": report.resident,
                          "formula": report.formula, "activation_peak": report.activation_peak,
                          "korthikanti": report.korthikanti}),
              flush=True)
    return 0


def measure(runs, seq: int) -> list[dict]:
    """The dry run of each (model flags, planner Layout, global batch size), in one fresh process."""
    argv = []
    for flags, layout, batch in runs:
        argv += flags + ["--seq-length", str(seq), "--global-batch-size", str(batch)] + layout.flags()
        argv += ["--dry-run", "--dry-run-world-size", str(layout.world_size), "--mock-data", "--lr", "1e-4",
                 "--train-iters", "1", "--next"]
    proc = subprocess.run([sys.executable, "-m", "tests.planner.fsdp2_dry_runs", *argv[:-1]], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
