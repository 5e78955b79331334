"""Megatron's distributed-optimizer state in its default `torch_dist` layout, 'dp_reshardable'
(DistributedOptimizer.sharded_param_state_dp_reshardable): for every TP x PP rank
(dp_group_idx, its rank in the model-parallel group) and each of its buffers, one tensor per
bucket and state,

    optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_<(param, grad) dtypes>.bucket_idx_<b>.<state>

holding the bucket's elements up to its last parameter's end (per_bucket_numel_unpadded, stored
beside them), the padding between parameters included. Which parameter sits where follows the
rank's parameters (buckets.bucket_positions, from the order in which the checkpoint stores the
model's tensors: the order of named_parameters), so it is checked against what the checkpoint
records: each bucket's length, and a stored chunk starting and ending at each parameter's ends
(Megatron writes every parameter's slice as chunks of its own). The tensors do not depend on the
writing run's DP size.
"""

import math
import re

import torch

from megalite.checkpoint.megatron.buckets import bucket_positions

_OPTIMIZER_PREFIX = "optimizer.distributed.dp_group_idx_"
_OUTPUT = "output_layer.weight"


def named_parameter_order(stored: dict, num_layers: int, tied: bool) -> list[tuple[str, tuple, torch.dtype]]:
    """(Megatron global name, full shape, dtype) of the model's parameters in named_parameters
    order, from `stored` (the torch_dist metadata's tensors, in stored order: the model's sharded
    state dict follows its modules); `tied`: the output layer is the embedding (no parameter of
    its own on a single pipeline stage)."""
    model = [(k, m) for k, m in stored.items()
             if not k.startswith("optimizer.") and not k.endswith("._extra_state") and "/" not in k]
    in_layers = [k.startswith("decoder.layers.") for k, _ in model]
    first = in_layers.index(True) if True in in_layers else len(model)
    head = [(k, tuple(m.size), m.properties.dtype) for k, m in model[:first]]
    tail = [(k, tuple(m.size), m.properties.dtype) for (k, m), inside in zip(model[first:], in_layers[first:])
            if not inside]
    layer_entries = [(k, m) for (k, m), inside in zip(model, in_layers) if inside]
    layers = []
    for number in range(num_layers):
        for key, meta in layer_entries:
            own = re.match(rf"decoder\.layers\.{number}\.", key)
            if own:  # a layer stored by its own number (unlike layers are not stacked)
                layers.append((key, tuple(meta.size), meta.properties.dtype))
            elif not re.match(r"decoder\.layers\.\d+\.", key) and number < meta.size[0]:
                layers.append((f"decoder.layers.{number}.{key[len('decoder.layers.'):]}", tuple(meta.size)[1:],
                               meta.properties.dtype))
    order = head + layers + tail
    return [entry for entry in order if not (tied and entry[0] == _OUTPUT)]


def local_shape(shape: tuple, rule, tp: int) -> tuple:
    if rule is None:
        return shape
    out = list(shape)
    out[rule[0]] //= tp
    return tuple(out)


def bucket_slices(params: list[tuple[str, tuple]], dp: int, bucket_size: int | None, unpadded: list[int],
                  chunk_bounds: list[set], pad_for_busbw: bool, refuse, where: str) -> dict:
    """{name: (bucket, start, end)} of one buffer's `params` [(name, local shape)] in
    named_parameters order, checked against the stored bucket lengths `unpadded` and the stored
    chunks' start and end offsets of each bucket (`chunk_bounds`)."""
    positions, lengths = bucket_positions([(n, math.prod(s)) for n, s in params], dp, bucket_size,
                                          frozenset(), pad_for_busbw)
    if lengths != list(unpadded):
        refuse(where, f"buckets of {list(unpadded)} elements, but Megatron's bucket layout of the rank's "
               f"parameters (in the checkpoint's order, bucket size {bucket_size}) gives {lengths}")
    for name, (bucket, start, end) in positions.items():
        if start not in chunk_bounds[bucket] or end not in chunk_bounds[bucket]:
            refuse(where, f"the stored chunks of bucket {bucket} have no boundary at {start} or at {end}, where "
                   f"Megatron's bucket layout puts {name}")
    return positions


