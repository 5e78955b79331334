"""Reading raw corpora: JSONL and plain text (optionally gzip'd or zstd'd) and Parquet,
with precise errors.

Every reader here streams: a file is read a line (or a bounded chunk, or one Parquet row
group) at a time. Bad input raises `BadInput`, whose message names the file, the line (or
Parquet row) number and what was wrong.
"""

import glob
import gzip
import io
import json
import os
import zlib

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text")
ZSTD_SUFFIXES = (".zst", ".zstd")
PARQUET_SUFFIXES = (".parquet",)


class BadInput(ValueError):
    """A bad line of input; str() is 'FILE:LINE: REASON'. A fatal one (a damaged file, not
    a bad line) stops preprocessing even with --skip-bad-lines."""

    def __init__(self, path: str, line: int, reason: str, fatal: bool = False):
        self.path, self.line, self.reason, self.fatal = path, line, reason, fatal
        super().__init__(f"{path}: row {line}: {reason}" if is_parquet(path) else f"{path}:{line}: {reason}")


def _zstd_error():
    try:
        import zstandard
    except ImportError:
        return ()
    return (zstandard.ZstdError,)


GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)
STREAM_ERRORS = GZIP_ERRORS + _zstd_error()


def damaged_gzip(path: str, line: int, error: Exception) -> BadInput:
    """The fatal BadInput for a gzip stream that broke while reading line `line`."""
    if isinstance(error, EOFError):
        reason = "gzip file is truncated (it ends before the end-of-stream marker)"
    elif isinstance(error, gzip.BadGzipFile) and str(error).startswith("Not a gzipped file"):
        reason = f"not a gzip file ({error}); rename it without .gz if it is not compressed"
    elif is_zstd(path):
        reason = f"corrupt zstd data ({error})"
    else:
        reason = f"corrupt gzip data ({error})"
    return BadInput(path, line, reason, fatal=True)


def read_document_file(path: str) -> tuple[str, int]:
    """(text, size in bytes) of a one-document file; BadInput on invalid UTF-8 (the line
    of the first bad byte) or on a damaged gzip stream (fatal)."""
    chunks, newlines = [], 0
    with open_binary(path) as f:
        try:
            while chunk := f.read(1 << 20):
                chunks.append(chunk)
                newlines += chunk.count(b"\n")
        except STREAM_ERRORS as e:
            raise damaged_gzip(path, newlines + 1, e) from None
    raw = b"".join(chunks)
    try:
        return raw.decode("utf-8"), len(raw)
    except UnicodeDecodeError as e:
        raise BadInput(path, raw.count(b"\n", 0, e.start) + 1, f"invalid UTF-8 ({e.reason})") from None


def is_gzip(path: str) -> bool:
    return path.endswith(".gz")


def is_zstd(path: str) -> bool:
    return path.endswith(ZSTD_SUFFIXES)


def is_compressed(path: str) -> bool:
    """A stream that can only be read from its start (gzip, zstd)."""
    return is_gzip(path) or is_zstd(path)


def is_parquet(path: str) -> bool:
    return path.endswith(PARQUET_SUFFIXES)


def _uncompressed_name(path: str) -> str:
    return path.rsplit(".", 1)[0] if is_compressed(path) else path


def is_jsonl(path: str) -> bool:
    """JSONL by extension (.jsonl, .json, .ndjson, optionally .gz or .zst; a bare NAME.zst
    too, as zstd corpora are JSONL); Parquet is Parquet; anything else is text."""
    base = _uncompressed_name(path)
    return base.endswith(JSONL_SUFFIXES) or (is_zstd(path) and not base.endswith(TEXT_SUFFIXES))


def _supported(path: str) -> bool:
    return is_parquet(path) or is_zstd(path) or _uncompressed_name(path).endswith(JSONL_SUFFIXES + TEXT_SUFFIXES)


def expand_inputs(inputs: list[str], flag: str = "--input") -> list[str]:
    """Files named by `inputs` (files, directories, globs), each group in sorted order.

    Directories contribute their JSONL and text files (recursively); a name that is neither
    an existing path nor a glob with matches is an error naming it.
    """
    paths: list[str] = []
    for item in inputs:
        if os.path.isfile(item):
            paths.append(item)
        elif os.path.isdir(item):
            found = sorted(
                os.path.join(root, name)
                for root, _, names in os.walk(item)
                for name in names
                if _supported(name)
            )
            if not found:
                raise ValueError(f"{flag} {item}: directory holds no .jsonl, .json, .txt (or .gz, .zst) "
                                 "or .parquet files")
            paths.extend(found)
        else:
            found = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not found:
                raise ValueError(f"{flag} {item}: no such file, directory or glob match")
            paths.extend(found)
    return paths


