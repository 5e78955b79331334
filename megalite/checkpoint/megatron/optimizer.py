"""The optimizer state of a checkpoint Megatron-LM saved (Adam's exp_avg and exp_avg_sq or SGD's
momentum, the fp32 main parameters, the step count), one full tensor at a time in megalite's
names, whatever TP x PP (x virtual stages) layout wrote it. Layouts read:

  torch       plain optimizer (FP32Optimizer, Float16OptimizerWithFloat16Params): each rank's
              model_optim_rng.pt holds the torch optimizer's state dict, its parameters numbered
              in Megatron's param-group order (megatron.core.optimizer._get_param_groups: the rank's
              model chunks' parameters in order, grouped by weight decay (off for 1-D tensors and
              biases) and by --decoupled-lr (word embedding, output layer)), and 'fp32_from_fp16_params'
              for 16-bit models;
              distributed optimizer: distrib_optim.pt beside it, flat tensors in the bucket layout
              buckets.py rebuilds from the rank's parameters;
  torch_dist  plain optimizer: optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<tensor>, the step
              ('common_step') in common.pt;
              distributed optimizer saved 'fully_reshardable' (--dist-ckpt-optim-fully-reshardable):
              optimizer.state.{param,exp_avg,exp_avg_sq}.<tensor>, the step in the param groups;
              saved 'dp_reshardable' (Megatron's default): per-bucket tensors of each TP rank
              (dp_reshardable.py), written at PP = 1 without virtual stages.

Refused, naming the file and what is missing: 'dp_reshardable' written at PP > 1 (which layers
each pipeline rank's buckets hold is not recorded), the deprecated 'dp_zero_gather_scatter' and
'fully_sharded_model_space' layouts, the states of several chained optimizers, and optimizers
other than Adam and SGD.
"""

import math

import torch

from megalite.checkpoint.megatron.buckets import bucket_layout
from megalite.checkpoint.megatron.dp_reshardable import DpReshardableState
from megalite.checkpoint.megatron.names import megatron_candidates, tp_rule
from megalite.checkpoint.megatron.safe_pickle import safe_torch_load
from megalite.checkpoint.dcp.format import CheckpointError

STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}
NO_OPTIM_HINT = "pass --no-load-optim (fresh optimizer, iteration kept) or --finetune"
_EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


def refuse(where, what: str):
    raise CheckpointError(f"{where}: {what}; {NO_OPTIM_HINT}")


def _get(ns, name, default=None):
    value = getattr(ns, name, None)
    return default if value is None else value


