"""Meta-device construction then materialisation equals direct construction bit for bit (both
families, TP = 1 and 2, tied copies on a last pipeline stage), a rank never holds more than
one full weight tensor while building its shard (none with init_on_shard), and init_on_shard
draws each shard directly."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megalite.model.gpt import GPTModel
from megalite.model.meta_init import materialize_
from megalite.model.pipeline_chunks import build_model_chunks
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.model.test_gpt_tp import VOCAB, make_config

ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "shared_embedding")


def _snapshot(model):
    return {n: (p.detach().clone(), {a: getattr(p, a, None) for a in ATTRS}, p.requires_grad)
            for n, p in model.named_parameters()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name][0], b[name][0]), name
        assert a[name][0].dtype == b[name][0].dtype, name
        assert a[name][1:] == b[name][1:], name


def _meta_then_materialize(config, state, **kw):
    model = GPTModel(config, state, device="meta", **kw)
    assert all(p.is_meta for p in model.parameters())
    return materialize_(model, "cpu")


class FullTensorCounter(TorchDispatchMode):
    """Counts the tensors alive at once whose shape is the full (unsharded) shape of one of
    the given sharded parameters; `peak` is the most alive at any moment."""

    def __init__(self, full_shapes):
        super().__init__()
        self.full_shapes, self.live, self.peak, self.seen = set(full_shapes), 0, 0, set()

    def _released(self, key):
        self.live -= 1
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and tuple(t.shape) in self.full_shapes:
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.seen:
                    self.seen.add(key)
                    self.live += 1
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._released, key)
        return out


def _full_shapes(model, tp):
    shapes = set()
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False):
            shape = list(p.shape)
            shape[p.partition_dim] *= tp
            shapes.add(tuple(shape))
    return shapes


def test_counter_sees_two_full_tensors_alive():
    counter = FullTensorCounter({(8, 4)})
    with counter:
        a = torch.zeros(8, 4)
        b = torch.randn(8, 4)
        del a
        c = torch.zeros(8, 4)[:2]
    assert counter.peak == 2 and counter.live == 2
    del b, c


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_meta_materialize_matches_direct_tp1(family):
    config = make_config(family)
    state = ParallelState.single()
    _assert_same(_snapshot(_meta_then_materialize(config, state, init_seed=7)),
                 _snapshot(GPTModel(config, state, init_seed=7)))
    # init_on_shard at TP = 1 draws the full tensors: the same weights
    _assert_same(_snapshot(GPTModel(config, state, init_seed=7, init_on_shard=True)),
                 _snapshot(GPTModel(config, state, init_seed=7)))
    bf16 = config.replace(params_dtype="bfloat16")
    _assert_same(_snapshot(_meta_then_materialize(bf16, state)), _snapshot(GPTModel(bf16, state)))


def test_meta_materialize_tied_last_stage_and_chunks():
    """A last stage's tied output copy is materialised and initialised like the embedding."""
    config = make_config("gpt2", num_layers=4)
    layout = ParallelLayout(2, 1, 2, 2)
    built = {}
    for rank in (0, 1):
        state = ParallelState(layout, rank)
        meta = build_model_chunks(config, state, init_seed=3, device="meta")
        direct = build_model_chunks(config, state, init_seed=3)
        for m, d in zip(meta, direct):
            _assert_same(_snapshot(materialize_(m, "cpu")), _snapshot(d))
        built[rank] = meta
    last = built[1][-1]
    assert last.post_process and last.output_layer.weight.shared_embedding
    assert torch.equal(last.output_layer.weight, built[0][0].embedding.word_embeddings.weight)


def _tp2_config(family, sp):
    extra = dict(num_query_groups=2, ffn_hidden_size=80) if family == "llama" else {}
    return make_config(family, sequence_parallel=sp, **extra)


def _tp2_worker(rank, world):
    import torch.distributed as dist
    state = ParallelState.create(ParallelLayout(2, 2))
    assert state.tp_size == 2
    out = {}
    for family in ("gpt2", "llama"):
        for sp in (False, True):
            config = _tp2_config(family, sp)
            direct_model = GPTModel(config, state, init_seed=7)
            shapes = _full_shapes(direct_model, 2)
            # no shard has the shape of a full tensor, so the counter sees only full tensors
            assert not shapes & {tuple(p.shape) for p in direct_model.parameters()}
            counts = {}
            with FullTensorCounter(shapes) as counter:
                direct = _snapshot(GPTModel(config, state, init_seed=7))
            counts["direct"] = counter.peak
            with FullTensorCounter(shapes) as counter:
                meta = _snapshot(_meta_then_materialize(config, state, init_seed=7))
            counts["materialize"] = counter.peak
            _assert_same(meta, direct)
            with FullTensorCounter(shapes) as counter:
                on_shard = GPTModel(config, state, init_seed=7, init_on_shard=True, device="meta")
                materialize_(on_shard, "cpu")
            counts["on_shard"] = counter.peak
            gathered = {}
            for name, p in on_shard.named_parameters():
                parts = [torch.empty_like(p) for _ in range(2)]
                dist.all_gather(parts, p.detach().contiguous())
                gathered[name] = parts
            out[(family, sp)] = (counts, {n: v[0] for n, v in direct.items()},
                                 {n: p.detach().clone() for n, p in on_shard.named_parameters()}, gathered)
    return out


def test_meta_materialize_tp2_one_full_tensor_at_a_time():
    results = run_distributed(_tp2_worker, 2)
    for key in results[0]:
        family, sp = key
        config = make_config(family, sequence_parallel=sp)
        for rank, res in enumerate(results):
            counts, direct, on_shard, gathered = res[key]
            assert counts == {"direct": 1, "materialize": 1, "on_shard": 0}, (key, rank, counts)
            for name, p in on_shard.items():
                sharded = not all(torch.equal(g, gathered[name][0]) for g in gathered[name])
                if "layernorm" in name or name.endswith(".bias") or "position_embeddings" in name:
                    assert not sharded, name  # replicated: identical on both ranks
            # drawn shards differ from the slices of the full draw, but keep its statistics
            qkv = "layers.0.self_attention.linear_qkv.weight"
            assert not torch.equal(on_shard[qkv], direct[qkv])
            assert not torch.equal(gathered[qkv][0], gathered[qkv][1])
            assert abs(on_shard[qkv].std().item() - config.init_method_std) < 0.2 * config.init_method_std
            # vocabulary padding rows stay zero on whichever rank holds them
            emb = torch.cat(gathered["embedding.word_embeddings.weight"])
            assert torch.count_nonzero(emb[VOCAB:]) == 0 and torch.count_nonzero(emb[:VOCAB].abs().sum(1)) == VOCAB
