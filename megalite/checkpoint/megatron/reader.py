"""A checkpoint Megatron-LM saved (Megatron-Core GPTModel), read one full tensor at a time in
megalite's names, whatever TP x PP (x virtual stages) layout wrote it.

    <load>/latest_checkpointed_iteration.txt              the iteration, or 'release'
    torch:      <load>/iter_0000100/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   one torch.save per writing rank
                (torch_files.py: which rank writes which slices)
    torch_dist: <load>/iter_0000100/metadata.json, common.pt, .metadata, __R_I.distcp   (DCP)

In `torch` files each rank holds its TP slices of its stage's layers, numbered from 0 within
each model chunk ('model', or 'model0', 'model1', ... with virtual stages); layers are assigned
chunk-major (every stage's first chunk, then every stage's second). In `torch_dist` every tensor
is stored at its full shape, the layers of `decoder.layers.*` stacked along a leading axis.
Files are unpickled only through safe_pickle's allowlist.
"""

import re
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from megalite.checkpoint.megatron.args import config_from_megatron_args, megatron_args_notes, vocab_size_of
from megalite.checkpoint.megatron.names import megatron_candidates, model_names, tp_rule
from megalite.checkpoint.megatron.names_gdn import read_in_parts
from megalite.checkpoint.megatron.safe_pickle import read_dist_metadata, safe_torch_load
from megalite.checkpoint.megatron.torch_files import RANK_DIR, TorchFiles, merge_tp
from megalite.checkpoint.publish import ConversionError
from megalite.checkpoint.dcp.target_layout import sharding_by_pattern
from megalite.checkpoint.dcp.format import VOCAB_PARAMS, CheckpointError, and_more
from megalite.checkpoint.dcp.storage import read_record

TRACKER = "latest_checkpointed_iteration.txt"
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_NAME = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_DIST_EXPERT = re.compile(r"\.mlp\.experts\.experts\.")


def megatron_iteration_dir(root, iteration: int | None = None) -> tuple[Path, int] | None:
    """(iteration folder, iteration) that Megatron's tracker file under `root` points at (or of
    `iteration`), or None when `root` holds no Megatron checkpoint (megalite's own have
    common.json there)."""
    root = Path(root)
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip() if iteration is None else str(iteration)
    if text == "release":
        folder, iteration = root / "release", 0
    elif text.isdigit():
        folder, iteration = root / f"iter_{int(text):07d}", int(text)
    else:
        return None
    if (folder / "common.json").exists() or not folder.is_dir():
        return None
    if (folder / "metadata.json").exists() or any(RANK_DIR.match(p.name) for p in folder.iterdir()):
        return folder, iteration
    return None


def megatron_format(root, iteration: int | None = None) -> str | None:
    """'torch' or 'torch_dist' for a Megatron checkpoint directory, None otherwise."""
    found = megatron_iteration_dir(root, iteration)
    if found is None:
        return None
    return "torch_dist" if (found[0] / "metadata.json").exists() else "torch"


