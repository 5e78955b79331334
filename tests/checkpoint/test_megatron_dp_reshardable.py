"""Megatron's 'dp_reshardable' distributed-optimizer layout on a hand-built tiny layout (no
Megatron-Core run; test_megatron_core_optimizer.py resumes from one Megatron-Core wrote): the
positions of parameters within buckets, and each TP rank's pieces read from per-bucket tensors.

The model (TP=2, DP=2, --overlap-grad-reduce with buckets of >= 150 elements), its parameters in
named_parameters order with their per-rank sizes: embedding 16, layer 0's norm 4 and fc2 12,
layer 1's norm 4 and fc2 12, final norm 4, output layer 16. Megatron lays them out in reverse,
each at a multiple of 64, cutting a bucket once it reaches 150 elements and starting the next
at a multiple of lcm(DP, 128) = 128:

    bucket 0: output 0-16, final norm 64-68, fc2.1 128-140, norm.1 192-196 (196 >= 150: cut)
    bucket 1 (world offset 256): fc2.0 0-12, norm.0 64-68, embedding 128-144
"""

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

from megalite.checkpoint.dcp.format import CheckpointError
from megalite.checkpoint.megatron.buckets import bucket_layout, bucket_positions
from megalite.checkpoint.megatron.dp_reshardable import DpReshardableState

NORM, FC2 = "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc2.weight"
FULL = {"embedding.word_embeddings.weight": (8, 4), f"decoder.layers.{NORM}": (2, 4),
        f"decoder.layers.{FC2}": (2, 4, 6), "decoder.final_layernorm.weight": (4,), "output_layer.weight": (8, 4)}
RULES = {"embedding.word_embeddings.weight": (0, 1), "output_layer.weight": (0, 1), "decoder.final_layernorm.weight": None,
         **{f"decoder.layers.{i}.{NORM}": None for i in range(2)}, **{f"decoder.layers.{i}.{FC2}": (1, 1) for i in range(2)}}
PER_RANK = [("embedding.word_embeddings.weight", (4, 4)), (f"decoder.layers.0.{NORM}", (4,)),
            (f"decoder.layers.0.{FC2}", (4, 3)), (f"decoder.layers.1.{NORM}", (4,)), (f"decoder.layers.1.{FC2}", (4, 3)),
            ("decoder.final_layernorm.weight", (4,)), ("output_layer.weight", (4, 4))]
POSITIONS = {"output_layer.weight": (0, 0, 16), "decoder.final_layernorm.weight": (0, 64, 68),
             f"decoder.layers.1.{FC2}": (0, 128, 140), f"decoder.layers.1.{NORM}": (0, 192, 196),
             f"decoder.layers.0.{FC2}": (1, 0, 12), f"decoder.layers.0.{NORM}": (1, 64, 68),
             "embedding.word_embeddings.weight": (1, 128, 144)}
LENGTHS = [196, 144]
DTYPES = (torch.float32, torch.float32)


def test_bucket_positions_as_megatron_lays_them_out():
    params = [(n, torch.Size(s).numel()) for n, s in PER_RANK]
    assert bucket_positions(params, 2, 150) == (POSITIONS, LENGTHS)
    world, numel = bucket_layout(params, 2, 150)  # the legacy torch format: buckets one after another
    assert numel == 340 and world["embedding.word_embeddings.weight"] == (196 + 128, 196 + 144)
    assert bucket_positions(params, 8, 150)[0] == POSITIONS  # positions within a bucket do not depend on DP


def _meta(size, chunks) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


class _Files:
    """What DpReshardableState reads of a torch_dist checkpoint: tensor metadata in stored order,
    pickled objects, tensors."""

    def __init__(self, model_order, buckets: dict, folder="ckpt/iter_0000002"):
        self.folder, self.buckets = folder, buckets
        self.tensors = {k: _meta(FULL[k], [((0,) * len(FULL[k]), FULL[k])]) for k in model_order}
        for key, tensor in buckets.items():
            bucket = int(key.split("bucket_idx_")[1].split(".")[0])
            ends = sorted({0, tensor.numel()} | {e for b, s, t in POSITIONS.values() if b == bucket for e in (s, t)})
            self.tensors[key] = _meta(tensor.shape, [((a,), (b - a,)) for a, b in zip(ends, ends[1:])])

    def stored_object(self, key: str):
        assert key.endswith("per_bucket_numel_unpadded/shard_0_1"), key
        return [{DTYPES: LENGTHS}]

    def read(self, key: str, rule):
        return self.buckets.get(key)


def _checkpoint(model_order=tuple(FULL)):
    """Per-bucket tensors of 'param' and 'exp_avg' for both TP ranks (padding NaN), and each rank's
    true pieces."""
    g = torch.Generator().manual_seed(0)
    truth, buckets = {}, {}
    for t in range(2):
        for key in ("param", "exp_avg"):
            prefix = f"optimizer.distributed.dp_group_idx_{t}.gbuf_idx_0.dtype_{DTYPES}."
            flat = [torch.full((n,), float("nan")) for n in LENGTHS]
            for name, shape in PER_RANK:
                bucket, start, end = POSITIONS[name]
                truth[(t, name, key)] = torch.randn(shape, generator=g)
                flat[bucket][start:end] = truth[(t, name, key)].flatten()
            buckets.update({f"{prefix}bucket_idx_{b}.{key}": f for b, f in enumerate(flat)})
    return _Files(model_order, buckets), truth


def _args(**overrides):
    from types import SimpleNamespace
    return SimpleNamespace(num_layers=2, untie_embeddings_and_output_weights=True, **overrides)


def _refuse(where, what):
    raise CheckpointError(f"{where}: {what}")


def test_each_tp_rank_piece_is_read_from_its_bucket_slice():
    files, truth = _checkpoint()
    state = DpReshardableState(files, _args(), 2, 2, RULES, lambda numel: 150, _refuse)
    for name, _ in PER_RANK:
        for key in ("param", "exp_avg"):
            pieces = state.pieces(name, key)
            assert len(pieces) == 2, name
            for t, piece in enumerate(pieces):
                assert torch.equal(piece, truth[(t, name, key)]), (name, key, t)
    assert state.pieces(name, "exp_avg_sq") is None and state.pieces("decoder.layers.2.x", "param") is None


def test_a_layout_the_checkpoint_contradicts_is_refused_naming_it():
    """The bucket lengths and the stored chunks' offsets catch a wrong parameter order or bucket size."""
    def opened(order, bucket_size=150):
        return DpReshardableState(_checkpoint(order)[0], _args(), 2, 2, RULES, lambda numel: bucket_size, _refuse)

    order = list(FULL)
    with pytest.raises(CheckpointError, match=r"ckpt/iter_0000002 \(optimizer\.distributed\.dp_group_idx_0\.gbuf_idx_0\."
                       r".*\): buckets of \[196, 144\] elements, .* bucket size None\) gives \[400\]"):
        opened(order, None)
    with pytest.raises(CheckpointError, match=r"gives \[204, 144\]"):
        opened([order[0], order[2], order[1], *order[3:]])  # fc2 before the norm within a layer
    with pytest.raises(CheckpointError, match=r"the stored chunks of bucket 0 have no boundary at 0 or at 4, where "
                       r"Megatron's bucket layout puts decoder\.final_layernorm\.weight"):
        opened([*order[:3], order[4], order[3]])  # the same bucket lengths, other positions
