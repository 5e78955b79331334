"""Every argument of a Megatron-LM checkpoint that changes the GPT model's forward pass is mapped
into megalite's GPTConfig, refused by name, or (where Megatron-LM's own builder never hands it to
the model) left out with a note: never dropped.

The list (CASES) and the arguments without effect on the forward pass (NO_FORWARD_EFFECT) come
from Megatron-LM, at HEAD d98e8a64ddf34856e74b24714e3bedb2f5a39553 and at core_v0.16.1
55ac7082517c3878ae653c07c09c534b8aed49f6 (the installed megatron-core 0.16.1):
  - megatron/training/arguments.py: the arguments (TransformerConfig's fields but the exclude list
    of _add_network_size_args; network size, MoE, MLA, experimental, fusion, tokenizer groups);
  - core_transformer_config_from_args (arguments.py at core_v0.16.1, argument_utils.py at HEAD):
    every TransformerConfig field copied by name; swiglu -> gated SiLU, squared_relu,
    quick_geglu; bias_activation_fusion = bias_swiglu_fusion or bias_gelu_fusion;
  - the GPTModel options: gpt_builders.py gpt_builder (position_embedding_type, rotary_percent,
    rotary_base, rope_scaling; core_v0.16.1 ... core_v0.18) and megatron/training/models/gpt.py
    GPTModelConfig via argument_utils.gpt_config_from_args (HEAD: also seq_len_interpolation_factor;
    rope_scaling_factor never);
  - megatron/core/transformer/mlp.py MLP.forward: with bias_activation_fusion a non-gated GeLU is
    fusions/fused_bias_gelu.bias_gelu, the tanh approximation; legacy/model/transformer.py alone
    reads openai_gelu and onnx_safe;
  - megatron/training/checkpointing.py load_args_from_checkpoint: disable_bias_linear overrides
    add_bias_linear;
  - NullTokenizer: tokenizer.py _NullTokenizer (core_v0.16.1: vocab_size + 1) and
    megatron/core/tokenizers/text/libraries/null_tokenizer.py (HEAD: vocab_size).
The variants' logits against Megatron-Core: tests/checkpoint/test_megatron_core_variants.py.
"""

import dataclasses

import pytest

from megalite.checkpoint.megatron.args import config_from_megatron_args, megatron_args_notes, vocab_size_of
from megalite.checkpoint.publish import ConversionError
from megalite.model.gdn_config import GDNConfig
from megalite.model.mla_config import MLAConfig
from megalite.model.moe_config import MoEConfig
from tests.checkpoint.megatron_lm_args import HEAD_ARGUMENTS, HEAD_CONFIG_FIELDS, OTHER_ARGUMENTS, megatron_lm_args

REFUSED, IGNORED = "refused", "ignored"
LLAMA, GPT2 = "llama", "gpt2"
V16, HEAD, V15, V7 = "0.16.1", "head", "0.15", "0.7"

