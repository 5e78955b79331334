"""A Hugging Face model directory read tensor by tensor.

Supported weight files, in order of preference: model.safetensors.index.json (sharded),
model.safetensors, pytorch_model.bin.index.json (sharded) and pytorch_model.bin. Safetensors
are read one tensor at a time from disk; PyTorch files are opened with
torch.load(weights_only=True, mmap=True), one shard at a time.
"""

import json
import pickle
from pathlib import Path

import torch

from megalite.checkpoint.dcp.storage import load_failure
from megalite.checkpoint.publish import ConversionError
from megalite.checkpoint.hf.safetensors_io import entry_spec, read_header, read_tensor
from megalite.model.config import GPTConfig
from megalite.checkpoint.hf.mapping import config_from_hf

WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")
# Checkpoints saved from the base model (GPT2Model, LlamaModel) name tensors without these.
BASE_PREFIXES = ("transformer.", "model.")
REQUIRED_FIELDS = {
    "gpt2": ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"),
    "llama": ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
              "max_position_embeddings"),
}
REQUIRED_FIELDS["qwen3"] = REQUIRED_FIELDS["llama"]
# Tensors a Hugging Face directory may hold that megalite does not need (DeepSeek-V3's MTP
# layers repeat the embedding and the output head, which megalite shares with the model).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq", "lm_head.weight",
                    ".embed_tokens.weight", ".shared_head.head.weight")


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConversionError(f"{path}: missing ({what})")
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return value


class HFCheckpoint:
    """config.json and weights of a GPT2LMHeadModel / LlamaForCausalLM directory."""

    def __init__(self, directory):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ConversionError(f"--load-dir {self.dir}: no such directory")
        self.hf_config = read_json(self.dir / "config.json", "a Hugging Face model directory needs config.json")
        required = REQUIRED_FIELDS.get(self.hf_config.get("model_type"), ())
        missing = [f for f in required if self.hf_config.get(f) is None]
        if missing:
            raise ConversionError(f"{self.dir / 'config.json'}: no {', '.join(missing)} "
                                  f"(needed for model_type {self.hf_config['model_type']!r})")
        try:
            self.config: GPTConfig = config_from_hf(self.hf_config)
        except (ValueError, TypeError) as e:
            raise ConversionError(f"{self.dir / 'config.json'}: {e}") from None
        self.files: dict[str, Path] = {}  # tensor name -> file
        self.headers: dict[Path, tuple[dict, int]] = {}
        self._bin_file, self._bin_state = None, None
        self.used: set[str] = set()
        self._index_weights()
        mtp_layer = f"model.layers.{self.config.num_layers}.eh_proj.weight"
        if self.config.mtp_num_layers and not any(n in self.files for n in (mtp_layer, mtp_layer[len("model."):])):
            # DeepseekV3Config says num_nextn_predict_layers=1 whether or not the files hold the layer
            self.config = self.config.replace(mtp_num_layers=None)

    def _index_weights(self) -> None:
        found = next((name for name in WEIGHT_FILES if (self.dir / name).is_file()), None)
        if found is None:
            raise ConversionError(f"{self.dir}: no model weights (expected one of {', '.join(WEIGHT_FILES)})")
        self.weights_file = self.dir / found
        if found.endswith(".index.json"):
            weight_map = read_json(self.weights_file, "weight index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{self.weights_file}: no weight_map object")
            for name, file in weight_map.items():
                path = self.dir / file
                if not path.is_file():
                    raise ConversionError(f"{path}: missing (listed in {self.weights_file.name} for tensor {name})")
                self.files[name] = path
        elif found == "model.safetensors":
            self.files = dict.fromkeys(self._header(self.weights_file)[0], self.weights_file)
        else:
            self.files = dict.fromkeys(self._bin(self.weights_file), self.weights_file)

    def _header(self, path: Path) -> tuple[dict, int]:
        if path not in self.headers:
            self.headers[path] = read_header(path)
        return self.headers[path]

    def _bin(self, path: Path) -> dict:
        """The state dict of one PyTorch weight file (memory-mapped when the format allows)."""
        if self._bin_file != path:
            self._bin_state = None  # drop the previous shard first
            try:
                try:
                    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # the legacy (non-zip) format cannot be mapped
                    state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any failure means an unusable weight file
                if isinstance(e, pickle.UnpicklingError):
                    raise ConversionError(f"{path}: refused as unsafe, not plain PyTorch weights ({load_failure(e)}); "
                                          "nothing in it was run") from None
                raise ConversionError(f"{path}: cannot be read as PyTorch weights ({load_failure(e)})") from None
            if not isinstance(state, dict):
                raise ConversionError(f"{path}: expected a state dict, found {type(state).__name__}")
            self._bin_file, self._bin_state = path, state
        return self._bin_state

    def resolve(self, name: str) -> str:
        """The name under which this directory stores `name`."""
        if name in self.files:
            return name
        for prefix in BASE_PREFIXES:
            if name.startswith(prefix) and name[len(prefix):] in self.files:
                return name[len(prefix):]
        raise ConversionError(f"{self.weights_file}: no tensor {name}")

    def _locate(self, name: str) -> tuple[str, Path, dict]:
        """(stored name, file, that file's header or state dict) of tensor `name`, which counts
        as used."""
        stored = self.resolve(name)
        self.used.add(stored)
        path = self.files[stored]
        entries = self._header(path)[0] if path.suffix == ".safetensors" else self._bin(path)
        if stored not in entries:
            raise ConversionError(f"{path}: no tensor {stored} (the index says it is there)")
        return stored, path, entries

    def spec(self, name: str) -> tuple[tuple, torch.dtype]:
        """(stored shape, dtype) of tensor `name`, from the safetensors header or the PyTorch
        file's memory-mapped state dict: no tensor data is read. (A PyTorch file in the legacy,
        non-zip format cannot be mapped: it is loaded whole, and when sharded, again by `get`.)"""
        stored, path, entries = self._locate(name)
        if path.suffix == ".safetensors":
            return entry_spec(path, stored, entries[stored])
        return tuple(entries[stored].shape), entries[stored].dtype

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` (a Hugging Face parameter name)."""
        stored, path, entries = self._locate(name)
        if path.suffix == ".safetensors":
            return read_tensor(path, stored, entries[stored], self._header(path)[1])
        return entries[stored]

    def unused(self) -> list[str]:
        """Stored tensors no `get` asked for, other than those megalite never needs."""
        return sorted(n for n in self.files if n not in self.used and not n.endswith(IGNORED_SUFFIXES))
