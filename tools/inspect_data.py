"""What an indexed dataset (.bin/.idx) holds: check it before spending a cluster on it.

    python tools/inspect_data.py data/corpus_text_document \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --show 3

prints documents, sequences, tokens and dtype, the token-length distribution (percentiles
and a histogram in power-of-two buckets), and the first --show documents decoded with the
tokenizer (token ids when no tokenizer is given), each cut to --max-chars characters.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.indexed_dataset import IndexedDataset  # noqa: E402
from megalite.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

BAR_WIDTH = 40


def length_histogram(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """(low, high, count) per power-of-two bucket [low, high) from the shortest to the longest."""
    if not len(lengths):
        return []
    buckets = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    buckets[lengths == 0] = -1
    counts = np.bincount(buckets + 1)
    first = int(np.flatnonzero(counts)[0])
    return [(0 if b == 0 else 2 ** (b - 1), 1 if b == 0 else 2 ** b, int(counts[b])) for b in range(first, len(counts))]


def describe(ds: IndexedDataset, prefix: str) -> list[str]:
    lengths = ds.sequence_lengths
    docs = len(ds.document_indices) - 1
    lines = [f"dataset    {prefix} (.bin {os.path.getsize(prefix + '.bin')} bytes)",
             f"documents  {docs}", f"sequences  {len(ds)}", f"tokens     {ds.num_tokens}", f"dtype      {ds.dtype}"]
    if not len(lengths):
        return lines
    points = [0, 10, 50, 90, 99, 100]
    values = np.percentile(lengths, points, method="nearest")
    lines.append("tokens per sequence: " + ", ".join(
        f"{'min' if p == 0 else 'max' if p == 100 else f'p{p}'} {int(v)}" for p, v in zip(points, values))
        + f", mean {lengths.mean():.1f}")
    histogram = length_histogram(lengths)
    top = max(count for _, _, count in histogram)
    for low, high, count in histogram:
        bar = "#" * (round(BAR_WIDTH * count / top) if count else 0)
        lines.append(f"  [{low:>7d}, {high:>7d})  {count:>10d}  {bar}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prefix", help="dataset prefix (a name ending in .bin or .idx counts as its prefix)")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="decode the first documents with it")
    p.add_argument("--tokenizer-model", help="SentencePiece .model, tokenizer.json or tiktoken file")
    p.add_argument("--vocab-file", help="GPT-2 vocab.json")
    p.add_argument("--merge-file", help="GPT-2 merges.txt")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size; TikTokenizer cap")
    p.add_argument("--show", type=int, default=3, help="how many documents to print from the start")
    p.add_argument("--max-chars", type=int, default=500, help="cut each printed document to this many characters")
    a = p.parse_args(argv)
    prefix = a.prefix[:-4] if a.prefix.endswith((".bin", ".idx")) else a.prefix
    try:
        ds = IndexedDataset(prefix)
        tokenizer = None
        if a.tokenizer_type:
            tokenizer = build_tokenizer(a.tokenizer_type, tokenizer_model=a.tokenizer_model,
                                        vocab_file=a.vocab_file, merge_file=a.merge_file, vocab_size=a.vocab_size)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(describe(ds, prefix)))
    docs = ds.document_indices
    for d in range(min(a.show, len(docs) - 1)):
        ids = np.concatenate([ds[i] for i in range(int(docs[d]), int(docs[d + 1]))] or [np.empty(0, ds.dtype)])
        if tokenizer is not None and len(ids) and int(ids.max()) >= tokenizer.vocab_size:
            print(f"error: {prefix}.bin document {d} holds token id {int(ids.max())}, beyond the "
                  f"{a.tokenizer_type}'s vocabulary of {tokenizer.vocab_size}: not the tokenizer it was made with",
                  file=sys.stderr)
            return 1
        text = tokenizer.decode(ids.tolist()) if tokenizer is not None else " ".join(map(str, ids.tolist()))
        cut = f" ... ({len(text) - a.max_chars} more characters)" if len(text) > a.max_chars else ""
        print(f"\n--- document {d}: {len(ids)} tokens\n{text[:a.max_chars]}{cut}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