# (argument, value, Megatron-LM version, family, other arguments it needs, what megalite makes
# of it: the GPTConfig fields it sets (or a function of the GPTConfig without it giving them),
# REFUSED, or IGNORED by Megatron's own model).
_GDN_ON = {"experimental_attention_variant": "gated_delta_net", "linear_attention_freq": 2}
_MLA_ON = {"group_query_attention": False}  # MLA has no query groups (Megatron refuses the two together)
CASES = [
    ("num_layers", 6, V16, LLAMA, {}, {"num_layers": 6}),
    ("hidden_size", 64, V16, LLAMA, {}, {"hidden_size": 64}),
    ("num_attention_heads", 8, V16, LLAMA, {}, {"num_attention_heads": 8}),
    ("num_query_groups", 1, V16, LLAMA, {}, {"num_query_groups": 1}),
    ("group_query_attention", False, V16, LLAMA, {}, {"num_query_groups": 4}),
    ("ffn_hidden_size", 96, V16, LLAMA, {}, {"ffn_hidden_size": 96}),
    ("kv_channels", 16, V16, LLAMA, {}, {"kv_channels": 16}),
    ("max_position_embeddings", 128, V16, GPT2, {}, {"max_position_embeddings": 128}),
    ("position_embedding_type", "none", V16, LLAMA, {}, {"position_embedding_type": "none"}),
    ("position_embedding_type", "rope", V16, GPT2, {}, {"position_embedding_type": "rope"}),
    ("position_embedding_type", "yarn", HEAD, LLAMA, {}, REFUSED),
    ("position_embedding_type", "mrope", V16, LLAMA, {}, REFUSED),
    ("position_embedding_type", "relative", V16, LLAMA, {}, REFUSED),
    ("use_rotary_position_embeddings", True, V16, GPT2, {}, {"position_embedding_type": "rope"}),
    ("rotary_base", 500000, V16, LLAMA, {}, {"rotary_base": 500000.0}),
    ("rotary_percent", 0.5, V16, LLAMA, {}, {"rotary_percent": 0.5}),
    ("rotary_interleaved", True, V16, LLAMA, {}, {"rotary_interleaved": True}),
    ("rotary_seq_len_interpolation_factor", 4, HEAD, LLAMA, {}, {"rotary_seq_len_interpolation_factor": 4.0}),
    ("rotary_seq_len_interpolation_factor", 4, V16, LLAMA, {}, IGNORED),
    ("rotary_seq_len_interpolation_factor", 4, HEAD, LLAMA, {"delay_offload_until_cuda_graph": ...}, REFUSED),
    ("use_rope_scaling", True, V16, LLAMA, {}, {"use_rope_scaling": True}),
    ("rope_scaling_factor", 16.0, V16, LLAMA, {"use_rope_scaling": True}, IGNORED),
    ("rope_scaling_factor", 16.0, HEAD, LLAMA, {"use_rope_scaling": True}, IGNORED),
    ("no_rope_freq", [0, 0, 0, 1], V16, LLAMA, {}, REFUSED),
    ("add_position_embedding", False, V16, LLAMA, {}, IGNORED),
    ("normalization", "LayerNorm", V16, LLAMA, {}, {"normalization": "LayerNorm"}),
    ("normalization", "L2Norm", V16, LLAMA, {}, REFUSED),
    ("layernorm_epsilon", 1e-6, V16, LLAMA, {}, {"norm_epsilon": 1e-6}),
    ("layernorm_epsilon", 1e-6, HEAD, LLAMA, {}, {"norm_epsilon": 1e-6}),
    ("norm_epsilon", 1e-6, V15, LLAMA, {}, {"norm_epsilon": 1e-6}),
    ("layernorm_zero_centered_gamma", True, V16, LLAMA, {}, {"apply_layernorm_1p": True}),
    ("apply_layernorm_1p", True, V15, LLAMA, {}, {"apply_layernorm_1p": True}),
    ("qk_layernorm", True, V16, LLAMA, {}, {"qk_layernorm": True}),
    ("qk_l2_norm", True, V16, LLAMA, {}, REFUSED),
    ("add_bias_linear", True, V16, LLAMA, {}, {"add_bias_linear": True}),
    ("disable_bias_linear", True, V16, GPT2, {}, {"add_bias_linear": False}),
    ("add_qkv_bias", True, V16, LLAMA, {}, {"add_qkv_bias": True}),
    ("swiglu", True, V16, GPT2, {}, {"activation": "swiglu"}),
    ("squared_relu", True, V16, GPT2, {}, {"activation": "squared_relu"}),
    ("squared_relu", True, V16, LLAMA, {}, REFUSED),  # with swiglu: Megatron asserts
    ("quick_geglu", True, V16, GPT2, {}, REFUSED),
    ("bias_gelu_fusion", True, V16, GPT2, {}, {"activation": "openai_gelu"}),
    ("use_te_activation_func", True, V16, GPT2, {}, {"activation": "openai_gelu"}),
    ("openai_gelu", True, V16, GPT2, {}, IGNORED),
    ("onnx_safe", True, V16, GPT2, {}, IGNORED),
    ("glu_linear_offset", 1.0, V16, LLAMA, {}, REFUSED),
    ("activation_func_clamp_value", 7.0, V16, LLAMA, {}, REFUSED),
    ("softmax_type", "off-by-one", V16, LLAMA, {}, REFUSED),
    ("softmax_type", "learnable", V16, LLAMA, {}, REFUSED),
    ("attention_output_gate", True, V16, LLAMA, {}, {"attention_output_gate": True}),
    ("window_size", (64, 0), V16, LLAMA, {}, REFUSED),
    ("apply_residual_connection_post_layernorm", True, V16, GPT2, {}, REFUSED),
    ("untie_embeddings_and_output_weights", True, V16, GPT2, {}, {"untie_embeddings_and_output_weights": True}),
    ("make_vocab_size_divisible_by", 16, V16, LLAMA, {}, {"make_vocab_size_divisible_by": 16}),
    ("hidden_dropout", 0.2, V16, LLAMA, {}, {"hidden_dropout": 0.2}),
    ("attention_dropout", 0.2, V16, LLAMA, {}, {"attention_dropout": 0.2}),
    ("init_method_std", 0.01, V16, LLAMA, {}, {"init_method_std": 0.01}),
    ("bf16", True, V16, LLAMA, {}, {"params_dtype": "bfloat16"}),
    ("fp16", True, V16, LLAMA, {}, {"params_dtype": "float16"}),
    ("vocab_size", 127, V16, LLAMA, {"padded_vocab_size": 128}, {"vocab_size": 128}),  # + the EOD id
    ("vocab_size", 128, HEAD, LLAMA, {"padded_vocab_size": 128}, {"vocab_size": 128}),
    ("vocab_size", 96, V16, LLAMA, {"padded_vocab_size": 96}, {"vocab_size": 96}),  # 97 would need 112 rows
    ("tokenizer_type", "GPT2BPETokenizer", V16, LLAMA, {}, {"vocab_size": 96}),  # its files decide: all rows
    ("use_legacy_models", True, V16, GPT2, {}, REFUSED),
    ("use_mcore_models", False, V7, GPT2, {}, REFUSED),
    ("multi_latent_attention", True, V16, LLAMA, _MLA_ON, lambda before: {"mla": MLAConfig(
        q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
        rope_type="yarn", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)}),
    *[(name, value, V16, LLAMA, {**_MLA_ON, "multi_latent_attention": True},
       lambda before, name=name, value=value: {"mla": dataclasses.replace(before.mla, **{name: value})})
      for name, value in (("q_lora_rank", 48), ("kv_lora_rank", 16), ("qk_head_dim", 32), ("qk_pos_emb_head_dim", 16),
                          ("v_head_dim", 24), ("rope_type", "rope"), ("rotary_scaling_factor", 40.0), ("mscale", 0.7),
                          ("mscale_all_dim", 0.7))],
    ("mtp_num_layers", 1, V16, LLAMA, {}, {"mtp_num_layers": 1}),
    ("mtp_loss_scaling_factor", 0.3, V16, LLAMA, {"mtp_num_layers": 1}, {"mtp_loss_scaling_factor": 0.3}),
    ("mtp_use_repeated_layer", True, HEAD, LLAMA, {"mtp_num_layers": 2}, REFUSED),
    ("mtp_hsm", True, HEAD, LLAMA, {"mtp_num_layers": 1}, REFUSED),
    ("mtp_hybrid_override_pattern", "M*", HEAD, LLAMA, {"mtp_num_layers": 1}, REFUSED),
    ("num_experts", 8, V16, LLAMA, {}, lambda before: {"moe": MoEConfig(num_experts=8, ffn_hidden_size=before.ffn_hidden_size)}),
    ("num_experts", 8, V16, GPT2, {}, REFUSED),  # Megatron's experts with biases: megalite's have none
    *[(name, value, V16, LLAMA, {"num_experts": 8, "moe_router_score_function": "sigmoid"},
       lambda before, field=field, value=value: {"moe": dataclasses.replace(before.moe, **{field: value})})
      for name, field, value in (("moe_layer_freq", "layer_freq", [0, 1, 1, 1]), ("moe_router_topk", "router_topk", 4),
                                 ("moe_ffn_hidden_size", "ffn_hidden_size", 24),
                                 ("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size", 16),
                                 ("moe_shared_expert_gate", "shared_expert_gate", True),
                                 ("moe_router_enable_expert_bias", "enable_expert_bias", True),
                                 ("moe_router_pre_softmax", "pre_softmax", True),
                                 ("moe_router_topk_scaling_factor", "topk_scaling_factor", 2.5))],
    ("heterogeneous_layers_config_path", "/models/nemotron.json", V16, LLAMA, {}, REFUSED),
    ("experimental_attention_variant", "gated_delta_net", V16, LLAMA, {}, REFUSED),  # no linear_attention_freq
    ("experimental_attention_variant", "gated_delta_net", V16, LLAMA, {"linear_attention_freq": [1, 0, 1, 0]},
     {"gdn": GDNConfig(linear_attention_freq=(1, 0, 1, 0))}),
    ("experimental_attention_variant", "gdn", HEAD, LLAMA, {"linear_attention_freq": 2},
     {"gdn": GDNConfig(linear_attention_freq=2)}),
    ("experimental_attention_variant", "dsa", HEAD, LLAMA, {}, REFUSED),
    ("linear_attention_freq", 4, V16, LLAMA, {}, IGNORED),  # only the experimental block spec reads it
    *[(name, value, V16, LLAMA, _GDN_ON, lambda before, name=name, value=value: {
        "gdn": dataclasses.replace(before.gdn, **{name: value})})
      for name, value in (("linear_attention_freq", 4), ("linear_conv_kernel_dim", 2), ("linear_key_head_dim", 64),
                          ("linear_value_head_dim", 32), ("linear_num_key_heads", 8),
                          ("linear_num_value_heads", 64))],
    ("is_hybrid_model", True, V16, LLAMA, {}, REFUSED),
    ("hybrid_override_pattern", "M*M*", V16, LLAMA, {}, REFUSED),
    ("hybrid_layer_pattern", "M*M*", HEAD, LLAMA, {}, REFUSED),
    ("spec", ["my_specs", "layer_spec"], V16, LLAMA, {}, REFUSED),
    ("yaml_cfg", "model.yaml", V16, LLAMA, {}, REFUSED),
    ("use_mup", True, HEAD, LLAMA, {}, REFUSED),
    ("enable_mhc_connections", True, HEAD, LLAMA, {}, REFUSED),
]