class MegatronOptimizerState:
    """The optimizer state of an opened MegatronCheckpoint; refuses unreadable layouts."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        self.kind = _get(checkpoint.args, "optimizer", "adam")
        self.where = checkpoint.path / "common.pt" if checkpoint.format == "torch_dist" else checkpoint.files.paths[(0, 0)]
        if self.kind not in STATE_KEYS:
            refuse(self.where, f"the checkpoint's optimizer is {self.kind!r}; megalite reads Adam and SGD state")
        self.keys = STATE_KEYS[self.kind]
        saved = checkpoint.state.get("optimizer")
        if saved is None:
            refuse(self.where, "no 'optimizer' entry (a checkpoint saved with --no-save-optim, or weights only)")
        if isinstance(saved, list) or (isinstance(saved, dict) and any(isinstance(k, int) for k in saved)):
            refuse(self.where, "the state of several chained optimizers (expert parameters, or "
                   "--overlap-param-gather-with-optimizer-step) is not read")
        self.grad_scaler = saved.get("grad_scaler")
        self.scheduler = checkpoint.state.get("opt_param_scheduler") or checkpoint.state.get("lr_scheduler")
        self.has_main = True
        self._dp_reshardable = None
        if checkpoint.format == "torch":
            self._open_torch(saved)
        else:
            self._open_dist(saved)

    # --- what the loader uses ------------------------------------------------------------------
    def get(self, name: str, key: str) -> torch.Tensor:
        """The full tensor of state `key` ('param': the fp32 main value) of megalite's `name`."""
        if key == "param" and not self.has_main:
            return self.checkpoint.get(name)  # fp32 model: the weights are the main parameters
        what = f"optimizer state {key!r} of "
        if self.checkpoint.format == "torch":
            def lookup(t, p, chunk, local):
                return self._entries[(t, p)].get(chunk, {}).get(local, {}).get(key)
            return self.checkpoint.get(name, what, lookup=lookup)
        if self._dp_reshardable is not None:
            return self.checkpoint.get(name, what, lookup=lambda n: self._dp_reshardable.pieces(n, key))
        return self.checkpoint.get(name, what, prefix=self._prefixes[key])

    @property
    def hyperparameters(self) -> dict:
        """The first param group's saved settings (betas, eps, weight_decay, ...)."""
        return dict(self.param_groups[0]) if self.param_groups else {}

    # --- torch: one file per TP x PP rank -------------------------------------------------------
    def _open_torch(self, saved: dict):
        files = self.checkpoint.files
        if files.expert_parallel:
            refuse(self.where, f"an optimizer state saved at expert_model_parallel_size={files.ep}, "
                   f"expert_tensor_parallel_size={files.etp} in `torch` format (megalite reads its weights only)")
        if "state" in saved:
            self.param_groups, distributed = saved["param_groups"], False
        elif isinstance(saved.get("optimizer"), dict):
            self.param_groups = saved["optimizer"].get("param_groups", [])
            distributed = "state" not in saved["optimizer"]
        else:
            refuse(self.where, f"an optimizer entry with keys {sorted(map(str, saved))[:5]} (not a Megatron-Core "
                   "optimizer's state dict)")
        steps = set()
        self._entries = {}
        for (t, p) in sorted(files.paths):
            if distributed:
                self._entries[(t, p)] = self._distributed_rank(t, p)
            else:
                self._entries[(t, p)] = self._plain_rank(t, p, steps)
        if distributed:
            steps = {int(g["step"]) for g in self.param_groups if g.get("step") is not None}
        if len(steps) > 1:
            refuse(self.where, f"parameters at different step counts {sorted(steps)}")
        if distributed and not steps:
            refuse(self.where, "the distributed optimizer's param groups hold no step count")
        self.step = steps.pop() if steps else 0

    def _rank_params(self, t: int, p: int) -> list[tuple[str, str, tuple, torch.dtype]]:
        """(chunk key, name, local shape, dtype) of the rank's parameters in named_parameters order."""
        files = self.checkpoint.files
        return [(chunk, name, tuple(value.shape), value.dtype) for chunk in files.chunk_keys
                for name, value in files._model(t, p, chunk).items()
                if isinstance(value, torch.Tensor) and not name.endswith("._extra_state")]

    def _plain_rank(self, t: int, p: int, steps: set) -> dict:
        files = self.checkpoint.files
        where, saved = files.paths[(t, p)], files.states[(t, p)].get("optimizer")
        if not isinstance(saved, dict):
            refuse(where, "no 'optimizer' entry")
        inner = saved.get("optimizer", saved)
        mains = saved.get("fp32_from_fp16_params", saved.get("fp32_from_fp16")) if "optimizer" in saved else None
        self.has_main = mains is not None
        members = assign_param_groups(self._rank_params(t, p), inner["param_groups"], self.checkpoint.args, where)
        entries = {}
        for g, (group, params) in enumerate(zip(inner["param_groups"], members)):
            copies = iter(mains[g]) if mains is not None else None  # the group's 16-bit parameters' fp32 copies
            for index, (chunk, name, shape, dtype) in zip(group["params"], params):
                found = inner["state"].get(index, {})
                entry = {k: found[k] for k in self.keys if k in found}
                if copies is not None:
                    entry["param"] = next(copies, None) if dtype in (torch.float16, torch.bfloat16) else (
                        files._model(t, p, chunk)[name])  # an fp32 parameter is its own main copy
                    if entry["param"] is None:
                        refuse(where, f"'fp32_from_fp16_params' group {g} has fewer tensors than the group's 16-bit "
                               "parameters")
                if "step" in found:
                    steps.add(int(found["step"]))
                for key, value in entry.items():
                    if tuple(value.shape) != shape:
                        refuse(where, f"optimizer state {key!r} number {index} has shape {tuple(value.shape)}, "
                               f"but the parameter it maps to ({name}) has {shape}: the param groups do not "
                               "follow Megatron's order")
                entries.setdefault(chunk, {})[name] = entry
        return entries

    def _distributed_rank(self, t: int, p: int) -> dict:
        files, ns = self.checkpoint.files, self.checkpoint.args
        path = files.paths[(t, p)].parent / "distrib_optim.pt"
        if not path.is_file():
            refuse(path, "missing (the distributed optimizer's parameter state, which save_parameter_state writes)")
        data = safe_torch_load(path)
        if not isinstance(data, dict) or not data.get("buckets_coalesced"):
            refuse(path, "an older distributed-optimizer layout (not 'buckets_coalesced')")
        dp_cp, dp = _optimizer_dp_size(ns, files.tp, files.pp, path)
        bucket_size = _ddp_bucket_size(ns, dp_cp, sum(math.prod(shape) for _, _, shape, _ in self._rank_params(t, p)))
        entries, buffer_index = {}, 0
        for index, chunk in enumerate(files.chunk_keys):
            params = [(name, shape, dtype) for c, name, shape, dtype in self._rank_params(t, p) if c == chunk]
            names = {n for n, _, _ in params}
            shared = set()
            if files.pp > 1 and not _get(ns, "untie_embeddings_and_output_weights", False):
                shared = {n for n in _EMBEDDING_OR_OUTPUT if n in names} if len(names & set(_EMBEDDING_OR_OUTPUT)) == 1 else set()
            entries[chunk] = {}
            for dtype in dict.fromkeys(d for _, _, d in params):  # one buffer per dtype, in order of appearance
                mine = [(n, s) for n, s, d in params if d == dtype]
                buffers = data.get(buffer_index)
                if not isinstance(buffers, dict) or len(buffers) != 1 or next(iter(buffers))[0] != dtype:
                    refuse(path, f"no buffer {buffer_index} of {dtype} parameters (model chunk {index}) where Megatron's "
                           "DistributedDataParallel puts one")
                world = next(iter(buffers.values()))
                layout, numel = bucket_layout([(n, math.prod(s)) for n, s in mine], dp,
                                              None if p > 0 or index > 0 else bucket_size, frozenset(shared),
                                              bool(_get(ns, "ddp_pad_buckets_for_high_nccl_busbw", False)))
                missing = [k for k in ("param", *self.keys) if not isinstance(world.get(k), torch.Tensor)]
                if missing:
                    refuse(path, f"buffer {buffer_index} has no {missing[0]!r} tensor")
                if numel != int(world.get("numel_unpadded", -1)) or world["param"].numel() != numel:
                    refuse(path, f"buffer {buffer_index} holds {world['param'].numel()} elements, but Megatron's bucket "
                           f"layout of this rank's parameters (DP {dp}, bucket size {bucket_size}) gives {numel}")
                shapes = dict(mine)
                entries[chunk].update({name: {k: world[k][a:b].view(shapes[name]) for k in ("param", *self.keys)}
                                       for name, (a, b) in layout.items()})
                buffer_index += 1
        return entries

    # --- torch_dist: tensors by name -------------------------------------------------------------
    def _open_dp_reshardable(self):
        """Megatron's default torch_dist layout of the distributed optimizer: flat buckets per TP
        x PP rank (dp_reshardable.py), read at PP = 1 without virtual stages."""
        ckpt, ns = self.checkpoint, self.checkpoint.args
        tp, pp = _get(ns, "tensor_model_parallel_size", 1), _get(ns, "pipeline_model_parallel_size", 1)
        if pp > 1 or _get(ns, "virtual_pipeline_model_parallel_size"):
            refuse(self.where, f"Megatron's 'dp_reshardable' optimizer layout is read for checkpoints written at PP=1 "
                   f"without virtual stages (this one: --pipeline-model-parallel-size {pp}): which layers each "
                   "pipeline rank's buckets hold is not recorded")
        dp_cp, dp = _optimizer_dp_size(ns, tp, pp, self.where)
        groups = ckpt.files.stored_object("optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1")
        if not isinstance(groups, dict) or not isinstance(groups.get("param_groups"), list):
            refuse(ckpt.path, "no optimizer.distributed.dp_group_idx_0.optimizer (the param groups)")
        self.param_groups = groups["param_groups"]
        steps = {int(g["step"]) for g in self.param_groups if g.get("step") is not None}
        if len(steps) != 1:
            refuse(self.where, f"the distributed optimizer's param groups hold step counts {sorted(steps)}")
        self.step = steps.pop()
        rules = {candidate: tp_rule(ckpt.config, ckpt.sharding, name)
                 for name in ckpt.names() for candidate in megatron_candidates(name)}
        self._dp_reshardable = DpReshardableState(ckpt.files, ns, tp, dp, rules,
                                                  lambda numel: _ddp_bucket_size(ns, dp_cp, numel), refuse)

    def _open_dist(self, saved: dict):
        sharding = saved.get("param_state_sharding_type")
        inner = saved.get("optimizer", saved)
        self.param_groups = inner.get("param_groups", [])
        stored = self.checkpoint.files.tensors
        if sharding is None:
            main = "fp32_param" if any(k.startswith("optimizer.state.fp32_param.") for k in stored) else None
            step = inner.get("state", {}).get("common_step")
            self.step = int(step) if step is not None else 0
        elif sharding == "fully_reshardable":
            main = "param"
            steps = {int(g["step"]) for g in self.param_groups if g.get("step") is not None}
            if len(steps) != 1:
                refuse(self.where, f"the distributed optimizer's param groups hold step counts {sorted(steps)}")
            self.step = steps.pop()
        elif sharding == "dp_reshardable":
            self._open_dp_reshardable()
            return
        else:
            refuse(self.where, f"the distributed optimizer's state is in Megatron's {sharding!r} layout, which is "
                   "not read (megalite reads 'dp_reshardable', Megatron's default, and 'fully_reshardable', "
                   "--dist-ckpt-optim-fully-reshardable)")
        self.has_main = main is not None
        self._prefixes = {k: f"optimizer.state.{k}." for k in self.keys}
        if main is not None:
            self._prefixes["param"] = f"optimizer.state.{main}."
        for key, prefix in self._prefixes.items():
            if self.step > 0 or key == "param":
                if not any(k.startswith(prefix) for k in stored):
                    refuse(self.checkpoint.path, f"no {prefix}* tensors (the optimizer's {key!r})")