class DpReshardableState:
    """The 'dp_reshardable' state of a torch_dist checkpoint written at PP = 1 without virtual
    stages. `rules`: {Megatron global name: its TP rule (dim, blocks) or None};
    `bucket_size_of(rank's parameter count)`: Megatron's DDP bucket size (None: one bucket)."""

    def __init__(self, files, ns, tp: int, dp: int, rules: dict, bucket_size_of, refuse):
        self.files = files
        where = str(files.folder)
        tied = not bool(getattr(ns, "untie_embeddings_and_output_weights", False))
        order = named_parameter_order(files.tensors, int(ns.num_layers), tied)
        unknown = [n for n, _, _ in order if n not in rules]
        if unknown:
            refuse(where, f"model tensor {unknown[0]} has no place in megalite's model")
        params = [(n, local_shape(s, rules[n], tp), d) for n, s, d in order]
        bucket_size = bucket_size_of(sum(math.prod(s) for _, s, _ in params))
        pad_for_busbw = bool(getattr(ns, "ddp_pad_buckets_for_high_nccl_busbw", False))
        self.places = {}  # (tp rank, name) -> (tensor key prefix, start, end, local shape)
        for t in range(tp):
            group = f"{_OPTIMIZER_PREFIX}{t}."
            unpadded = files.stored_object(f"{group}per_bucket_numel_unpadded/shard_0_1")
            if not isinstance(unpadded, list) or not all(isinstance(b, dict) and len(b) == 1 for b in unpadded):
                refuse(where, f"no {group}per_bucket_numel_unpadded (one entry per buffer) for TP rank {t}")
            placed = 0
            for g, buffer in enumerate(unpadded):
                (dtype_pair, lengths), = buffer.items()
                mine = [(n, s) for n, s, d in params if d == dtype_pair[0]]
                prefix = f"{group}gbuf_idx_{g}.dtype_{dtype_pair}."
                bounds = []
                for b in range(len(lengths)):
                    meta = files.tensors.get(f"{prefix}bucket_idx_{b}.param")
                    if meta is None:
                        refuse(where, f"no tensor {prefix}bucket_idx_{b}.param")
                    bounds.append({c.offsets[0] for c in meta.chunks} | {c.offsets[0] + c.sizes[0] for c in meta.chunks})
                positions = bucket_slices(mine, dp, bucket_size, lengths, bounds, pad_for_busbw, refuse,
                                          f"{where} ({prefix}*)")
                shapes = dict(mine)
                for name, (b, start, end) in positions.items():
                    self.places[(t, name)] = (f"{prefix}bucket_idx_{b}.", start, end, shapes[name])
                placed += len(mine)
            if placed != len(params):
                refuse(where, f"TP rank {t}'s buffers ({[list(b)[0][0] for b in unpadded]}) hold {placed} of the "
                       f"model's {len(params)} parameters")
        self.tp = tp
        self._buckets = {}

    def pieces(self, name: str, key: str) -> list[torch.Tensor] | None:
        """Each TP rank's piece of state `key` ('param': the fp32 main value) of Megatron's global
        `name`; None when the checkpoint has no such parameter or state."""
        if (0, name) not in self.places:
            return None
        out = []
        for t in range(self.tp):
            prefix, start, end, shape = self.places[(t, name)]
            tensor_key = prefix + key
            if tensor_key not in self._buckets:
                self._buckets[tensor_key] = self.files.read(tensor_key, None)
            if self._buckets[tensor_key] is None:
                return None
            out.append(self._buckets[tensor_key][start:end].view(shape))
        return out
