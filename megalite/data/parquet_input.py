"""Reading the text columns of Parquet files, one row group at a time.

A row group is the unit Parquet stores, compresses and checksums together, so it is the
unit read here: memory holds one row group's text columns (in --max-shard-bytes sized
batches of rows once decoded), never a whole file. Rows are numbered from 1 in the file.
"""

from megalite.data.corpus import BadInput

ROWS_PER_BATCH = 1024


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ValueError("reading .parquet input needs the pyarrow package (pip install 'megalite[data]')") from None
    return pyarrow


def open_parquet(path: str):
    """A pyarrow ParquetFile (page checksums, where the writer stored them, are verified);
    a file that is not Parquet is a fatal BadInput."""
    pa = _pyarrow()
    try:
        return pa.parquet.ParquetFile(path, page_checksum_verification=True)
    except (OSError, pa.ArrowException) as e:
        raise BadInput(path, 1, f"not a readable Parquet file ({e})", fatal=True) from None


def row_group_sizes(path: str) -> list[int]:
    """Compressed bytes of each row group (what planning splits by)."""
    meta = open_parquet(path).metadata
    groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
    return [sum(g.column(c).total_compressed_size for c in range(g.num_columns)) for g in groups]


def read_parquet(path: str, first: int, last: int | None, keys: list[str]):
    """Yield (texts, nbytes, (path, 0, row)) per row of row groups [first, last) (last None:
    to the end) or a BadInput for a bad row (a null, or a value that is not UTF-8 text). A
    missing column or a corrupt row group is a fatal BadInput naming the row group's first row."""
    pa = _pyarrow()
    import pyarrow.compute as pc

    pf = open_parquet(path)
    meta = pf.metadata
    names = pf.schema_arrow.names
    missing = [k for k in keys if k not in names]
    if missing:
        raise BadInput(path, 1, f"missing column {missing[0]!r} (columns present: {sorted(names)[:8]})", fatal=True)
    types = {k: pf.schema_arrow.field(k).type for k in keys}
    last = meta.num_row_groups if last is None else last
    row = 1 + sum(meta.row_group(i).num_rows for i in range(first))
    for group in range(first, last):
        group_rows = meta.row_group(group).num_rows
        try:
            batches = list(pf.iter_batches(ROWS_PER_BATCH, row_groups=[group], columns=keys, use_threads=False))
        except (OSError, pa.ArrowException) as e:
            raise BadInput(path, row, f"corrupt Parquet data in row group {group} (rows {row} to "
                                      f"{row + group_rows - 1}): {e}", fatal=True) from None
        for batch in batches:
            columns, sizes = [], None
            for k in keys:
                column = batch.column(k)
                if pa.types.is_dictionary(column.type):
                    column = column.dictionary_decode()
                if pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or \
                        pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
                    length = pc.binary_length(column).to_numpy(zero_copy_only=False)
                    sizes = length if sizes is None else sizes + length
                columns.append(column.to_pylist())
            for i in range(batch.num_rows):
                texts, reason = [], None
                for k, column in zip(keys, columns):
                    value = column[i]
                    if isinstance(value, bytes):
                        try:
                            value = value.decode("utf-8")
                        except UnicodeDecodeError as e:
                            reason = f"column {k!r} holds bytes that are not UTF-8 text (at byte {e.start})"
                            break
                    if value is None:
                        reason = f"column {k!r} is null"
                        break
                    if not isinstance(value, str):
                        reason = f"column {k!r} holds {types[k]}, expected a string"
                        break
                    texts.append(value)
                if reason is not None:
                    yield BadInput(path, row, reason)
                else:
                    yield texts, int(sizes[i]) if sizes is not None else 0, (path, 0, row)
                row += 1
