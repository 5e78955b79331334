"""A tiny Gated DeltaNet hybrid (linear attention every other layer, full attention with the
output gate, MoE on every layer) at two-process layouts against the single-process run (fp32,
gloo, one spawn for the module, 6 Adam steps): TP2 with sequence parallelism (in_proj's six
blocks, conv1d, A_log, dt_bias split by heads; out_norm's gradient summed over TP), PP2
interleaved (a linear and a full layer per rank, one per chunk), DP2 with the distributed
optimizer, and FSDP2: per-step losses, the first step's gradients (not where they are sharded),
the final parameters and eval logits within 1e-5 relative. In the same spawn a TP2 model is saved
as a DCP checkpoint, which one process loads at TP1 (in_proj's and conv1d's unequal blocks
reassembled)."""

import pytest

import torch

from megalite.checkpoint.dcp.checkpoint import load_checkpoint, save_checkpoint
from megalite.model.config import GPTConfig
from megalite.model.moe_config import MoEConfig
from megalite.model.pipeline_chunks import build_model_chunks
from tests.distributed import run_distributed
from tests.parallel import mla_harness
from tests.parallel.expert import ep_harness

LAYOUTS = {
    "tp2-sp": dict(tp=2, sp=True),
    "pp2-interleaved": dict(pp=2, vp=2),
    "dp2-distopt": dict(dist_opt=True),
}
FSDP = "dp2-fsdp2"


def gdn_config(sequence_parallel=False) -> GPTConfig:
    moe = MoEConfig(num_experts=8, ffn_hidden_size=12, router_topk=2, token_dispatcher_type="alltoall",
                    load_balancing_type="aux_loss", aux_loss_coeff=1e-2)
    gdn = dict(linear_attention_freq=2, linear_conv_kernel_dim=3, linear_key_head_dim=4, linear_value_head_dim=6,
               linear_num_key_heads=2, linear_num_value_heads=4, chunk_size=3)
    return GPTConfig(num_layers=4, hidden_size=ep_harness.HIDDEN, num_attention_heads=4, num_query_groups=2,
                     vocab_size=ep_harness.VOCAB, max_position_embeddings=ep_harness.SEQ, ffn_hidden_size=24,
                     activation="swiglu", normalization="RMSNorm", position_embedding_type="rope",
                     add_bias_linear=False, qk_layernorm=True, untie_embeddings_and_output_weights=True,
                     attention_dropout=0.0, hidden_dropout=0.0, sequence_parallel=sequence_parallel, moe=moe, gdn=gdn,
                     attention_output_gate=True)


def _worker(rank, world_size, root):
    state = mla_harness.layout_state(tp=2)
    saved = build_model_chunks(gdn_config(), state, init_seed=11)
    save_checkpoint(root, 1, chunks=saved, optimizer=None, pstate=state, common={})
    out = {}
    for name, spec in LAYOUTS.items():
        state = mla_harness.layout_state(**{k: v for k, v in spec.items() if k in ("tp", "pp", "vp")})
        out[name] = mla_harness.train(state, gdn_config(spec.get("sp", False)), dist_opt=spec.get("dist_opt", False))
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
    ref = reference_runs.get(mla_harness.reference, gdn_config())
    assert mla_harness.check([r[layout] for r in two_process], ref) == []


def test_fsdp2_equals_one_process(two_process, reference_runs):
    ref = reference_runs.get(ep_harness.reference, gdn_config(), steps=mla_harness.STEPS)
    results = [{k: v for k, v in r[FSDP].items() if k != "memory"} for r in two_process]
    assert ep_harness.compare(results, ref) == []
