"""Cutting input files into partitions and shards for parallel preprocessing, and reading a shard.

A piece is (path, start, end): a byte range of an uncompressed line-oriented file (a range
owns the lines that start inside it, so ranges need no alignment), row groups [start, end)
of a Parquet file, or a whole file (start 0, end None) for gzip and zstd input and
one-document-per-file text. A partition (one Slurm array task) is a contiguous run of
pieces chosen from the input's sizes and the number of partitions alone; a shard (one
worker's task) is a run of pieces within it.
"""

import os
from dataclasses import dataclass

from megalite.data.corpus import (STREAM_ERRORS, BadInput, damaged_gzip, decode_utf8, is_compressed, is_jsonl,
                                  is_parquet, json_line_texts, open_binary, parse_json_line, read_document_file)

MIN_SHARD_BYTES = 1 << 20


@dataclass
class Shard:
    index: int
    pieces: list  # [(path, start, end or None)]


def _whole_file(path: str, text_mode: str) -> bool:
    return is_compressed(path) or (text_mode == "file" and not is_jsonl(path) and not is_parquet(path))


def partition_pieces(paths, text_mode: str, partitions: int, index: int | None,
                     row_group_sizes=None) -> list[tuple]:
    """The pieces of partition `index` of `partitions` (None: of all, in order). The input,
    laid end to end, is cut into `partitions` equal byte spans; plain files are cut exactly
    at the span ends, a Parquet row group or a whole (compressed, one-document) file goes
    to the span holding its middle. Partitions 0..N-1 in order hold every piece once."""
    from megalite.data.parquet_input import row_group_sizes as read_sizes

    row_group_sizes = {} if row_group_sizes is None else row_group_sizes
    sizes = [os.path.getsize(p) for p in paths]
    total = max(1, sum(sizes))
    wanted = range(partitions) if index is None else [index]
    span = lambda part: (total * part // partitions, total * (part + 1) // partitions)  # noqa: E731
    owner = lambda a, b: min(partitions - 1, (a + b) * partitions // (2 * total))  # noqa: E731
    pieces, offset = [], 0
    for path, size in zip(paths, sizes):
        if is_parquet(path):
            groups = row_group_sizes.setdefault(path, read_sizes(path))
            scale, at, owned = size / max(1, sum(groups)), 0, []
            for g, nbytes in enumerate(groups):
                if owner(offset + int(at * scale), offset + int((at + nbytes) * scale)) in wanted:
                    owned.append(g)
                at += nbytes
            pieces.extend((path, g, g + 1) for g in owned)  # adjacent ones are joined below
        elif _whole_file(path, text_mode):
            if owner(offset, offset + size) in wanted:
                pieces.append((path, 0, None))
        else:
            for part in wanted:
                a, b = span(part)
                a, b = max(a, offset), min(b, offset + size)
                if a < b:
                    pieces.append((path, a - offset, b - offset))
        offset += size
    return _join_adjacent(pieces)


def _join_adjacent(pieces):
    out = []
    for piece in pieces:
        if out and out[-1][0] == piece[0] and piece[2] is not None and out[-1][2] == piece[1]:
            out[-1] = (piece[0], out[-1][1], piece[2])
        else:
            out.append(piece)
    return out


def plan_shards(pieces, text_mode: str, workers: int, min_shards: int, max_shard_bytes: int,
                row_group_sizes=None) -> list[Shard]:
    """Shards of about equal size: several per worker (for balance), at least `min_shards`."""
    from megalite.data.parquet_input import row_group_sizes as read_sizes

    row_group_sizes = {} if row_group_sizes is None else row_group_sizes

    def size_of(path, start, end):
        if is_parquet(path):
            return sum(row_group_sizes.setdefault(path, read_sizes(path))[start:end])
        return os.path.getsize(path) if end is None else end - start

    sizes = [size_of(*piece) for piece in pieces]
    total = sum(sizes)
    target = min(max_shard_bytes, max(MIN_SHARD_BYTES, total // (8 * workers)))
    target = max(1, min(target, total // min_shards)) if total else 1
    shards: list[list] = []
    group: list = []
    group_bytes = 0
    for (path, start, end), size in zip(pieces, sizes):
        if _whole_file(path, text_mode) and not is_compressed(path):  # one-document files, grouped
            group.append((path, 0, None))
            group_bytes += size
            if group_bytes >= target:
                shards.append(group)
                group, group_bytes = [], 0
            continue
        if group:
            shards.append(group)
            group, group_bytes = [], 0
        if end is None or size <= target:
            shards.append([(path, start, end)])
        elif is_parquet(path):
            run, run_bytes = start, 0
            for g in range(start, end):
                run_bytes += row_group_sizes[path][g]
                if run_bytes >= target or g == end - 1:
                    shards.append([(path, run, g + 1)])
                    run, run_bytes = g + 1, 0
        else:
            count = -(-size // target)
            bounds = [start + size * i // count for i in range(count + 1)]
            shards.extend([(path, a, b)] for a, b in zip(bounds, bounds[1:]))
    if group:
        shards.append(group)
    return [Shard(i, pieces) for i, pieces in enumerate(shards)]


def read_shard(shard: Shard, keys: list[str], text_mode: str):
    """Yield (texts, nbytes, where) per document (texts: one string per key; blank lines give
    empty strings; where: (path, first_line_offset, line)) or a BadInput, carrying
    .first_line_offset, for a bad line. A damaged gzip or zstd file or a corrupt Parquet row
    group gives a fatal BadInput and ends the shard."""
    from megalite.data.parquet_input import read_parquet

    for path, start, end in shard.pieces:
        try:
            if is_parquet(path):
                for item in read_parquet(path, start, end, keys):
                    if isinstance(item, BadInput):
                        item.first_line_offset = 0  # Parquet rows are numbered in the file
                    yield item
                continue
            if text_mode == "file" and not is_jsonl(path):
                text, nbytes = read_document_file(path)
                yield [text if text.strip() else ""] * len(keys), nbytes, (path, 0, 1)
                continue
            yield from _read_lines(path, start, end, keys)
        except BadInput as err:
            err.first_line_offset = 0  # a damaged compressed file or a one-document file: whole files, from byte 0
            yield err
            if err.fatal:
                return


def read_documents(paths: list[str], keys: list[str], text_mode: str):
    """Yield the texts (one string per key; blank lines give empty strings) of every
    document of whole files, in order; raise the first BadInput."""
    pieces = [(path, 0, None) for path in paths]  # Parquet: start 0, end None reads every row group
    for item in read_shard(Shard(0, pieces), keys, text_mode):
        if isinstance(item, BadInput):
            raise item
        yield item[0]


def _read_lines(path: str, start: int, end: int | None, keys: list[str]):
    jsonl = is_jsonl(path)
    blank = [""] * len(keys)
    with open_binary(path) as f:
        offset = 0
        if start:
            f.seek(start - 1)
            f.readline()  # the rest of the line that started before this range
            offset = f.tell()
        first_line_offset, pos, lineno = offset, offset, 0
        limit = float("inf") if end is None else end
        try:  # a damaged gzip or zstd stream is fatal, naming the first line it could not give
            for raw in f:
                if pos >= limit:
                    break
                lineno += 1
                pos += len(raw)
                if jsonl and (texts := json_line_texts(raw, keys)) is not None:
                    yield texts, len(raw), (path, first_line_offset, lineno)
                    continue
                try:
                    if not raw.strip():
                        texts = list(blank)
                    elif jsonl:
                        texts = parse_json_line(raw, keys, path, lineno)
                    else:
                        texts = [decode_utf8(raw, path, lineno).rstrip("\r\n")] * len(keys)
                except BadInput as err:
                    err.first_line_offset = first_line_offset
                    yield err
                    continue
                yield texts, len(raw), (path, first_line_offset, lineno)
        except STREAM_ERRORS as e:
            raise damaged_gzip(path, lineno + 1, e) from None


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
