"""Megatron's MMIDIDX indexed dataset (.bin + .idx): memory-mapped reader, writer, merging.

The format (see docs/megatron-data-format.md): `.bin` holds the token ids of every sequence
back to back; `.idx` holds a 34-byte header (magic, version 1, dtype code, sequence count N,
document-index length D), then int32 lengths[N], int64 byte pointers[N], int64 document
indices[D] and, in multimodal files only, int8 modes[N]. Files written here are byte for
byte what Megatron-Core's IndexedDatasetBuilder writes for the same sequences.
"""

import os
import shutil
import struct
from array import array

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34
DTYPE_BY_CODE = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_BY_DTYPE = {np.dtype(t): code for code, t in DTYPE_BY_CODE.items()}


def dtype_for_vocab(vocab_size: int | None) -> type:
    """Megatron's token dtype: uint16 when the vocabulary has fewer than 65500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def temp_name(path: str) -> str:
    """A sibling name for writing `path` before renaming it into place."""
    return f"{path}.tmp-{os.getpid()}"


class IndexedDataset:
    """Read-only, memory-mapped view of `{prefix}.bin` / `{prefix}.idx`.

    `ds[i]` and `ds.get(i, offset, length)` return numpy views into the memory-mapped
    `.bin` (no copy). Problems with the files raise ValueError naming the file.
    """

    def __init__(self, prefix: str, mmap_bin: bool = True):
        """`mmap_bin` False (Megatron's --no-mmap-bin-files): read `.bin` into memory."""
        self.prefix = prefix = os.fspath(prefix)
        self.mmap_bin = mmap_bin
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for path in (ipath, bpath):
            if not os.path.isfile(path):
                raise ValueError(f"indexed dataset {prefix!r}: {path} does not exist")
        idx_size = os.path.getsize(ipath)
        if idx_size < HEADER_BYTES:
            raise ValueError(f"{ipath}: {idx_size} bytes is too short for an MMIDIDX header")
        self._idx = np.memmap(ipath, dtype=np.uint8, mode="r")
        header = bytes(self._idx[:HEADER_BYTES])
        if header[:9] != MAGIC:
            raise ValueError(f"{ipath}: not an MMIDIDX index (magic {header[:9]!r}, expected {MAGIC!r})")
        version, code, n, d = struct.unpack("<QBQQ", header[9:])
        if version != VERSION:
            raise ValueError(f"{ipath}: index version {version}, only version {VERSION} is supported")
        if code not in DTYPE_BY_CODE:
            raise ValueError(f"{ipath}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_BY_CODE[code])
        expected = HEADER_BYTES + 12 * n + 8 * d
        if idx_size not in (expected, expected + n):
            raise ValueError(f"{ipath}: {idx_size} bytes, expected {expected} (text) or {expected + n} "
                             f"(multimodal) for {n} sequences and {d} document indices")
        buf = self._idx.base if self._idx.base is not None else self._idx
        self.sequence_lengths = np.frombuffer(buf, np.int32, n, HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(buf, np.int64, n, HEADER_BYTES + 4 * n)
        self.document_indices = np.frombuffer(buf, np.int64, d, HEADER_BYTES + 12 * n)
        self.sequence_modes = (np.frombuffer(buf, np.int8, n, expected) if idx_size > expected else None)
        bin_size = os.path.getsize(bpath)
        if n:
            end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            if end > bin_size:
                raise ValueError(f"{bpath}: {bin_size} bytes, but {ipath} points up to byte {end}")
        # np.memmap cannot map an empty file; an empty dataset gets an empty array instead.
        if not bin_size:
            self._bin = np.empty(0, np.uint8)
        else:
            self._bin = np.memmap(bpath, dtype=np.uint8, mode="r") if mmap_bin else np.fromfile(bpath, np.uint8)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getstate__(self):  # reopen (and re-map) on unpickling rather than copying the data
        return {"prefix": self.prefix, "mmap_bin": self.mmap_bin}

    def __setstate__(self, state):
        self.__init__(state["prefix"], state.get("mmap_bin", True))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i, as a view into `.bin`."""
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start) if length else np.empty(0, self.dtype)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def tokens(self) -> np.ndarray:
        """All tokens of the dataset as one flat view."""
        return np.frombuffer(self._bin, self.dtype) if len(self._bin) else np.empty(0, self.dtype)


class IndexedDatasetWriter:
    """Write `{prefix}.bin/.idx` under temporary names; `finalize()` renames them into place.

    add_document(tokens) appends one document of one sequence (the usual case);
    add_item + end_document build documents of several sequences (sentence splitting);
    add_dataset(prefix) appends a whole existing dataset (merging). Memory grows by 12
    bytes per sequence only; token data goes straight to disk.
    """

    def __init__(self, prefix: str, dtype=np.int32, multimodal: bool = False):
        self.prefix = prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_BY_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no MMIDIDX code")
        self._bin_tmp = temp_name(bin_path(prefix))
        self._idx_tmp = temp_name(idx_path(prefix))
        self._bin = open(self._bin_tmp, "wb", buffering=1 << 20)
        self._lengths = array("i")
        self._doc_indices = array("q", [0])
        self._modes = array("b") if multimodal else None
        self._closed = False

    def add_item(self, tokens, mode: int = 0) -> None:
        data = np.asarray(tokens).astype(self.dtype, copy=False)
        self._bin.write(data.tobytes())
        self._lengths.append(data.size)
        if self._modes is not None:
            self._modes.append(mode)

    def end_document(self) -> None:
        self._doc_indices.append(len(self._lengths))

    def add_document(self, tokens, mode: int = 0) -> None:
        self.add_item(tokens, mode)
        self.end_document()

    def add_documents(self, data, lengths) -> None:
        """Append many one-sequence documents at once: `data` (bytes, or a contiguous array)
        holds their tokens already in this writer's dtype, back to back; `lengths` their
        sizes in tokens."""
        self._bin.write(data)
        start = len(self._lengths)
        self._lengths.extend(lengths)
        self._doc_indices.extend(range(start + 1, len(self._lengths) + 1))
        if self._modes is not None:
            self._modes.extend(bytes(len(lengths)))

    def add_dataset(self, prefix: str) -> None:
        """Append every document of the dataset at `prefix` (same dtype required)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {prefix} ({other.dtype}) into {self.prefix} ({self.dtype})")
        if (other.sequence_modes is not None) != (self._modes is not None):
            raise ValueError(f"cannot merge {prefix}: multimodal and text indices do not mix")
        append_file(bin_path(prefix), self._bin)
        offset = len(self._lengths)
        self._lengths.frombytes(other.sequence_lengths.tobytes())
        self._doc_indices.frombytes((other.document_indices[1:] + offset).tobytes())
        if self._modes is not None:
            self._modes.frombytes(other.sequence_modes.tobytes())

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    def finalize(self) -> None:
        """Write the index and rename both files to their final names (.idx last)."""
        self._bin.close()
        lengths = np.frombuffer(self._lengths, np.int32) if self._lengths else np.empty(0, np.int32)
        docs = np.frombuffer(self._doc_indices, np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODE_BY_DTYPE[self.dtype], len(lengths), len(docs)))
            f.write(lengths.tobytes())
            write_pointers(f, lengths, self.dtype.itemsize)
            f.write(docs.tobytes())
            if self._modes is not None:
                f.write(self._modes.tobytes())
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))
        self._closed = True

    def abort(self) -> None:
        """Close and delete the temporary files (nothing appears under the final names)."""
        if not self._bin.closed:
            self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and not self._closed:
            self.finalize()
        elif not self._closed:
            self.abort()


