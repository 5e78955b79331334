"""--use-mup and the muP family as Megatron-LM HEAD has them (megatron-core 0.16, installed here,
predates muP, so Megatron's formulas are taken from its source):

  megatron/core/transformer/transformer_config.py __post_init__: mup_width_mult = hidden /
      mup_base_hidden_size (default hidden); softmax_scale = (sqrt(mup_base_head_dim) or 1) /
      kv_channels ** mup_attn_scale_power; mup_output_mult -> 1 / width when left at 1;
      init_method std / sqrt(width); output_layer_init_method = mup_scaled_init_method_normal
      (megatron/core/utils.py: std / (sqrt(2 L) sqrt(width))); embeddings (and an untied output
      layer, gpt_model.py) keep std.
  language_model_embedding.py: embeddings x mup_embedding_mult; gpt_model.py _scale_logits:
      logits x mup_output_mult.
  megatron/core/optimizer/__init__.py get_mup_config_overrides: Adam: matrices (not embeddings /
      output) lr, min lr and eps / width; SGD: vector-like lr x width; nothing at width 1."""

import math

import pytest
import torch

from megalite.checkpoint.hf.mapping import family_of
from megalite.config.arguments import model_config_from_args
from megalite.config.run_config import OptimizerConfig, startup_notes
from megalite.model.gpt import GPTModel
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.optimizer.mup import apply_mup
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.state import ParallelState
from megalite.training.lr_schedule import LRScheduler
from tests.config.test_arguments import parsed
from tests.model.test_gpt_tp import batch, make_config

STD = 0.02


def test_flags_resolve_as_megatrons_transformer_config():
    args = parsed("--use-mup --mup-base-hidden-size 16 --hidden-size 64 --num-attention-heads 4", 1)
    config = model_config_from_args(args, 100)
    assert (config.use_mup, config.mup_width_mult, config.mup_output_mult) == (True, 4.0, 0.25)
    assert config.softmax_scale == 1 / 16  # 1 / kv_channels, kv_channels 64 / 4
    assert OptimizerConfig.from_args(args).mup_width_mult == 4.0
    config = model_config_from_args(parsed("--use-mup --mup-base-head-dim 16 --mup-output-mult 0.7 "
                                           "--mup-embedding-mult 3", 1), 100)
    assert (config.mup_width_mult, config.mup_output_mult, config.mup_embedding_mult) == (1.0, 0.7, 3.0)
    assert config.softmax_scale == math.sqrt(16) / 16  # the standard scale at the base head width
    assert model_config_from_args(parsed("--use-mup --mup-attn-scale-power 0.5", 1), 100).softmax_scale == 1 / 4
    plain = model_config_from_args(parsed("--mup-base-hidden-size 16", 1), 100)
    assert (plain.use_mup, plain.softmax_scale, plain.mup_width_mult) == (False, None, 1.0)
    assert [n for n in startup_notes(parsed("--mup-base-hidden-size 16", 1)) if n.startswith("--mup")] == [
        "--mup-base-hidden-size: no effect without --use-mup (as in Megatron)"]


def test_initialisation_scales_with_width():
    width = 4.0
    config = make_config("llama", hidden_size=256, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=512,
                         num_layers=3, init_method_std=STD, use_mup=True, mup_width_mult=width)
    model = GPTModel(config, init_seed=3)
    hidden, output = STD / math.sqrt(width), STD / (math.sqrt(2 * 3) * math.sqrt(width))
    expected = {"layers.1.self_attention.linear_qkv.weight": hidden, "layers.1.mlp.linear_fc1.weight": hidden,
                "layers.1.self_attention.linear_proj.weight": output, "layers.1.mlp.linear_fc2.weight": output,
                "embedding.word_embeddings.weight": STD, "output_layer.weight": STD}
    params = dict(model.named_parameters())
    for name, std in expected.items():
        rows = params[name][:config.vocab_size] if "embedding" in name or "output" in name else params[name]
        assert abs(rows.float().std().item() / std - 1) < 0.05, name
    plain = GPTModel(make_config("llama", hidden_size=256, num_attention_heads=8, num_query_groups=8,
                                 ffn_hidden_size=512, num_layers=3, init_method_std=STD), init_seed=3)
    assert torch.equal(plain.get_parameter("output_layer.weight"), params["output_layer.weight"])
    assert abs(plain.get_parameter("layers.1.mlp.linear_fc2.weight").std().item()
               / (STD / math.sqrt(6)) - 1) < 0.05


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_forward_scales_embeddings_logits_and_attention_scores(family):
    """A muP model equals a plain one whose weights carry the factors: embeddings x e, the
    output layer x o (untied) or the logits' input x o, the query rows x s sqrt(d)."""
    e, o, power = 3.0, 0.25, 1.0
    mup = make_config(family, use_mup=True, mup_width_mult=4.0, mup_embedding_mult=e, mup_output_mult=o,
                      softmax_scale=1 / 8 ** power, untie_embeddings_and_output_weights=True)
    plain = make_config(family, untie_embeddings_and_output_weights=True)
    a, b = GPTModel(mup, init_seed=5), GPTModel(plain, init_seed=5)
    b.load_state_dict(a.state_dict())
    d, groups = mup.kv_channels, mup.num_query_groups
    with torch.no_grad():
        for name, p in b.named_parameters():
            if name.startswith("embedding."):
                p.mul_(e)
            elif name == "output_layer.weight":
                p.mul_(o)
            elif name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
                per_group = p.view(groups, -1, d, *p.shape[1:])
                per_group[:, :-2].mul_(mup.softmax_scale * math.sqrt(d))  # the query heads of each group
    tokens, labels, _ = batch()
    torch.testing.assert_close(a(tokens, labels=labels), b(tokens, labels=labels), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a(tokens), b(tokens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, distributed", [("adam", False), ("sgd", False), ("adam", True)])
def test_optimizer_groups_as_megatrons_overrides(kind, distributed):
    config = make_config("llama")
    state = ParallelState.single()
    chunk = DistributedDataParallel(GPTModel(config, state, init_seed=1), state, use_distributed_optimizer=distributed)
    optimizer = build_optimizer([chunk], state, optimizer=kind, lr=1e-3, adam_eps=1e-8,
                                use_distributed_optimizer=distributed)
    moved = apply_mup(optimizer, 2.0, lr=1e-3, min_lr=1e-4, adam_eps=1e-8)
    scheduler = LRScheduler(optimizer, max_lr=1e-3, min_lr=1e-4, decay_steps=100, warmup_steps=0,
                            decay_style="constant")
    scheduler.step(1)
    by_main = {id(m.main): m for m in optimizer.mains}
    for group in optimizer.param_groups:
        for p in group["params"]:
            m = by_main[id(p)]
            vector = m.param.dim() <= 1 or "embedding" in m.name or "output_layer" in m.name
            scaled = (not vector) if kind == "adam" else vector
            factor = (0.5 if kind == "adam" else 2.0) if scaled else 1.0
            assert group["lr"] == pytest.approx(1e-3 * factor), m.name
            if kind == "adam":
                assert group["eps"] == pytest.approx(1e-8 * factor), m.name
    assert moved == sum(1 for m in optimizer.mains if (m.param.dim() > 1 and "embedding" not in m.name
                                                       and "output_layer" not in m.name) == (kind == "adam"))
    assert apply_mup(optimizer, 1.0, lr=1e-3, min_lr=1e-4, adam_eps=1e-8) == 0


def test_hugging_face_export_refuses_a_mup_model():
    with pytest.raises(ValueError, match="use_mup=True"):
        family_of(make_config("llama", use_mup=True))
