"""Summarise the embedded default run: final validation loss against the corpus's unigram
entropy (the loss of the best model that ignores context), and where the outputs are.

    python tools/demo_summary.py --metrics-file M.jsonl --data-path PREFIX [--checkpoint DIR] [--plot PNG]

Exits 1 when the validation loss is not below the unigram entropy.
"""

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megalite.data.indexed_dataset import IndexedDataset  # noqa: E402
from megalite.training.metrics import read_metrics  # noqa: E402


def unigram_entropy(prefix: str) -> float:
    """Entropy in nats of the token distribution of an indexed dataset."""
    counts = np.bincount(IndexedDataset(prefix).tokens().astype(np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics-file", required=True)
    parser.add_argument("--data-path", required=True, help="prefix of the .bin/.idx files trained on")
    parser.add_argument("--checkpoint")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    entropy = unigram_entropy(args.data_path)
    _, evaluations = read_metrics(args.metrics_file)
    last = {split: records[max(records)] for split, records in evaluations.items()}
    valid = last.get("valid")
    if valid is None:
        print(f"{args.metrics_file}: no validation loss recorded", file=sys.stderr)
        return 1
    loss = valid["lm_loss"]
    print("megalite demo finished")
    print(f"  final validation loss : {loss:.4f} nats (perplexity {math.exp(loss):.1f}) at iteration {valid['iteration']}")
    print(f"  unigram entropy       : {entropy:.4f} nats (the best loss without context)")
    test = last.get("test")
    if test is not None:
        print(f"  test loss             : {test['lm_loss']:.4f} nats")
    for label, path in (("checkpoint", args.checkpoint), ("loss plot", args.plot), ("metrics", args.metrics_file)):
        if path:
            print(f"  {label:<22}: {Path(path).resolve()}")
    if loss >= entropy:
        print(f"validation loss {loss:.4f} is not below the unigram entropy {entropy:.4f}", file=sys.stderr)
        return 1
    print(f"  the model is {entropy - loss:.2f} nats below the unigram entropy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
