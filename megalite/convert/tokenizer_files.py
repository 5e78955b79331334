"""Tokenizer files travelling with a converted checkpoint.

A megalite checkpoint names its tokenizer in common.json ({type, model, vocab_file,
merge_file}, Megatron's flags); a converted one keeps the files in `<save-dir>/tokenizer/`.
A Hugging Face directory holds tokenizer.json (HuggingFaceTokenizer), tokenizer.model
(SentencePieceTokenizer) or vocab.json + merges.txt (GPT2BPETokenizer).
"""

import json
import shutil
from pathlib import Path

from megalite.data.tokenizers import build_tokenizer

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "tokenizer.model", "vocab.json", "merges.txt")
HF_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
NO_TOKENIZER = {"type": None, "model": None, "vocab_file": None, "merge_file": None}
# What transformers needs to tokenize as megalite does (no BOS/EOS added to the text).
HF_TOKENIZER_CONFIGS = {
    "SentencePieceTokenizer": {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False},
    "GPT2BPETokenizer": {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
                         "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
}


def copy_hf_tokenizer(hf_dir: Path, staging: Path, final: Path) -> dict:
    """Copy the tokenizer files of a Hugging Face directory to `staging`/tokenizer and return
    the tokenizer entry pointing at them under `final` (where `staging` will be renamed to)."""
    found = [n for n in HF_TOKENIZER_FILES if (hf_dir / n).is_file()]
    if not found:
        return dict(NO_TOKENIZER)
    (staging / "tokenizer").mkdir()
    for name in found:
        shutil.copy2(hf_dir / name, staging / "tokenizer" / name)
    where = final / "tokenizer"
    if "tokenizer.json" in found:
        return {**NO_TOKENIZER, "type": "HuggingFaceTokenizer", "model": str(where)}
    if "tokenizer.model" in found:
        return {**NO_TOKENIZER, "type": "SentencePieceTokenizer", "model": str(where / "tokenizer.model")}
    if "vocab.json" in found and "merges.txt" in found:
        return {**NO_TOKENIZER, "type": "GPT2BPETokenizer", "vocab_file": str(where / "vocab.json"),
                "merge_file": str(where / "merges.txt")}
    return dict(NO_TOKENIZER)


def locate(path: str | None, root: Path) -> Path | None:
    """A tokenizer path from common.json: as written, relative to the checkpoint directory, or
    in its tokenizer/ folder (a checkpoint moved since)."""
    if not path:
        return None
    for candidate in (Path(path), root / path, root / "tokenizer" / Path(path).name):
        if candidate.exists():
            return candidate
    return None


def resolved_entry(entry: dict | None, root: Path) -> dict:
    """The entry with every path that can be found replaced by an existing one."""
    entry = {**NO_TOKENIZER, **(entry or {})}
    for key in ("model", "vocab_file", "merge_file"):
        found = locate(entry[key], root)
        if found is not None:
            entry[key] = str(found)
    return entry


def tokenizer_sources(entry: dict, root: Path) -> tuple[list[tuple[Path, str]], list[str]]:
    """([(existing file, name to give it in a Hugging Face directory)], [paths not found])."""
    kind, files, missing = entry.get("type"), [], []

    def want(path, name):
        found = locate(path, root)
        if found is None:
            missing.append(str(path))
        else:
            files.append((found, name))
        return found

    if kind == "SentencePieceTokenizer":
        want(entry.get("model"), "tokenizer.model")
    elif kind == "GPT2BPETokenizer":
        want(entry.get("vocab_file"), "vocab.json")
        want(entry.get("merge_file"), "merges.txt")
    elif kind == "HuggingFaceTokenizer":
        found = locate(entry.get("model"), root)
        if found is None:
            missing.append(str(entry.get("model")))
        else:
            directory = found if found.is_dir() else found.parent
            json_file = directory / "tokenizer.json" if found.is_dir() else found
            want(str(json_file), "tokenizer.json")
            files.extend((directory / n, n) for n in HF_SIDE_FILES if (directory / n).is_file())
    elif kind == "TikTokenizer":
        path = entry.get("model")
        want(path, Path(path).name if path else "tokenizer.tiktoken")
    return files, missing


def tokenizer_eod(entry: dict, vocab_size_arg: int | None = None) -> tuple[int | None, int | None]:
    """(end-of-document id, vocabulary size) of the tokenizer an entry names, or Nones when it
    cannot be built."""
    if not entry.get("type"):
        return None, None
    try:
        tok = build_tokenizer(entry["type"], tokenizer_model=entry.get("model"), vocab_file=entry.get("vocab_file"),
                              merge_file=entry.get("merge_file"), vocab_size=vocab_size_arg)
    except (ValueError, OSError):
        return None, None
    return tok.eod, tok.vocab_size


def export_tokenizer(entry: dict, root: Path, dest: Path) -> tuple[list[str], list[str]]:
    """Copy a megalite checkpoint's tokenizer files into Hugging Face directory `dest` (with a
    tokenizer_config.json making transformers tokenize the same way); ([copied], [missing])."""
    files, missing = tokenizer_sources(entry, root)
    for src, name in files:
        shutil.copy2(src, dest / name)
    copied = [name for _, name in files]
    config = HF_TOKENIZER_CONFIGS.get(entry.get("type"))
    if files and config and "tokenizer_config.json" not in copied:
        (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        copied.append("tokenizer_config.json")
    return copied, missing


def relocate_tokenizer(entry: dict | None, root: Path, staging: Path, final: Path) -> tuple[dict, list[str]]:
    """Copy a megalite checkpoint's tokenizer files into `staging`/tokenizer and return the entry
    pointing at them under `final`; paths not found stay as they were ([missing] returned)."""
    entry = {**NO_TOKENIZER, **(entry or {})}
    out, missing = dict(entry), []
    for key in ("model", "vocab_file", "merge_file"):
        if not entry[key]:
            continue
        found = locate(entry[key], root)
        if found is None:
            missing.append(entry[key])
            continue
        (staging / "tokenizer").mkdir(exist_ok=True)
        target = staging / "tokenizer" / found.name
        if found.is_dir():
            shutil.copytree(found, target, dirs_exist_ok=True)
        else:
            shutil.copy2(found, target)
        out[key] = str(final / "tokenizer" / found.name)
    return out, missing
