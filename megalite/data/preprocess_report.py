"""What a preprocessing run reports: progress lines (documents/s, MB/s, tokens/s) while it
runs, and for the summary at the end, skipped lines by kind and tokens per document."""

import re
import sys
import time

import numpy as np


def reason_kind(reason: str) -> str:
    """What a skipped line's reason says without its specifics (positions, values)."""
    return re.sub(r"(?<![\w-])\d+(?![\w-])", "N", reason.split(" (")[0].split(":")[0])


def length_percentiles(prefix: str) -> dict:
    """Tokens per document (of the first key's dataset): min, p10, p50, p90, p99, max."""
    from megalite.data.indexed_dataset import IndexedDataset

    lengths = IndexedDataset(prefix).sequence_lengths
    if not len(lengths):
        return {}
    points = dict(min=0, p10=10, p50=50, p90=90, p99=99, max=100)
    values = np.percentile(lengths, list(points.values()), method="nearest")
    return {name: int(v) for name, v in zip(points, values)}


class Progress:
    """Prints docs/s, MB/s and tokens/s every --log-interval documents (checked twice a second)."""

    def __init__(self, log_interval: int, stream=None):
        self.log_interval = max(1, log_interval)
        self.next_report = self.log_interval
        self.start = time.perf_counter()
        self.stream = stream or sys.stderr

    def line(self, docs, nbytes, tokens, final=False) -> str:
        dt = max(time.perf_counter() - self.start, 1e-9)
        head = "done" if final else "processed"
        return (f"{head} {docs} documents ({docs / dt:.0f} docs/s, {nbytes / dt / 1e6:.2f} MB/s, "
                f"{tokens / dt:.0f} tokens/s, {dt:.1f} s)")

    def update(self, docs, nbytes, tokens):
        if docs >= self.next_report:
            print(self.line(docs, nbytes, tokens), file=self.stream, flush=True)
            self.next_report = (docs // self.log_interval + 1) * self.log_interval
