"""The safetensors file format, read and written one tensor at a time.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the
raw little-endian tensor bytes. Reading seeks to one tensor's bytes instead of mapping the
file, so only that tensor is ever resident; writing takes the header (every name, shape and
dtype) up front and then streams the tensors in that order.
"""

import json
import os
import struct
from pathlib import Path

import torch

from megalite.checkpoint.publish import ConversionError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


def read_header(path: Path) -> tuple[dict, int]:
    """({name: entry}, offset of the data section) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ConversionError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise ConversionError(f"{path}: not a safetensors file (header of {size} bytes)")
            header = json.loads(f.read(size))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: not a safetensors file (bad header: {e})") from None
    header.pop("__metadata__", None)
    return header, 8 + size


def entry_spec(path: Path, name: str, entry: dict) -> tuple[tuple, torch.dtype]:
    """(shape, dtype) of a header entry."""
    if entry.get("dtype") not in DTYPES:
        raise ConversionError(f"{path}: tensor {name} has unsupported dtype {entry.get('dtype')!r}")
    return tuple(entry["shape"]), DTYPES[entry["dtype"]]


def read_tensor(path: Path, name: str, entry: dict, data_start: int) -> torch.Tensor:
    """One tensor of a safetensors file, read from disk into its own buffer."""
    shape, dtype = entry_spec(path, name, entry)
    begin, end = entry["data_offsets"]
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if end - begin != expected:
        raise ConversionError(f"{path}: tensor {name} has {end - begin} bytes, its shape {list(shape)} needs {expected}")
    buffer = bytearray(end - begin)
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        if f.readinto(buffer) != len(buffer):
            raise ConversionError(f"{path}: truncated (tensor {name} runs past the end of the file)")
    if not buffer:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


class SafetensorsWriter:
    """Writes one safetensors file whose tensors (name, shape, dtype) are known in advance;
    `write` must then be called for each of them, in that order."""

    def __init__(self, path: Path, specs: list[tuple[str, tuple, torch.dtype]], metadata: dict | None = None):
        self.path, self.specs, self.next = Path(path), specs, 0
        header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
        for name, shape, dtype in specs:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        self.file = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.next >= len(self.specs):
            raise ConversionError(f"{self.path}: unexpected extra tensor {name}")
        want_name, shape, dtype = self.specs[self.next]
        if (name, tuple(tensor.shape), tensor.dtype) != (want_name, tuple(shape), dtype):
            raise ConversionError(f"{self.path}: expected {want_name} {tuple(shape)} {dtype} next, got {name} "
                                  f"{tuple(tensor.shape)} {tensor.dtype}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.specs):
            missing = self.specs[self.next][0]
            self.file.close()
            raise ConversionError(f"{self.path}: tensor {missing} was never written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def plan_shards(specs: list[tuple[str, tuple, torch.dtype]], max_shard_bytes: int) -> list[list]:
    """Consecutive groups of specs of at most `max_shard_bytes` each (a bigger tensor alone)."""
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = torch.Size(spec[1]).numel() * torch.empty((), dtype=spec[2]).element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes (as transformers' max_shard_size)."""
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    value = str(text).strip().upper()
    for unit, factor in units.items():
        if value.endswith(unit):
            number = value[: -len(unit)].strip()
            break
    else:
        number, factor = value, 1
    try:
        result = int(float(number) * factor)
    except ValueError:
        raise ConversionError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or a byte "
                              "count") from None
    if result <= 0:
        raise ConversionError(f"--max-shard-size {text!r}: must be positive")
    return result
