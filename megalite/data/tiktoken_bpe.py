"""Exact BPE through tiktoken's Rust core (when tiktoken is installed and the model allows).

tiktoken cuts text into pre-tokens with a regex, returns a pre-token that is itself a
token as is, and otherwise merges, inside the pre-token, the adjacent pair whose
concatenation has the lowest rank (leftmost first) until no concatenation is a token. Its
ranks are given here as `{token bytes: rank}` and mapped back to the model's ids.

- SentencePiece BPE merges the adjacent pair whose concatenation is the best-scoring piece:
  the same rule, so ranks in score order give its ids exactly once characters are built
  from their UTF-8 bytes first (see sentencepiece_tokenizer.py).
- GPT-2 BPE merges listed pairs by merge rank: the same result when no two adjacent
  symbols that are not a listed merge ever concatenate to a token (see gpt2_bpe.py for
  the checks that guarantee it).
Each model is checked once, at load; a model that fails keeps the Python paths. The tests
compare both paths with the models' own encoders.
"""

from itertools import chain

import numpy as np


def tiktoken_module():
    try:
        import tiktoken
    except ImportError:
        return None
    return tiktoken


class TiktokenBPE:
    """tiktoken encoders (one per pre-token pattern) over one rank table.

    rank_ids[r] is the model id of rank r; -1 marks ranks without an id of their own
    (documents that produce one are left to the caller). `drop_rank`, if set, is removed
    from the output (a marker character the caller inserted into the text).
    """

    def __init__(self, name: str, ranks: dict[bytes, int], rank_ids: np.ndarray, patterns: dict[str, str],
                 drop_rank: int | None = None):
        tiktoken = tiktoken_module()
        self.encodings = {key: tiktoken.Encoding(f"{name}-{key}", pat_str=pattern, mergeable_ranks=ranks,
                                                 special_tokens={})
                          for key, pattern in patterns.items()}
        self.rank_ids = rank_ids.astype(np.int32)
        self.drop_rank = drop_rank

    def encode_bytes(self, texts: list[str], pattern: str) -> list[bytes | None]:
        """int32 id bytes of each (prepared) text; None where a rank without an id came out."""
        if not texts:
            return []
        encode = self.encodings[pattern].encode_ordinary
        counts = []

        def each_text():  # one text's list of Python ints alive at a time
            for text in texts:
                ranks = encode(text)
                counts.append(len(ranks))
                yield ranks

        ranks = np.fromiter(chain.from_iterable(each_text()), np.int32)
        ends = np.cumsum(counts)
        if self.drop_rank is not None:
            kept = ranks != self.drop_rank
            ranks = ranks[kept]
            ends = np.concatenate(([0], np.cumsum(kept)))[ends]
        ids = self.rank_ids[ranks]
        raw = ids.tobytes()
        stops = (4 * ends).tolist()
        out = [raw[a:b] for a, b in zip([0] + stops[:-1], stops)]
        if len(ids) and ids.min() < 0:
            bad = np.flatnonzero(ids < 0)
            for doc in set(np.searchsorted(ends, bad, side="right").tolist()):
                out[doc] = None
        return out


def encode_split(texts: list[str], use_fast, fast, slow) -> list[bytes]:
    """fast(texts) for the texts where use_fast(text), slow(texts) for the others and for
    those fast() returned None for; results in the order of `texts`."""
    picks = [i for i, t in enumerate(texts) if use_fast(t)]
    if len(picks) == len(texts):
        out = fast(texts)
    else:
        out = [None] * len(texts)
        if picks:
            for i, b in zip(picks, fast([texts[i] for i in picks])):
                out[i] = b
    rest = [i for i, b in enumerate(out) if b is None]
    if rest:
        for i, b in zip(rest, slow([texts[i] for i in rest])):
            out[i] = b
    return out
