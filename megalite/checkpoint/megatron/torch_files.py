"""Megatron's legacy `torch` checkpoint files (used by reader.py): one model_optim_rng.pt per
writing rank, in mp_rank_TT[_PPP][_EEE] (megatron/training/checkpointing.py,
get_checkpoint_name: the pipeline rank when PP > 1, then the expert-parallel rank when EP > 1).

Each file holds its rank's state dict: the TP slices of its stage's layers, numbered from 0
within each model chunk ('model', or 'model0', 'model1', ... with virtual stages; layers are
assigned chunk-major), and its EP rank's experts under local numbers (SequentialMLP's
local_experts.<j>, TEGroupedMLP's linear_fc1.weight<j>, the legacy GroupedMLP's weight1/weight2
holding all of them), each sliced over the expert TP group (ETP). Which ETP slice a file holds,
and which files exist, follows from who writes: the ranks with data-parallel rank 0 or expert
data-parallel rank 0, laid out by Megatron's RankGenerator (order tp-cp-ep-dp-pp, or
tp-cp-ep-pp-dp with --use-tp-pp-dp-mapping; the expert generator has tp=ETP, cp=1).
"""

import re
from pathlib import Path

import torch

from megalite.checkpoint.dcp.format import CheckpointError
from megalite.checkpoint.megatron.safe_pickle import safe_torch_load

RANK_DIR = re.compile(r"^mp_rank_(\d{2})((?:_\d{3}){0,2})$")
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQUENTIAL = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(.+)$")
_TE_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")
_LEGACY_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)weight([12])$")


def is_whole_copy(shape, rule) -> bool:
    """Whether a TP piece of this `shape` is the whole tensor (rule blocks given as full sizes:
    Transformer Engine's duplicated MLA down projections, where the local spec splits them)."""
    dim, blocks = rule
    return isinstance(blocks, tuple) and shape[dim] == sum(blocks)