def append_file(path: str, out) -> None:
    """Append the file at `path` to the open binary file `out`: copied by the kernel
    (copy_file_range, no round trip through this process's memory) where it can, else
    through a fixed 1 MiB buffer; memory stays independent of the size either way."""
    out.flush()
    with open(path, "rb") as src:
        size, copied = os.fstat(src.fileno()).st_size, 0
        if hasattr(os, "copy_file_range"):
            try:
                while copied < size and (n := os.copy_file_range(src.fileno(), out.fileno(), size - copied)):
                    copied += n
            except OSError:  # not supported between these files: the rest goes the portable way
                pass
            out.seek(0, os.SEEK_END)  # the buffered writer learns where the kernel left the file
        src.seek(copied)
        shutil.copyfileobj(src, out, 1 << 20)


def write_pointers(f, lengths: np.ndarray, itemsize: int, chunk: int = 1 << 22) -> None:
    """Write the int64 byte pointers (exclusive cumulative sum of lengths x itemsize) in chunks."""
    start = 0
    for i in range(0, len(lengths), chunk):
        sizes = lengths[i:i + chunk].astype(np.int64) * itemsize
        ends = np.cumsum(sizes) + start
        f.write((ends - sizes).tobytes())
        start = int(ends[-1])


def merge_datasets(output_prefix: str, input_prefixes: list[str]) -> None:
    """Concatenate datasets (same dtype) into one at `output_prefix`, in the given order."""
    if not input_prefixes:
        raise ValueError("merge_datasets: no input datasets")
    first = IndexedDataset(input_prefixes[0])
    writer = IndexedDatasetWriter(output_prefix, first.dtype, multimodal=first.sequence_modes is not None)
    with writer:
        for prefix in input_prefixes:
            writer.add_dataset(prefix)
