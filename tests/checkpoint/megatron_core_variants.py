"""Megatron-Core checkpoints of the model variants a Megatron-LM checkpoint's args select, built on
CPU at TP=2 in two gloo processes (the shims of megatron_core_fixture), saved in torch_dist with
the logits Megatron-Core computes.

Each variant's args are what that Megatron-LM version stores (megatron_lm_args), and its model is
built from them as Megatron-LM's pretrain_gpt builds it: TransformerConfig fields as
core_transformer_config_from_args copies them (swiglu -> gated SiLU, squared_relu ->
megatron.core.activations.squared_relu, bias_activation_fusion from bias_swiglu_fusion /
bias_gelu_fusion), the local layer spec with the args' qk_layernorm and normalization, and
GPTModel's position options as the builder passes them: core_v0.16.1's gpt_builders.gpt_builder
passes position_embedding_type, rotary_percent, rotary_base and rope_scaling; HEAD's
GPTModelConfig builder also seq_len_interpolation_factor. Neither passes rope_scaling_factor.
"""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.checkpoint.megatron_core_fixture import ITERATION, TP, _forward, _no_tracker, cpu_shims, tokens
from tests.checkpoint.megatron_lm_args import megatron_lm_args

# Larger than Megatron's 0.02 so that attention and positions move the logits well beyond the
# tests' 1e-5: a dropped argument shows.
INIT_STD = 0.3
# name: (family, Megatron-LM version whose args and builder it has, the args that make it)
VARIANTS = {
    "qk_layernorm": ("llama", "0.16.1", {"qk_layernorm": True}),
    "use_rope_scaling": ("llama", "0.16.1", {"use_rope_scaling": True, "rotary_base": 1000000}),
    "rotary_interleaved": ("llama", "0.16.1", {"rotary_interleaved": True}),
    "squared_relu": ("gpt2", "0.16.1", {"squared_relu": True}),
    "position_embedding_type_none": ("llama", "0.16.1", {"position_embedding_type": "none"}),
    "rotary_seq_len_interpolation_factor": ("llama", "head", {"rotary_seq_len_interpolation_factor": 4}),
    "rotary_seq_len_interpolation_factor_0.16.1": ("llama", "0.16.1", {"rotary_seq_len_interpolation_factor": 4}),
    "bias_gelu_fusion": ("gpt2", "0.16.1", {"bias_gelu_fusion": True}),
    "layernorm_epsilon": ("llama", "head", {"layernorm_epsilon": 0.05}),
}


def variant_args(name: str):
    family, version, overrides = VARIANTS[name]
    return megatron_lm_args(version, family, init_method_std=INIT_STD, **overrides)


def megatron_lm_model(args, version: str, seed: int):
    """Megatron-Core's GPTModel as Megatron-LM `version`'s pretrain_gpt builds it from `args`
    (TP=2 PP=1 rank of the initialised parallel state, fp32, CPU)."""
    from megatron.core import tensor_parallel
    from megatron.core.activations import squared_relu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    activation = F.silu if args.swiglu else squared_relu if args.squared_relu else F.gelu
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels, normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon, qk_layernorm=args.qk_layernorm,
        rotary_interleaved=args.rotary_interleaved, gated_linear_unit=args.swiglu, activation_func=activation,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias, tensor_model_parallel_size=TP,
        use_cpu_initialization=True, perform_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, init_method_std=args.init_method_std, pipeline_dtype=torch.float32)
    builder_passes = {"seq_len_interpolation_factor": args.rotary_seq_len_interpolation_factor} if version == "head" else {}
    torch.manual_seed(seed)
    tensor_parallel.get_cuda_rng_tracker = tensor_parallel.random.get_cuda_rng_tracker = _no_tracker
    return GPTModel(
        config, get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, **builder_passes)


def write_variant_checkpoints(rank: int, world: int, out: str, names: list[str]):
    """Spawned worker (TP=2): each variant built, run and saved in torch_dist under out/<name>,
    its logits in out/<name>/logits.pt."""
    from megatron.core import dist_checkpointing, parallel_state

    cpu_shims()
    torch._dynamo.config.disable = True  # Megatron's fused bias-GeLU is torch.compile'd: run it eagerly
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        for name in names:
            args = variant_args(name)
            model = megatron_lm_model(args, VARIANTS[name][1], seed=1234)
            logits = _forward(model, tokens())
            root = Path(out) / name
            folder = root / f"iter_{ITERATION:07d}"
            if rank == 0:
                folder.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                                     "model": model.sharded_state_dict(), "num_floating_point_operations_so_far": 0},
                                    str(folder))
            dist.barrier()
            if rank == 0:
                (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
                torch.save(logits, root / "logits.pt")
    finally:
        parallel_state.destroy_model_parallel()