def open_binary(path: str):
    if is_gzip(path):
        return gzip.open(path, "rb")
    if is_zstd(path):
        try:
            import zstandard
        except ImportError:
            raise ValueError(f"{path}: reading .zst input needs the zstandard package "
                             "(pip install 'megalite[data]')") from None
        return io.BufferedReader(_ZstdFrames(path, zstandard), buffer_size=1 << 20)
    return open(path, "rb", buffering=1 << 20)


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a file of zstd frames, streamed. Unlike zstandard's
    stream_reader, a file that ends inside a frame is an error, not a short read."""

    def __init__(self, path: str, zstandard):
        self.file, self.zstandard = open(path, "rb"), zstandard
        self.frame = zstandard.ZstdDecompressor().decompressobj()
        self.pending, self.pos, self.in_frame, self.unused = b"", 0, False, b""
        self.frame_start = 0  # byte offset in the file of the frame being decompressed

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.pos == len(self.pending):  # one frame (or 256 KiB of input) at a time, so that
            self.pending, self.pos = b"", 0    # a damaged frame stops after the lines before it
            chunk, self.unused = self.unused or self.file.read(1 << 18), b""
            if not chunk:
                if self.in_frame:
                    raise self.zstandard.ZstdError(f"the file is truncated inside the frame starting at byte "
                                                   f"{self.frame_start}")
                return 0
            self.in_frame = True
            try:
                self.pending = self.frame.decompress(chunk)
            except self.zstandard.ZstdError as e:
                raise self.zstandard.ZstdError(f"{e}, in the frame starting at byte {self.frame_start}") from None
            if self.frame.eof:  # the next frame starts in what this one left
                self.unused, self.in_frame = self.frame.unused_data, False
                self.frame_start = self.file.tell() - len(self.unused)
                self.frame = self.zstandard.ZstdDecompressor().decompressobj()
        n = min(len(buffer), len(self.pending) - self.pos)
        buffer[:n] = memoryview(self.pending)[self.pos:self.pos + n]
        self.pos += n
        return n

    def close(self):
        self.file.close()
        super().close()


def decode_utf8(raw: bytes, path: str, line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(path, line, f"invalid UTF-8 at byte {e.start} of the line ({e.reason})") from None


_SCAN_JSON = json.JSONDecoder().scan_once  # what json.loads runs, without its two Python-level wrappers
_JSON_WHITESPACE = " \t\n\r"  # what json.loads allows around the value


def json_line_texts(raw: bytes, keys: list[str]) -> list[str] | None:
    """parse_json_line's strings for a well-formed line, or None where anything is unusual
    (parse_json_line then gives the same strings or the precise error): one pass of the
    C scanner that json.loads runs, over a line that starts with the object."""
    try:
        text = raw.decode("utf-8")
        obj, end = _SCAN_JSON(text, 0)
        out = [obj[key] for key in keys]
    except (ValueError, StopIteration, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
        return None
    if type(obj) is not dict or (end != len(text) and text[end:].strip(_JSON_WHITESPACE)):
        return None
    for value in out:
        if type(value) is not str:
            return None
        if not value.isascii() and b"\\u" in raw:  # a lone surrogate from a \uD800-style escape?
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return None
    return out


def parse_json_line(raw: bytes, keys: list[str], path: str, line: int) -> list[str]:
    """The strings under `keys` of one JSONL line; BadInput on anything else."""
    text = decode_utf8(raw, path, line)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:  # the column within the line, its end counted as one past it
        length = len(text.rstrip("\r\n"))
        where = " (end of line)" if e.pos >= length else ""
        raise BadInput(path, line, f"malformed JSON: {e.msg} at column {min(e.pos, length) + 1}{where}") from None
    if not isinstance(obj, dict):
        raise BadInput(path, line, f"expected a JSON object, got {type(obj).__name__}")
    out = []
    for key in keys:
        if key not in obj:
            raise BadInput(path, line, f"missing key {key!r} (keys present: {sorted(obj)[:8]})")
        value = obj[key]
        if not isinstance(value, str):
            raise BadInput(path, line, f"key {key!r} holds {type(value).__name__}, expected a string")
        if b"\\u" in raw and not value.isascii():  # a \uD800-style escape may leave a lone surrogate
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BadInput(path, line, f"key {key!r} holds a lone surrogate "
                                           f"\\u{ord(value[e.start]):04x}, which is not valid Unicode") from None
        out.append(value)
    return out