_ONLY_WITH = "changes the model only together with {} (refused)"
# Every other argument of both versions, by why it leaves the forward pass of the stored weights alone.
NO_FORWARD_EFFECT = {
    "how the model is split and communicates (the same function at any layout)": """
        tensor_model_parallel_size pipeline_model_parallel_comm_backend pipeline_model_parallel_size
        virtual_pipeline_model_parallel_size sequence_parallel context_parallel_size hierarchical_context_parallel_sizes
        max_seqlen_per_dp_cp_rank hybrid_context_parallel expert_model_parallel_size expert_tensor_parallel_size
        moe_extended_tp finalize_model_grads_func grad_scale_func no_sync_func grad_sync_func param_sync_func
        async_tensor_model_parallel_allreduce tp_comm_overlap tp_comm_bulk_wgrad tp_comm_bulk_dgrad tp_comm_overlap_ag
        tp_comm_overlap_rs tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_atomic_ag tp_comm_split_rs
        tp_comm_atomic_rs tp_comm_overlap_disable_qkv tp_comm_overlap_disable_fc1 tp_comm_bootstrap_backend
        overlap_moe_expert_parallel_comm delay_wgrad_compute ep_overlap_early_attn_memory_release pipeline_dtype
        variable_seq_lengths overlap_p2p_comm batch_p2p_comm batch_p2p_sync use_ring_exchange_p2p
        deallocate_pipeline_outputs defer_embedding_wgrad_compute wgrad_deferral_limit overlap_p2p_comm_warmup_flush
        microbatch_group_size_per_vp_stage num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage
        pipeline_model_parallel_layout account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split
        cp_comm_type symmetric_ar_type gradient_accumulation_fusion tensor_parallel_num_weight_shards
        gtp_weight_remat_size expert_tensor_parallel_num_weight_shards expert_gtp_weight_remat_size
        overlap_dispatch_backward_with_experts_wgrad high_priority_a2a_comm_stream""",
    "which kernel computes the same function": """
        attention_backend masked_softmax_fusion persist_layer_norm memory_efficient_layer_norm bias_dropout_fusion
        apply_rope_fusion fused_single_qkv_rope bias_swiglu_fusion cross_entropy_loss_fusion cross_entropy_fusion_impl
        transformer_impl use_flash_attn disable_parameter_transpose_cache flash_attention_version
        fused_residual_rmsnorm use_transformer_engine_op_fuser use_grouped_gemm_for_dense_mlp""",
    "precision of the same function (dtypes, fp32 softmax and residuals, FP8/FP4, quantisation, determinism): "
    "the run's choice, not the checkpoint's model": """
        params_dtype deterministic_mode enable_autocast autocast_dtype fp32_residual_connection
        apply_query_key_layer_scaling attention_softmax_in_fp32 disable_bf16_reduced_precision_matmul fp8 fp8_recipe
        fp8_param fp8_quantizer_factory fp8_margin fp8_interval fp8_amax_history_len fp8_amax_compute_algo fp8_wgrad
        fp8_dot_product_attention fp8_multi_head_attention tp_only_amax_red first_last_layers_bf16
        num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 use_kitchen use_kitchen_attention
        kitchen_attention_backend fp4 fp4_recipe fp4_param fp4_quantizer_factory quant_recipe batch_invariant_mode
        activation_func_fp8_input_store fp8_output_proj batch_invariant_backend logit_dtype""",
    "memory: recomputation, offloading, CUDA graphs": """
        num_microbatches_with_partial_activation_checkpoints cpu_offloading cpu_offloading_num_layers
        _cpu_offloading_context cpu_offloading_activations cpu_offloading_weights cpu_offloading_double_buffering
        recompute_granularity recompute_method recompute_num_layers distribute_saved_activations recompute_modules
        enable_cuda_graph cuda_graph_use_single_mempool cuda_graph_retain_backward_graph cuda_graph_warmup_steps
        external_cuda_graph cuda_graph_impl cuda_graph_scope clone_scatter_output_in_embedding
        fine_grained_activation_offloading offload_modules min_offloaded_tensor_size
        cpu_offloading_retain_pinned_cpu_buffers cuda_graph_modules mlp_chunks_for_training
        delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks activation_offload_fraction
        fine_grained_offloading_max_inflight_offloads gtp_remat_opt_in_modules""",
    "training only: initialisation, losses, weight clipping": """
        perform_initialization use_cpu_initialization init_method output_layer_init_method embedding_init_method
        embedding_init_method_std init_model_with_meta_device init_method_xavier_uniform calculate_per_token_loss
        qk_clip qk_clip_alpha qk_clip_threshold fp16_lm_cross_entropy use_te_rng_tracker""",
    "logging, timing and testing": "timers barrier_with_L1_time config_logger_dir log_max_attention_logit test_mode",
    "Megatron's inference engine": """
        flash_decode inference_rng_tracker inference_sampling_seed use_inference_optimized_layers
        inference_fuse_tp_communication mlp_chunks_for_prefill nccl_all_reduce_for_prefill
        inference_disable_triton_nvls_kernels inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels
        inference_moe_token_dispatcher_type inference_cuda_graph_scope""",
    "not arguments: Megatron derives them (gated_linear_unit and activation_func from swiglu, squared_relu, "
    "quick_geglu; bias_activation_fusion from bias_gelu_fusion / bias_swiglu_fusion; num_moe_experts from "
    "num_experts) or has no flag (softmax_scale, callables)": """
        gated_linear_unit activation_func bias_activation_fusion num_moe_experts softmax_scale
        experimental_attention_variant_loss_scale_func""",
    _ONLY_WITH.format("num_experts"): "moe_* use_fused_weighted_squared_relu use_grouped_gemm_for_shared_expert",
    "where the MTP block runs (its own pipeline stage) and whether its heads pass gradients back: not "
    "what it computes": "mtp_standalone mtp_detach_heads mtp_grad_scale_func",
    _ONLY_WITH.format("experimental_attention_variant dsa"): "dsa_*",
    _ONLY_WITH.format("is_hybrid_model / hybrid_override_pattern"): """
        mamba_* gdp_* use_mamba_mem_eff_path hybrid_attention_ratio hybrid_mlp_ratio""",
    "MLA's inference cache of latents and its fused down projection (the same function)":
        "cache_mla_latents mla_down_proj_fusion",
    _ONLY_WITH.format("use_mup"): "mup_*",
    _ONLY_WITH.format("enable_mhc_connections"): "mhc_*",
    _ONLY_WITH.format("window_size"): "window_attn_skip_freq",
    _ONLY_WITH.format("heterogeneous_layers_config_path"):
        "heterogeneous_block_specs hetereogenous_dist_checkpoint heterogeneous_layers_config_encoded_json",
    _ONLY_WITH.format("position_embedding_type yarn, mrope or relative") + "; Megatron's MLA keeps its own "
    "YaRN defaults (MLATransformerConfig), whatever these say":
        "yarn_* mrope_section relative_attention_num_buckets relative_attention_max_distance",
    "other models' (T5 encoder-decoder, BERT)": "encoder_num_layers decoder_num_layers bert_binary_head",
    "the deprecated --use-mcore-models (Megatron-Core is the default) and the switch for experimental "
    "features, themselves listed": "deprecated_use_mcore_models enable_experimental",
    "the tokenizer's files and ids, not the model (the vocabulary size is in CASES)":
        "legacy_tokenizer null_tokenizer_eod_id null_tokenizer_pad_id",
    "read from the checkpoint's tensors (the embedding's rows), not from its args": "padded_vocab_size",
    "the training data: sequence length and masking (max_position_embeddings bounds the model)":
        "seq_length dataloader_inter_document_masking",
}