def _ddp_bucket_size(ns, dp_cp: int, rank_numel: int) -> int | None:
    """Megatron's resolve_ddp_bucket_size: None (one bucket) without --overlap-grad-reduce."""
    if not _get(ns, "overlap_grad_reduce", False):
        return None
    buckets = _get(ns, "ddp_num_buckets")
    return rank_numel // buckets if buckets else _get(ns, "ddp_bucket_size") or max(40_000_000, 1_000_000 * dp_cp)


def _optimizer_dp_size(ns, tp: int, pp: int, where) -> tuple[int, int]:
    """(DP x CP, and the size of the group Megatron's distributed optimizer shards over: DP x CP
    over the optimizer instances)."""
    cp = _get(ns, "context_parallel_size", 1)
    dp = _get(ns, "data_parallel_size")
    if dp is None and _get(ns, "world_size") is not None:
        dp = ns.world_size // (tp * pp * cp)
    if not dp:
        refuse(where, "the checkpoint's args have no data_parallel_size (needed for the distributed optimizer's layout)")
    return dp * cp, dp * cp // _get(ns, "num_distributed_optimizer_instances", 1)


def assign_param_groups(params: list, groups: list[dict], ns, where) -> list[list]:
    """The rank's parameters (`params`: (chunk, name, shape) in order) in each of Megatron's saved
    param groups, as _get_param_groups formed them: weight decay off for 1-D tensors and
    biases, --decoupled-lr for the word embedding and output layer, in parameter order."""
    decoupled = _get(ns, "decoupled_lr")

    def of_param(name, shape):
        return (0.0 if len(shape) == 1 or name.endswith(".bias") else 1.0,
                decoupled is not None and name in _EMBEDDING_OR_OUTPUT)

    def of_group(group):
        wd = float(group.get("wd_mult", 0.0 if group.get("weight_decay", 1.0) == 0 else 1.0))
        return wd, bool(group.get("is_decoupled_lr")) or (decoupled is not None and group.get("max_lr") == decoupled)

    kinds = [of_group(g) for g in groups]
    filled = [k for k, g in zip(kinds, groups) if g["params"]]
    if len(set(filled)) != len(filled):
        refuse(where, "two param groups with the same weight decay and learning rate: cannot tell which "
               "parameters each holds")
    members = [[q for q in params if of_param(q[1], q[2]) == kind] if g["params"] else []
               for kind, g in zip(kinds, groups)]
    for kind, group, mine in zip(kinds, groups, members):
        if len(mine) != len(group["params"]):
            refuse(where, f"a param group (weight decay x{kind[0]}{', decoupled lr' if kind[1] else ''}) holds "
                   f"{len(group['params'])} parameters, but the rank has {len(mine)} such")
    if sum(map(len, members)) != len(params):
        refuse(where, f"the param groups hold {sum(map(len, members))} parameters, the rank's model {len(params)}")
    return members
