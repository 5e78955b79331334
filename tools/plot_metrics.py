"""Draw loss (train and validation), learning rate and throughput from a --metrics-file.

    python tools/plot_metrics.py runs/demo/metrics.jsonl --output runs/demo/loss.png

Records with a "split" are evaluations; the others are training iterations. When a resumed run
logged an iteration again, the last record wins. The PNG is written to a temporary name and
renamed, so a reader never sees half a file.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout too
from megalite.training.metrics import read_metrics  # noqa: E402


def _series(records: dict, key: str) -> tuple[list, list]:
    points = [(i, r[key]) for i, r in sorted(records.items()) if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot(train: dict, evals: dict, output: str, title: str) -> None:
    """Three panels: loss, learning rate and throughput, saved as a PNG at `output`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_ax, lr_ax, speed_ax) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    loss_ax.plot(*_series(train, "lm_loss"), label="train", linewidth=1)
    for split, marker in (("valid", "o"), ("test", "s")):
        if split in evals:
            loss_ax.plot(*_series(evals[split], "lm_loss"), marker, label=split)
    loss_ax.set_ylabel("lm loss")
    loss_ax.legend()
    loss_ax.set_title(title)
    lr_ax.plot(*_series(train, "learning_rate"))
    lr_ax.set_ylabel("learning rate")
    speed_ax.plot(*_series(train, "tokens_per_second_per_gpu"), label="tokens/s per GPU")
    speed_ax.set_ylabel("tokens/s per GPU")
    tflops = _series(train, "tflops_per_gpu")
    if tflops[0]:
        twin = speed_ax.twinx()
        twin.plot(*tflops, color="tab:orange", linewidth=1)
        twin.set_ylabel("TFLOP/s per GPU", color="tab:orange")
    speed_ax.set_xlabel("iteration")
    for axis in (loss_ax, lr_ax, speed_ax):
        axis.grid(alpha=0.3)
    figure.tight_layout()
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".{os.path.basename(output)}.tmp.{os.getpid()}")
    try:
        figure.savefig(temporary, format="png", dpi=100)
        os.replace(temporary, output)
    finally:
        plt.close(figure)
        if os.path.exists(temporary):
            os.remove(temporary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("metrics", help="JSON-lines file written by --metrics-file")
    parser.add_argument("--output", required=True, help="PNG to write")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_metrics: matplotlib is not installed; pip install matplotlib "
              "(or megalite[plot])", file=sys.stderr)
        return 1
    try:
        train, evals = read_metrics(args.metrics)
    except OSError as error:
        print(f"plot_metrics: cannot read {args.metrics}: {error.strerror}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"plot_metrics: {error}", file=sys.stderr)
        return 1
    if not train and not evals:
        print(f"plot_metrics: {args.metrics} holds no records", file=sys.stderr)
        return 1
    plot(train, evals, args.output, os.path.basename(args.metrics))
    print(f"plot_metrics: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