class _DistFiles:
    """`torch_dist` format: DCP files, every tensor at its full shape, layers stacked (and a
    routed expert's tensors stacked by expert after the layer axis)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.metadata = read_dist_metadata(folder / ".metadata")
        self.state = safe_torch_load(folder / "common.pt") if (folder / "common.pt").exists() else {}
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}
        self.has_optimizer = any(k.startswith("optimizer.") for k in self.metadata.state_dict_metadata)

    def names(self) -> list[str]:
        """Every stored model tensor by Megatron's global name, one per stored layer (and expert)."""
        out = []
        for key, meta in self.tensors.items():
            if key.startswith("optimizer.") or key.endswith("._extra_state") or "/" in key:
                continue
            stacked = _stacked_axes(key)
            indices = sorted({tuple(c.offsets[:stacked]) for c in meta.chunks}) if stacked else [()]
            out += [_global_name(key, index) for index in indices]
        return out

    def _find(self, name: str, prefix: str = ""):
        """(key, leading indices, metadata) of Megatron's global `name`: stored per layer (a
        block of unlike layers, e.g. --moe-layer-freq) or stacked; None when not stored."""
        for key, index in _stored_keys(name):
            meta = self.tensors.get(prefix + key)
            if meta is not None and self._stored(meta, index):
                return prefix + key, index, meta
        return None

    def spec(self, name: str, rule) -> tuple[list, torch.dtype] | None:
        found = self._find(name)
        if found is None:
            return None
        _, index, meta = found
        return list(meta.size)[len(index):], meta.properties.dtype

    @staticmethod
    def _stored(meta, index: tuple) -> bool:
        """Whether a chunk holds the stacked `index` (a dense layer has no expert chunks)."""
        return all(i < n for i, n in zip(index, meta.size)) and (not index or any(
            all(o <= i < o + n for i, o, n in zip(index, c.offsets, c.sizes)) for c in meta.chunks))

    def read(self, name: str, rule, prefix: str = "", lookup=None) -> torch.Tensor | None:
        """The full tensor stored for Megatron's global `name` under `prefix` (the model's: none),
        or merged from the TP pieces `lookup(name)` returns (an optimizer state kept per rank)."""
        if lookup is not None:
            pieces = lookup(name)
            return None if pieces is None else merge_tp(pieces, rule)
        found = self._find(name, prefix)
        if found is None:
            return None
        key, index, meta = found
        shape, k = list(meta.size), len(index)
        out = torch.empty(shape[k:], dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            if not all(o <= i < o + n for i, o, n in zip(index, chunk.offsets, chunk.sizes)):
                continue
            piece = self._record(key, chunk) if shape else None
            if not shape:
                out.copy_(self._record(key, chunk))
                covered = 1
                continue
            piece = piece[tuple(i - o for i, o in zip(index, chunk.offsets))]
            out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets[k:], chunk.sizes[k:]))].copy_(piece)
            covered += piece.numel()
        if covered != out.numel():
            raise CheckpointError(f"{self.folder}: the stored chunks of tensor {key} do not cover its shape {shape}")
        return out

    def stored_object(self, key: str):
        """A pickled entry of the checkpoint (a Megatron ShardedObject such as
        'rng_state/shard_0.1_1.2'), unpickled through the allowlist; None when there is none."""
        info = self.metadata.storage_data.get(MetadataIndex(key))
        if info is None:
            return None
        path = self.folder / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            stored = safe_torch_load(path, f.read(info.length))
        return stored[0] if isinstance(stored, list) and len(stored) == 1 else stored  # saved as [object]

    def _record(self, key: str, chunk) -> torch.Tensor:
        info = self.metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
        if info is None or getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.folder}: tensor {key} chunk at {list(chunk.offsets)} has no plain record")
        path = self.folder / info.relative_path
        piece = read_record(path, info, f"tensor {key}")
        if list(piece.shape) != list(chunk.sizes):
            raise CheckpointError(f"{path}: tensor {key} chunk at {list(chunk.offsets)} has shape "
                                  f"{list(piece.shape)}, expected {list(chunk.sizes)}")
        return piece


def _stacked_axes(key: str) -> int:
    """How many leading axes of stored `key` number layers and experts."""
    stacked_layers = key.startswith("decoder.layers.") and not _LOCAL_LAYER.match(key)
    return int(stacked_layers) + int(_DIST_EXPERT.search(key) is not None)


def _stored_keys(name: str) -> list[tuple[str, tuple]]:
    """(torch_dist key, leading indices) where Megatron's global `name` may be stored: its layer
    under its own number, or stacked with the others."""
    expert_index = ()
    expert = _EXPERT_NAME.search(name)
    if expert:
        name = f"{name[:expert.start()]}.mlp.experts.experts.{name[expert.end():]}"
        expert_index = (int(expert.group(1)),)
    out = [(name, expert_index)]
    layer = _LOCAL_LAYER.match(name)
    if layer:
        out.append((f"decoder.layers.{layer.group(2)}", (int(layer.group(1)), *expert_index)))
    return out


def _global_name(key: str, index: tuple) -> str:
    """Megatron's global name of stored `key` at leading `index` (the inverse of _stored_key)."""
    index = list(index)
    if key.startswith("decoder.layers.") and not _LOCAL_LAYER.match(key):
        key = f"decoder.layers.{index.pop(0)}.{key[len('decoder.layers.'):]}"
    expert = _DIST_EXPERT.search(key)
    if expert:
        key = f"{key[:expert.start()]}.mlp.experts.local_experts.{index.pop(0)}.{key[expert.end():]}"
    return key


