"""Cutting input files into shards for parallel preprocessing, and reading a shard.

A shard is a list of pieces (path, start, end): a byte range of an uncompressed
line-oriented file, or a whole file (end None) for gzip input and one-document-per-file
text. A byte range owns the lines that start inside it, so ranges need no alignment.
"""

import os
from dataclasses import dataclass

from megalite.data.corpus import (BadInput, decode_utf8, is_gzip, is_jsonl, open_binary, parse_json_line,
                                  read_document_file, read_lines)

MIN_SHARD_BYTES = 1 << 20


@dataclass
class Shard:
    index: int
    pieces: list  # [(path, start, end or None)]


def plan_shards(paths, text_mode: str, workers: int, partitions: int, max_shard_bytes: int) -> list[Shard]:
    """Shards of about equal size: several per worker (for balance), at least `partitions`."""
    sizes = [os.path.getsize(p) for p in paths]
    total = sum(sizes)
    target = min(max_shard_bytes, max(MIN_SHARD_BYTES, total // (4 * workers)))
    target = max(1, min(target, total // partitions)) if total else 1
    shards: list[list] = []
    group: list = []
    group_bytes = 0
    for path, size in zip(paths, sizes):
        whole_file = is_gzip(path) or (text_mode == "file" and not is_jsonl(path))
        if whole_file and not is_gzip(path):
            group.append((path, 0, None))
            group_bytes += size
            if group_bytes >= target:
                shards.append(group)
                group, group_bytes = [], 0
            continue
        if group:
            shards.append(group)
            group, group_bytes = [], 0
        if whole_file or size <= target:
            shards.append([(path, 0, None)])
            continue
        count = -(-size // target)
        bounds = [size * i // count for i in range(count + 1)]
        shards.extend([(path, a, b)] for a, b in zip(bounds, bounds[1:]))
    if group:
        shards.append(group)
    return [Shard(i, pieces) for i, pieces in enumerate(shards)]


def read_shard(shard: Shard, keys: list[str], text_mode: str):
    """Yield (texts, nbytes, where) per document (texts: one string per key; blank lines give
    empty strings; where: (path, first_line_offset, line)) or a BadInput, carrying
    .first_line_offset, for a bad line. A damaged gzip file gives a fatal BadInput and ends
    the shard."""
    for path, start, end in shard.pieces:
        try:
            if text_mode == "file" and not is_jsonl(path):
                text, nbytes = read_document_file(path)
                yield [text if text.strip() else ""] * len(keys), nbytes, (path, 0, 1)
                continue
            yield from _read_lines(path, start, end, keys)
        except BadInput as err:
            err.first_line_offset = 0  # a damaged gzip file or a one-document file: whole files, from byte 0
            yield err
            if err.fatal:
                return


def read_documents(paths: list[str], keys: list[str], text_mode: str):
    """Yield the texts (one string per key; blank lines give empty strings) of every
    document of whole files, in order; raise the first BadInput."""
    for item in read_shard(Shard(0, [(path, 0, None) for path in paths]), keys, text_mode):
        if isinstance(item, BadInput):
            raise item
        yield item[0]


def _read_lines(path: str, start: int, end: int | None, keys: list[str]):
    jsonl = is_jsonl(path)
    with open_binary(path) as f:
        offset = 0
        if start:
            f.seek(start - 1)
            f.readline()  # the rest of the line that started before this range
            offset = f.tell()
        first_line_offset, pos = offset, offset
        for lineno, raw in enumerate(read_lines(f, path), 1):
            if end is not None and pos >= end:
                break
            pos += len(raw)
            try:
                if not raw.strip():
                    texts = [""] * len(keys)
                elif jsonl:
                    texts = parse_json_line(raw, keys, path, lineno)
                else:
                    texts = [decode_utf8(raw, path, lineno).rstrip("\r\n")] * len(keys)
            except BadInput as err:
                err.first_line_offset = first_line_offset
                yield err
                continue
            yield texts, len(raw), (path, first_line_offset, lineno)


def absolute_line(path: str, first_line_offset: int, line: int) -> int:
    """Line number in the file of line `line` of a range whose first line starts at
    byte `first_line_offset`."""
    if not first_line_offset:
        return line
    newlines = 0
    with open(path, "rb") as f:
        remaining = first_line_offset
        while remaining:
            chunk = f.read(min(remaining, 1 << 24))
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            remaining -= len(chunk)
    return newlines + line