def _classified(name: str) -> bool:
    if name in {case[0] for case in CASES}:
        return True
    for names in NO_FORWARD_EFFECT.values():
        for pattern in names.split():
            if name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])):
                return True
    return False


def _args(version, family, needs):
    args = megatron_lm_args(version, family)
    for name, value in needs.items():
        if value is ...:
            delattr(args, name)
        else:
            setattr(args, name, value)
    return args


def _config(args):
    return config_from_megatron_args(args, vocab_size_of(args, args.padded_vocab_size), "ckpt/common.pt")


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}={c[1]}@{c[2]}" for c in CASES])
def test_every_forward_argument_is_mapped_refused_or_ignored_as_megatron_ignores_it(case):
    """Megatron's behaviour: the module docstring's sources."""
    name, value, version, family, needs, expected = case
    base = _args(version, family, needs)
    changed = _args(version, family, needs)
    setattr(changed, name, value)
    if expected == REFUSED:
        with pytest.raises(ConversionError) as refused:
            _config(changed)
        message = str(refused.value)
        assert f"{name}=" in message and message.count("ckpt/common.pt") == 1 and "\n" not in message
        return
    before, after = _config(base), _config(changed)
    if callable(expected):
        expected = expected(before)
    if expected == IGNORED:
        assert after == before, f"{name}={value!r}: Megatron's model does not use it, megalite's must not either"
        notes = megatron_args_notes(changed)
        if name in ("rotary_seq_len_interpolation_factor", "rope_scaling_factor"):
            assert any(note.startswith(f"{name}={value}") for note in notes), notes
        return
    assert after == dataclasses.replace(before, **expected), f"{name}={value!r}"
    assert after != before, f"{name}={value!r} is dropped"