class MegatronCheckpoint:
    """The latest (or `release`) checkpoint under a Megatron --save directory. `vocab_size`: the
    unpadded vocabulary (a run's tokenizer); default what the checkpoint's args and embedding say
    (args.vocab_size_of). `iteration`: that iteration's checkpoint instead of the
    tracker's. `notes`: arguments the checkpoint's model did not use, one line each."""

    def __init__(self, load_dir, vocab_size: int | None = None, iteration: int | None = None):
        self.root = Path(load_dir)
        found = megatron_iteration_dir(self.root, iteration)
        if found is None:
            raise CheckpointError(f"{self.root}: not a Megatron checkpoint directory (no {TRACKER} pointing at an "
                                  "iter_* folder with mp_rank_* files or metadata.json)")
        self.path, self.iteration = found
        self.format = "torch_dist" if (self.path / "metadata.json").exists() else "torch"
        self.files = _DistFiles(self.path) if self.format == "torch_dist" else TorchFiles(self.path)
        self.state = self.files.state
        self.args = self.state.get("args")
        if "iteration" in self.state:
            self.iteration = int(self.state["iteration"])
        where = self.path if self.format == "torch_dist" else self.files.paths[(0, 0)]
        embedding = self.files.spec("embedding.word_embeddings.weight", (0, 1))
        if embedding is None:
            legacy = " (Megatron's legacy GPT model: language_model.*; megalite reads Megatron-Core's)" if any(
                n.split(".")[0] == "language_model" for n in self.files.names()) else ""
            raise CheckpointError(f"{where}: no embedding.word_embeddings.weight{legacy}")
        self.padded_vocab = embedding[0][0]
        vocab = vocab_size or vocab_size_of(self.args, self.padded_vocab)
        try:
            self.config = config_from_megatron_args(self.args, vocab, str(where))
        except ConversionError:
            raise  # names the file already
        except (ValueError, TypeError) as e:
            raise ConversionError(f"{where}: {e}") from None
        self.notes = megatron_args_notes(self.args)
        if vocab > self.padded_vocab:
            raise CheckpointError(f"{where}: the vocabulary has {vocab} tokens but the checkpoint's embedding only "
                                  f"{self.padded_vocab} rows")
        self.sharding = sharding_by_pattern(self.config)
        self.stored = self.files.names()
        self.used: set[str] = set()

    @property
    def has_optimizer(self) -> bool:
        return self.files.has_optimizer

    def names(self) -> list[str]:
        return model_names(self.config)

    def get(self, name: str, what: str = "", **source) -> torch.Tensor:
        """The full tensor of megalite's parameter `name` (vocabulary tensors without padding);
        with `source` (the files' read options: a `lookup` or a `prefix`), an optimizer state of
        it that `what` names in errors."""
        rule = tp_rule(self.config, self.sharding, name)
        for candidate in megatron_candidates(name):
            stored = [(candidate, self.files.read(candidate, rule, **source))]
            if stored[0][1] is None:
                stored = read_in_parts(candidate, lambda part: self.files.read(part, rule, **source)) or stored
            if all(tensor is not None for _, tensor in stored):
                if not source:
                    self.used.update(n for n, _ in stored)
                tensor = torch.cat([t for _, t in stored]) if len(stored) > 1 else stored[0][1]
                return tensor[: self.config.vocab_size] if name in VOCAB_PARAMS else tensor
        raise ConversionError(f"{self.path}: the Megatron checkpoint has no {what}{' or '.join(megatron_candidates(name))} "
                              f"(for megalite's {name})")

    def spec(self, name: str) -> tuple[tuple, torch.dtype]:
        """(full shape, dtype) of megalite's `name` without reading its data; it counts as used."""
        rule = tp_rule(self.config, self.sharding, name)
        for candidate in megatron_candidates(name):
            stored = [(candidate, self.files.spec(candidate, rule))]
            if stored[0][1] is None:
                stored = read_in_parts(candidate, lambda part: self.files.spec(part, rule)) or stored
            if all(found is not None for _, found in stored):
                self.used.update(n for n, _ in stored)
                shape, dtype = stored[0][1]
                if len(stored) > 1:
                    shape[0] = sum(found[0][0] for _, found in stored)
                if name in VOCAB_PARAMS:
                    shape[0] = self.config.vocab_size
                return tuple(shape), dtype
        raise ConversionError(f"{self.path}: the Megatron checkpoint has no {' or '.join(megatron_candidates(name))} "
                              f"(for megalite's {name})")

    def unused(self) -> list[str]:
        """Stored model tensors that have no place in megalite's model, in stored order (every
        name's `spec` is looked up first: metadata only)."""
        for name in self.names():
            self.spec(name)
        tied_copy = None if self.config.untie_embeddings_and_output_weights else "output_layer.weight"
        return [n for n in self.stored if n not in self.used and n != tied_copy]

    def check_all_used(self) -> None:
        """Refuse a checkpoint with model tensors megalite has no place for (q/k norms, experts, ...)."""
        unused = self.unused()
        if unused:
            raise ConversionError(f"{self.path}: tensor {unused[0]} has no place in megalite's model{and_more(unused)}")
