"""A tiny Gated DeltaNet hybrid (linear attention every other layer, full attention with the
output gate, MoE on every layer) at two-process layouts against the single-process run (fp32,
gloo, one spawn for the module, 6 Adam steps, 3 at CP): TP2 with sequence parallelism (in_proj's six
blocks, conv1d, A_log, dt_bias split by heads; out_norm's gradient summed over TP), PP2
interleaved (a linear and a full layer per rank, one per chunk), DP2 with the distributed
optimizer, CP2 (the linear layers' all-to-all to whole sequences and split heads, the full
layers' ring attention), and FSDP2: per-step losses, the first step's gradients (not where they
are sharded), the final parameters and eval logits within 1e-5 relative. In the same spawn a TP2
model is saved as a DCP checkpoint, which one process loads at TP1 (in_proj's and conv1d's
unequal blocks reassembled).

One four-process spawn: TP2 SP x CP2 (the full layers' a2a attention) trained
the same way, and one Gated DeltaNet layer on packed documents (a --reset-attention-mask mask,
each CP rank its rows) at CP2 (x DP2) and TP2 x CP2: output, input gradient and parameter
gradients (summed over CP) equal the layer's on one process."""

import pytest

import torch

from megalite.checkpoint.dcp.checkpoint import load_checkpoint, save_checkpoint
from megalite.model.config import GPTConfig
from megalite.model.gated_delta_net import GatedDeltaNet
from megalite.model.moe_config import MoEConfig
from megalite.model.pipeline_chunks import build_model_chunks
from megalite.parallel import comm
from megalite.parallel.context import split_sequence
from megalite.parallel.context.split import split_attention_mask
from megalite.parallel.sharding import gather_tp_full, is_sharded, shard_of_full
from tests.distributed import run_distributed
from tests.parallel import mla_harness
from tests.parallel.expert import ep_harness

CP_STEPS = 3  # (the context-parallel layouts: fewer steps, the four-process spawn's cost)
LAYOUTS = {
    "tp2-sp": dict(tp=2, sp=True),
    "pp2-interleaved": dict(pp=2, vp=2),
    "dp2-distopt": dict(dist_opt=True),
    "cp2": dict(cp=2, steps=CP_STEPS),
}
FOUR = {"tp2-sp-cp2": dict(tp=2, sp=True, cp=2, cp_comm_type="a2a", steps=CP_STEPS)}
FSDP = "dp2-fsdp2"
GRID = ("tp", "pp", "vp", "cp")
PACKED = {"cp2": dict(cp=2), "tp2-cp2": dict(tp=2, cp=2)}
PACKED_SEQ, PACKED_STARTS = 12, ((3, 7), (5,))  # two rows, documents starting there (CP2: chunks of 3)


def gdn_config(sequence_parallel=False, cp_comm_type="p2p") -> GPTConfig:
    moe = MoEConfig(num_experts=8, ffn_hidden_size=12, router_topk=2, token_dispatcher_type="alltoall",
                    load_balancing_type="aux_loss", aux_loss_coeff=1e-2)
    # 4 key heads: whole heads on each rank at TP2 x CP2
    gdn = dict(linear_attention_freq=2, linear_conv_kernel_dim=3, linear_key_head_dim=4, linear_value_head_dim=6,
               linear_num_key_heads=4, linear_num_value_heads=8, chunk_size=3)
    return GPTConfig(num_layers=4, hidden_size=ep_harness.HIDDEN, num_attention_heads=4, num_query_groups=2,
                     vocab_size=ep_harness.VOCAB, max_position_embeddings=ep_harness.SEQ, ffn_hidden_size=24,
                     activation="swiglu", normalization="RMSNorm", position_embedding_type="rope",
                     add_bias_linear=False, qk_layernorm=True, untie_embeddings_and_output_weights=True,
                     attention_dropout=0.0, hidden_dropout=0.0, sequence_parallel=sequence_parallel, moe=moe, gdn=gdn,
                     attention_output_gate=True, cp_comm_type=cp_comm_type)


def _train_layouts(layouts) -> dict:
    return {name: mla_harness.train(mla_harness.layout_state(**{k: v for k, v in spec.items() if k in GRID}),
                                    gdn_config(spec.get("sp", False), spec.get("cp_comm_type", "p2p")),
                                    dist_opt=spec.get("dist_opt", False), steps=spec.get("steps", mla_harness.STEPS))
            for name, spec in layouts.items()}


def _document_mask() -> torch.Tensor:
    """[2, 1, s, s], True where not allowed: causal within each row's documents."""
    rows = []
    for starts in PACKED_STARTS:
        doc = torch.zeros(PACKED_SEQ, dtype=torch.long)
        for start in starts:
            doc[start:] += 1
        rows.append(~((doc[:, None] == doc[None, :]) & torch.ones(PACKED_SEQ, PACKED_SEQ, dtype=torch.bool).tril()))
    return torch.stack(rows)[:, None]


def _full_layer() -> GatedDeltaNet:
    """One process's layer, random weights (A_log the log of values in (0, 1))."""
    layer = GatedDeltaNet(gdn_config())
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.A_log.copy_(torch.rand(layer.A_log.shape, generator=g).log())
    return layer