def _argument_names(version: str) -> set[str]:
    return set(vars(megatron_lm_args(version)))


@pytest.mark.parametrize("version", [V16, HEAD])
def test_every_argument_of_megatron_lm_is_classified(version):
    """Each argument Megatron-LM stores (every TransformerConfig field of the installed
    megatron-core that is an argument, HEAD's, and the other model groups) is either in CASES
    or in NO_FORWARD_EFFECT with why: a new Megatron argument fails here until classified."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = _argument_names(version) - {"consumed_train_samples", "consumed_valid_samples", "micro_batch_size",
                                        "global_batch_size", "lr", "seed", "iteration", "ckpt_format"}
    names |= {f.name for f in dataclasses.fields(TransformerConfig)} | set(HEAD_CONFIG_FIELDS)
    names |= set(OTHER_ARGUMENTS) | set(HEAD_ARGUMENTS)
    assert sorted(n for n in names if not _classified(n)) == []


def test_a_new_argument_would_fail_the_classification():
    assert not _classified("some_new_attention_switch") and _classified("moe_router_topk") and _classified("rotary_base")


def test_default_args_of_every_version_read_as_the_family():
    """Megatron's defaults for every argument (MLA's kv_lora_rank=32, softmax_type='vanilla', ...)
    refuse nothing; the old names read as the new ones."""
    configs = {v: _config(megatron_lm_args(v, LLAMA)) for v in (V16, HEAD, V15, V7)}
    assert len({repr(c) for c in configs.values()}) == 1
    llama = configs[V16]
    assert (llama.normalization, llama.activation, llama.num_query_groups, llama.vocab_size) == ("RMSNorm", "swiglu", 2, 90)
    gpt2 = _config(megatron_lm_args(V16, GPT2))
    assert (gpt2.activation, gpt2.add_bias_linear, gpt2.position_embedding_type) == ("gelu", True, "learned_absolute")
