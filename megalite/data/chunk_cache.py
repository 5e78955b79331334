"""Encode text through a cache of independently-tokenisable chunks.

Byte-level BPE and SentencePiece BPE both tokenise text piece by piece: no token crosses
certain boundaries (GPT-2: a whitespace character after a non-whitespace one; SentencePiece:
a space after a non-space). Cutting the text at those boundaries gives chunks whose token
ids do not depend on their neighbours, so `encode(text) == concat(encode(chunk))`. Real
corpora repeat chunks constantly; looking them up in a dict is many times faster than
tokenising them again, and all the per-chunk work below runs in C (regex findall,
dict lookups through map(), bytes.join) rather than in a Python loop.

Token ids are kept as int32 bytes so that a document is one `bytes.join`.
"""

from itertools import chain, filterfalse


class ChunkCache:
    """Tokenise batches of texts via a bounded chunk -> int32-ids-bytes cache.

    split(text) must return chunks whose concatenation is `text`; encode_chunks(chunks)
    must return the int32 id bytes of each chunk, tokenised on its own.
    """

    def __init__(self, split, encode_chunks, max_entries: int = 1 << 19):
        self.split = split
        self.encode_chunks = encode_chunks
        self.max_entries = max_entries
        self.table: dict[str, bytes] = {}

    def encode_batch_bytes(self, texts: list[str]) -> list[bytes]:
        """int32 token-id bytes of each text."""
        if len(self.table) > self.max_entries:
            self.table.clear()  # bounded memory; a batch's own chunks are re-added below
        table = self.table
        splits = [self.split(t) for t in texts]
        missing = list(set(filterfalse(table.__contains__, chain.from_iterable(splits))))
        if missing:
            table.update(zip(missing, self.encode_chunks(missing)))
        lookup = table.__getitem__
        return [b"".join(map(lookup, chunks)) for chunks in splits]