def packed_layer_run(pstate=None) -> dict:
    """The layer on packed documents: its output and input gradient (this CP rank's tokens) and
    every parameter's full gradient (summed over CP, gathered over TP)."""
    full = _full_layer()
    x, grad = torch.randn(2, PACKED_SEQ, 2, mla_harness.HIDDEN, generator=torch.Generator().manual_seed(5))
    mask = _document_mask()
    layer, cp, cp_rank = full, 1, 0
    if pstate is not None:
        cp, cp_rank, tp_group = pstate.cp_size, pstate.cp_rank, pstate.tp_group
        layer = GatedDeltaNet(gdn_config(), tp_group, cp_group=pstate.cp_group)
        with torch.no_grad():
            for p, whole in zip(layer.parameters(), full.parameters()):
                p.copy_(shard_of_full(whole, p.partition_dim, p.partition_stride, pstate.tp_rank, pstate.tp_size)
                        if is_sharded(p) else whole)
    x = split_sequence(x, 0, cp, cp_rank).requires_grad_()
    out = layer(x, attention_mask=split_attention_mask(mask, cp, cp_rank))
    out.backward(split_sequence(grad, 0, cp, cp_rank))
    grads = {}
    for name, p in layer.named_parameters():
        g = p.grad if pstate is None else comm.all_reduce(p.grad.clone(), pstate.cp_group)
        if pstate is not None and not is_sharded(p):  # out_norm: partial per TP rank
            g = comm.all_reduce(g, pstate.tp_group)
        grads[name] = g if pstate is None else gather_tp_full(p, g, pstate.tp_group)
    return dict(out=out.detach(), x_grad=x.grad, grads=grads, cp_rank=cp_rank)


def _four_worker(rank, world_size):
    out = _train_layouts(FOUR)
    for name, spec in PACKED.items():
        out["packed-" + name] = packed_layer_run(mla_harness.layout_state(**spec))
    return out


def _worker(rank, world_size, root):
    state = mla_harness.layout_state(tp=2)
    saved = build_model_chunks(gdn_config(), state, init_seed=11)
    save_checkpoint(root, 1, chunks=saved, optimizer=None, pstate=state, common={})
    out = _train_layouts(LAYOUTS)
    out[FSDP] = ep_harness.train(ep_harness.expert_state(), gdn_config(), steps=mla_harness.STEPS, fsdp=True)
    return out


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gdn_tp2")


@pytest.fixture(scope="module")
def two_process(checkpoint_root):
    return run_distributed(_worker, 2, str(checkpoint_root), timeout=900)


def test_tp2_checkpoint_loads_at_tp1(two_process, checkpoint_root):
    state = mla_harness.single_state()
    want = build_model_chunks(gdn_config(), state, init_seed=11)[0]
    got = build_model_chunks(gdn_config(), state, init_seed=99)[0]
    load_checkpoint(checkpoint_root, chunks=[got], pstate=state)
    vocab = ep_harness.VOCAB
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        rows = vocab if "word_embeddings" in name or "output_layer" in name else None
        assert torch.equal(a[:rows], b[:rows]), name


def test_reference_trains_every_parameter(reference_runs):
    ref = reference_runs.get(mla_harness.reference, gdn_config())
    zero = [name for name, grad in ref["grads"].items() if not grad.abs().sum() > 0]
    assert zero == []
    assert "layers.0.self_attention.A_log" in ref["grads"] and "layers.1.self_attention.linear_qkv.weight" in ref["grads"]
    assert all(loss == loss for loss in ref["losses"])  # no NaN


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(two_process, reference_runs, layout):
    steps = LAYOUTS[layout].get("steps", mla_harness.STEPS)
    ref = reference_runs.get(mla_harness.reference, gdn_config(), steps=steps)
    assert mla_harness.check([r[layout] for r in two_process], ref) == []


def test_fsdp2_equals_one_process(two_process, reference_runs):
    ref = reference_runs.get(ep_harness.reference, gdn_config(), steps=mla_harness.STEPS)
    results = [{k: v for k, v in r[FSDP].items() if k != "memory"} for r in two_process]
    assert ep_harness.compare(results, ref) == []


@pytest.fixture(scope="module")
def four_process():
    return run_distributed(_four_worker, 4, timeout=900)


@pytest.mark.parametrize("layout", list(FOUR))
def test_four_process_layout_equals_one_process(four_process, reference_runs, layout):
    ref = reference_runs.get(mla_harness.reference, gdn_config(), steps=FOUR[layout]["steps"])
    assert mla_harness.check([r[layout] for r in four_process], ref) == []


@pytest.mark.parametrize("layout", list(PACKED))
def test_packed_documents_under_context_parallelism(four_process, layout):
    want = packed_layer_run()
    x = torch.randn(2, PACKED_SEQ, 2, mla_harness.HIDDEN, generator=torch.Generator().manual_seed(5))[0]
    with torch.no_grad():
        assert (_full_layer()(x) - want["out"]).abs().max() > 1e-3  # the documents matter
    for r in four_process:
        got = r["packed-" + layout]
        for key in ("out", "x_grad"):
            torch.testing.assert_close(got[key], split_sequence(want[key], 0, 2, got["cp_rank"]), rtol=1e-5,
                                       atol=1e-6)
        for name, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-6, msg=name)
