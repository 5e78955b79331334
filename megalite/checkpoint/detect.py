"""Which checkpoint format a directory holds (read): megalite's, Megatron-LM's torch or
torch_dist, or a Hugging Face model directory; so a tool given the wrong kind says what it was
given and what to run instead, rather than that a file of its own format is missing."""

import shlex
from pathlib import Path

from megalite.checkpoint.megatron.reader import TRACKER, megatron_format

LOADERS = {"megalite": "megalite", "Megatron-LM torch": "megatron", "Megatron-LM torch_dist": "megatron",
           "Hugging Face": "hf"}  # convert.py's --loader for each kind


def checkpoint_kind(path, iteration: int | None = None) -> str | None:
    """'megalite', 'Megatron-LM torch', 'Megatron-LM torch_dist', 'Hugging Face', or None when
    `path` holds none of them."""
    path = Path(path)
    if not path.is_dir():
        return None
    megatron = megatron_format(path, iteration)
    if megatron is not None:
        return f"Megatron-LM {megatron}"
    if (path / TRACKER).is_file():
        return "megalite"
    if (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))):
        return "Hugging Face"
    return None


def convert_first(path, kind: str) -> str:
    """The line saying that `path` is a `kind` checkpoint and the command converting it to
    megalite's format."""
    path = Path(path)
    target = path.parent / f"{path.name}-megalite"
    command = (f"python tools/checkpoint/convert.py --loader {LOADERS[kind]} --saver megalite "
               f"--load-dir {shlex.quote(str(path))} --save-dir {shlex.quote(str(target))}")
    return f"{path}: a {kind} checkpoint, not megalite's format; convert it first: {command}"
