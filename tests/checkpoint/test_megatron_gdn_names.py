"""Megatron-Core's Gated DeltaNet names and shapes read as megalite's tensors (the fast check of
what test_megatron_core_gdn.py checks on a checkpoint Megatron-Core writes, slow): a megalite GDN
hybrid written by hand as Megatron lays it out, in `torch_dist` (in_proj and conv1d as the
separate blocks GatedDeltaNet.sharded_state_dict splits them into; the GDN layer's input norm
under Transformer Engine's fused name in_proj.layer_norm_weight) and in `torch` at TP=2 (each
rank's rows of each block, megatron/core/ssm/gated_delta_net.py's split), reads back as the
model's full tensors, every stored tensor used."""

import torch
import torch.distributed.checkpoint as dcp

from megalite.checkpoint.megatron.reader import MegatronCheckpoint
from megalite.model.config import GPTConfig
from megalite.model.gdn_config import GDNConfig
from megalite.model.gpt import GPTModel
from tests.checkpoint.megatron_files import megatron_args, megatron_state_dict

GDN = GDNConfig(linear_attention_freq=(1, 0), linear_conv_kernel_dim=3, linear_key_head_dim=4,
                linear_value_head_dim=2, linear_num_key_heads=2, linear_num_value_heads=4)
CONFIG = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=64, max_position_embeddings=16,
                   normalization="RMSNorm", activation="swiglu", add_bias_linear=False, position_embedding_type="rope",
                   untie_embeddings_and_output_weights=True, ffn_hidden_size=32, make_vocab_size_divisible_by=8,
                   hidden_dropout=0.0, attention_dropout=0.0, gdn=GDN, attention_output_gate=True)
ARGS = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=[1, 0], attention_output_gate=True,
            **{name: getattr(GDN, name) for name in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                     "linear_value_head_dim", "linear_num_key_heads",
                                                     "linear_num_value_heads")})
IN_PROJ_BLOCKS = ("query", "key", "value", "z", "beta", "alpha")
GDN_LAYER = "decoder.layers.0.self_attention."


def _blocks(full: torch.Tensor, sections) -> list[torch.Tensor]:
    return list(full.split(list(sections)))


def _write(folder, state: dict, args) -> None:
    (folder.parent / "latest_checkpointed_iteration.txt").write_text("3")
    args.ckpt_format = "torch_dist"
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 3}, folder / "common.pt")
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')


def _torch_dist(root, full: dict) -> None:
    state = dict(full)
    in_proj, conv = state.pop(GDN_LAYER + "in_proj.weight"), state.pop(GDN_LAYER + "conv1d.weight")
    for name, block in zip(IN_PROJ_BLOCKS, _blocks(in_proj, GDN.in_proj_sections())):
        state[f"{GDN_LAYER}in_proj.weight.{name}"] = block
    for name, block in zip(IN_PROJ_BLOCKS[:3], _blocks(conv, (GDN.qk_dim, GDN.qk_dim, GDN.v_dim))):
        state[f"{GDN_LAYER}conv1d.weight.{name}"] = block
    state[GDN_LAYER + "in_proj.layer_norm_weight"] = state.pop("decoder.layers.0.input_layernorm.weight")
    folder = root / "iter_0000003"
    folder.mkdir(parents=True)
    _write(folder, state, megatron_args(**ARGS))


def _rank_slice(name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Megatron's TP=2 slice of rank `rank` (its ColumnParallel / RowParallel layers; GDN's
    blocks each split on their own)."""
    half = lambda t, dim=0: t.chunk(2, dim=dim)[rank]  # noqa: E731
    if name.endswith("in_proj.weight"):
        return torch.cat([half(b) for b in _blocks(tensor, GDN.in_proj_sections())])
    if name.endswith("conv1d.weight"):
        return torch.cat([half(b) for b in _blocks(tensor, (GDN.qk_dim, GDN.qk_dim, GDN.v_dim))])
    if name.endswith(("A_log", "dt_bias", "linear_qkv.weight", "embedding.word_embeddings.weight",
                      "output_layer.weight")):
        return half(tensor)
    if name.endswith("linear_fc1.weight"):  # SwiGLU: [gate rows of the rank; up rows of the rank]
        return torch.cat([half(b) for b in tensor.chunk(2)])
    if name.endswith(("out_proj.weight", "linear_proj.weight", "linear_fc2.weight")):
        return half(tensor, 1)
    return tensor  # norms


def _torch_tp2(root, full: dict) -> None:
    args = megatron_args(**ARGS, tensor_model_parallel_size=2)
    args.ckpt_format = "torch"
    for rank in range(2):
        folder = root / "iter_0000003" / f"mp_rank_{rank:02d}"
        folder.mkdir(parents=True)
        model = {name: _rank_slice(name, t, rank).clone() for name, t in full.items()}
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 3, "model": model},
                   folder / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("3")


def test_megatron_gdn_layouts_read_as_megalite_tensors(tmp_path):
    model = GPTModel(CONFIG, init_seed=3)
    expected = model.state_dict()
    full = megatron_state_dict(model)
    _torch_dist(tmp_path / "dist", full)
    _torch_tp2(tmp_path / "torch", full)
    for fmt in ("dist", "torch"):
        checkpoint = MegatronCheckpoint(tmp_path / fmt)
        assert checkpoint.config.gdn == GDN and checkpoint.config.attention_output_gate
        assert sorted(checkpoint.names()) == sorted(n for n in expected if not n.endswith("_extra_state"))
        for name in checkpoint.names():
            assert checkpoint.spec(name)[0] == tuple(expected[name].shape), f"{fmt}: {name}"
            torch.testing.assert_close(checkpoint.get(name), expected[name], rtol=0, atol=0, msg=f"{fmt}: {name}")
        checkpoint.check_all_used()