def merge_tp(pieces: list[torch.Tensor], rule) -> torch.Tensor:
    """The full tensor of its TP `pieces` under `rule` ((dim, blocks), see names.tp_rule)."""
    if rule is None or len(pieces) == 1:
        return pieces[0]
    dim, blocks = rule
    if is_whole_copy(pieces[0].shape, rule):
        return pieces[0]
    if isinstance(blocks, tuple):  # unequal blocks (GDN's in_proj, conv1d): their full sizes
        split = [p.split([b // len(pieces) for b in blocks], dim=dim) for p in pieces]
    else:
        split = [p.chunk(blocks, dim=dim) for p in pieces]
    return torch.cat([torch.cat([s[b] for s in split], dim=dim) for b in range(len(split[0]))], dim=dim)


def _get(ns, name, default):
    value = getattr(ns, name, None)
    return default if value is None else value


def _coords(rank: int, sizes: dict, order: list[str]) -> dict:
    out = {}
    for axis in order:
        out[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return out


def writers(ns) -> dict[tuple[int, int, int], set[int]]:
    """{(tp rank, pp rank, ep rank) of a file Megatron writes: the ETP ranks of its writers},
    from the run's arguments."""
    tp, pp = int(_get(ns, "tensor_model_parallel_size", 1)), int(_get(ns, "pipeline_model_parallel_size", 1))
    cp, ep = int(_get(ns, "context_parallel_size", 1)), int(_get(ns, "expert_model_parallel_size", 1))
    etp = int(_get(ns, "expert_tensor_parallel_size", tp))
    world = int(_get(ns, "world_size", tp * pp * cp * int(_get(ns, "data_parallel_size", 1))))
    if world % (tp * cp * pp) or world % (etp * ep * pp):
        raise ValueError(f"world_size={world} is not a multiple of TP x CP x PP ({tp * cp * pp}) and "
                         f"ETP x EP x PP ({etp * ep * pp})")
    order = ["tp", "cp", "ep", "pp", "dp"] if _get(ns, "use_tp_pp_dp_mapping", False) else ["tp", "cp", "ep", "dp", "pp"]
    dense = dict(tp=tp, cp=cp, ep=1, dp=world // (tp * cp * pp), pp=pp)
    expert = dict(tp=etp, cp=1, ep=ep, dp=world // (etp * ep * pp), pp=pp)
    out: dict = {}
    for rank in range(world):
        d, x = _coords(rank, dense, order), _coords(rank, expert, order)
        if d["dp"] == 0 or x["dp"] == 0:
            out.setdefault((d["tp"], d["pp"], x["ep"]), set()).add(x["tp"])
    return out


class TorchFiles:
    """Legacy `torch` format: one model_optim_rng.pt per writing (TP, PP, EP) rank. `paths` and
    `states` by (tp rank, pp rank) are the files read for everything but routed experts (for
    each, its lowest EP rank's)."""

    def __init__(self, folder: Path):
        named = {}
        for path in sorted(folder.iterdir()):
            match = RANK_DIR.match(path.name)
            if match:
                named[path.name] = (int(match.group(1)), [int(s) for s in match.group(2).split("_")[1:]],
                                    path / "model_optim_rng.pt")
        if not named:
            raise CheckpointError(f"{folder}: no mp_rank_TT[_PPP][_EEE] folders")
        first = next((path for _, _, path in named.values() if path.is_file()), None)
        if first is None:
            raise CheckpointError(f"{folder}: no mp_rank_*/model_optim_rng.pt file")
        ns = safe_torch_load(first).get("args")
        self.pp = int(_get(ns, "pipeline_model_parallel_size", 0)) or 1 + max(
            (s[0] for _, s, _ in named.values() if s), default=0)
        self.ep = int(_get(ns, "expert_model_parallel_size", 1))
        self.all_paths = {}  # (tp, pp, ep) -> file
        for name, (t, suffix, path) in named.items():
            expected = int(self.pp > 1) + int(self.ep > 1)
            if len(suffix) != expected:
                raise CheckpointError(f"{folder / name}: expected mp_rank_TT{'_PPP' if self.pp > 1 else ''}"
                                      f"{'_EEE' if self.ep > 1 else ''} (the checkpoint's args: PP {self.pp}, EP {self.ep})")
            p = suffix[0] if self.pp > 1 else 0
            self.all_paths[(t, p, suffix[-1] if self.ep > 1 else 0)] = path
        self.tp = 1 + max(t for t, _, _ in self.all_paths)
        self.paths = {}
        for t in range(self.tp):
            for p in range(self.pp):
                keys = sorted(k for k in self.all_paths if k[:2] == (t, p) and self.all_paths[k].is_file())
                if not keys:
                    raise CheckpointError(f"{folder / f'mp_rank_{t:02d}_{p:03d}' / 'model_optim_rng.pt'}: missing "
                                          f"(the checkpoint has {self.tp} TP x {self.pp} PP ranks)")
                self.paths[(t, p)] = self.all_paths[keys[0]]
        self.all_states = {key: safe_torch_load(path) for key, path in self.all_paths.items() if path.is_file()}
        self.states = {(t, p): self.all_states[next(k for k in self.all_paths if self.all_paths[k] == path)]
                       for (t, p), path in self.paths.items()}
        self.etp = int(_get(ns, "expert_tensor_parallel_size", self.tp))
        self.local_experts = int(_get(ns, "num_experts", 0)) // self.ep
        self.expert_files = self._expert_files(ns, folder) if self.local_experts else None
        self.state = self.states[(0, 0)]
        self.chunk_keys = sorted((k for k in self.state if re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0))
        if not self.chunk_keys:
            raise CheckpointError(f"{self.paths[(0, 0)]}: no 'model' entry")
        self.layers = []  # global layer -> (pp rank, chunk key, local number)
        for key in self.chunk_keys:
            for p in range(self.pp):
                local = sorted({int(m.group(1)) for m in map(_LOCAL_LAYER.match, self._model(0, p, key)) if m})
                self.layers += [(p, key, j) for j in local]
        self.has_optimizer = "optimizer" in self.state or any(
            (path.parent / "distrib_optim.pt").exists() for path in self.paths.values())

    @property
    def expert_parallel(self) -> bool:
        """Whether routed experts live in other files or slices than the dense tensors."""
        return self.expert_files is not None and (self.ep > 1 or self.etp != self.tp)

    def _expert_files(self, ns, folder: Path) -> dict:
        """{(pp rank, ep rank, etp rank): the file key (tp, pp, ep) holding that expert slice}."""
        try:
            written = writers(ns)
        except ValueError as e:
            raise CheckpointError(f"{self.paths[(0, 0)]}: the checkpoint's args: {e}") from None
        out = {}
        for key in sorted(self.all_states):
            slices = written.get(key, set())
            if len(slices) > 1:
                raise CheckpointError(f"{self.all_paths[key]}: written by ranks holding different expert TP slices "
                                      f"{sorted(slices)} (expert_tensor_parallel_size={self.etp} > "
                                      f"tensor_model_parallel_size={self.tp}: Megatron's `torch` format keeps one of "
                                      "them); read its `torch_dist` checkpoint instead")
            for k in slices:
                out.setdefault((key[1], key[2], k), key)
        for p in range(self.pp):
            for e in range(self.ep):
                for k in range(self.etp):
                    if (p, e, k) not in out:
                        raise CheckpointError(f"{folder}: no file holds expert TP slice {k} of EP rank {e}"
                                              f"{f' on PP rank {p}' if self.pp > 1 else ''} (files: "
                                              f"{sorted(p.parent.name for p in self.all_paths.values())})")
        return out

    def _model(self, t: int, p: int, key: str, e: int | None = None) -> dict:
        state, path = ((self.states[(t, p)], self.paths[(t, p)]) if e is None
                       else (self.all_states[(t, p, e)], self.all_paths[(t, p, e)]))
        model = state.get(key)
        if not isinstance(model, dict):
            raise CheckpointError(f"{path}: no {key!r} state dict")
        return model

    def _where(self, name: str):
        """(pp rank, chunk key, name within that chunk) of a global Megatron name."""
        match = _LOCAL_LAYER.match(name)
        if match:
            number = int(match.group(1))
            if number >= len(self.layers):
                return None
            p, key, local = self.layers[number]
            return p, key, f"decoder.layers.{local}.{match.group(2)}"
        if name.startswith("embedding."):
            return 0, self.chunk_keys[0], name
        return self.pp - 1, self.chunk_keys[-1], name

    def names(self) -> list[str]:
        """Every stored model tensor by Megatron's global name (routed experts by global number)."""
        out = []
        for number, (p, key, local) in enumerate(self.layers):
            prefix = f"decoder.layers.{local}."
            out += [f"decoder.layers.{number}.{n[len(prefix):]}" for n in self._expert_names(p, key) if n.startswith(prefix)]
        for p, key in ((0, self.chunk_keys[0]), (self.pp - 1, self.chunk_keys[-1])):
            out += [n for n in self._expert_names(p, key) if not n.startswith("decoder.layers.") and n not in out]
        return [n for n in out if not n.endswith("._extra_state")]

    def _expert_names(self, p: int, key: str) -> list[str]:
        if self.expert_files is None:
            return list(self._model(0, p, key))
        out = []
        for e in range(self.ep):
            t, _, _ = self.expert_files[(p, e, 0)]
            for name in self._model(t, p, key, e):
                expert, legacy = _local_expert(name), _LEGACY_GROUPED.match(name)
                if expert is not None:
                    out.append(expert[0](expert[1] + e * self.local_experts))
                elif legacy is not None:  # GroupedMLP: every local expert's fc1 (weight1) or fc2 (weight2)
                    linear = "linear_fc1" if legacy.group(2) == "1" else "linear_fc2"
                    out += [f"{legacy.group(1)}local_experts.{e * self.local_experts + j}.{linear}.weight"
                            for j in range(self.local_experts)]
                elif e == 0:
                    out.append(name)
        return out

    def spec(self, name: str, rule) -> tuple[list, torch.dtype] | None:
        piece = self._piece(name, 0)
        if not isinstance(piece, torch.Tensor):
            return None
        shape = list(piece.shape)
        if rule is not None and not is_whole_copy(shape, rule):
            shape[rule[0]] *= self.etp if self._is_expert(name) else self.tp
        return shape, piece.dtype

    def _is_expert(self, name: str) -> bool:
        return self.expert_files is not None and _local_expert(name) is not None

    def _piece(self, name: str, rank: int, lookup=None):
        """TP (or, for a routed expert, ETP) slice `rank` of Megatron's global `name`."""
        where = self._where(name)
        if where is None:
            return None
        p, key, local = where
        if not self._is_expert(name) or (lookup is not None and not self.expert_parallel):
            lookup = lookup or (lambda t, p, key, local: self._model(t, p, key).get(local))
            return lookup(rank, p, key, local)
        if lookup is not None:
            raise CheckpointError(f"{self.paths[(0, 0)]}: the optimizer state of routed experts in a `torch`-format "
                                  "checkpoint is read only at EP 1 with ETP = TP (start from the weights: --finetune, "
                                  "or --no-load-optim)")
        rebuild, number = _local_expert(local)
        e, j = divmod(number, self.local_experts)
        if e >= self.ep:
            return None
        t, _, _ = self.expert_files[(p, e, rank)]
        model = self._model(t, p, key, e)
        if rebuild(j) in model:
            return model[rebuild(j)]
        return _legacy_grouped_piece(model, local, j, self.local_experts)

    def read(self, name: str, rule, lookup=None) -> torch.Tensor | None:
        """The full tensor of Megatron's global `name`: the model's, or what `lookup(tp rank, pp
        rank, chunk key, name in that chunk)` returns for each TP rank (an optimizer state)."""
        count = self.etp if self._is_expert(name) else self.tp
        pieces = [self._piece(name, rank, lookup) for rank in range(count)]
        if any(not isinstance(piece, torch.Tensor) for piece in pieces):
            return None
        return merge_tp(pieces, rule)


def _legacy_grouped_piece(model: dict, local: str, j: int, count: int):
    """Local expert `j`'s linear_fc1/linear_fc2 weight slice inside the legacy GroupedMLP's
    weight1 [hidden, count * fc1 rows] / weight2 [count * fc2 columns, hidden]: Megatron views
    them as [count, hidden, fc1 rows] / [count, fc2 columns, hidden] (GroupedMLP.forward), each
    expert's the transpose of its linear weight."""
    match = _SEQUENTIAL.match(local)
    if match is None or match.group(3) not in ("linear_fc1.weight", "linear_fc2.weight"):
        return None
    fc1 = match.group(3) == "linear_fc1.weight"
    grouped = model.get(f"{match.group(1)}weight{1 if fc1 else 2}")
    if not isinstance(grouped, torch.Tensor):
        return None
    hidden = grouped.shape[0] if fc1 else grouped.shape[1]
    experts = grouped.reshape(count, hidden, -1) if fc1 else grouped.reshape(count, -1, hidden)
    return experts[j].t()


def _local_expert(name: str):
    """(a function of a local expert number giving the name, this name's number) for a routed
    expert's tensor name in a `torch` file, else None."""
    match = _SEQUENTIAL.match(name)
    if match:
        head, number, rest = match.groups()
        return (lambda j: f"{head}local_experts.{j}.{rest}"), int(number)
    match = _TE_GROUPED.match(name)
    if match:
        head, linear, number = match.groups()
        return (lambda j: f"{head}{linear}.weight{j}"), int(number)
    return None
