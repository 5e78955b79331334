"""The `args` Namespace Megatron-LM stores with a checkpoint, built from Megatron-LM's sources
(not from megalite) for tests/checkpoint/test_megatron_checkpoint_args.py and the Megatron-Core
variants of tests/checkpoint/megatron_core_variants.py:

  core_v0.16.1  Megatron-LM 55ac7082517c3878ae653c07c09c534b8aed49f6, the release of the installed
                megatron-core 0.16.1: megatron/training/arguments.py (_add_network_size_args turns
                every TransformerConfig field into an argument but its exclude list, NOT_ARGUMENTS;
                _add_moe_args, _add_mla_args, _add_experimental_args, _add_training_args' fusion
                flags, _add_tokenizer_args: OTHER_ARGUMENTS).
  HEAD          Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22): the same groups
                and megatron/core/transformer/transformer_config.py, model_parallel_config.py
                (HEAD_CONFIG_FIELDS: the fields megatron-core 0.16.1 does not have).
"""

import argparse
import dataclasses

import torch

# core_v0.16.1 _add_network_size_args: TransformerConfig fields that are not arguments.
NOT_ARGUMENTS = (
    "timers", "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
    "_cpu_offloading_context", "init_method", "output_layer_init_method", "embedding_init_method", "activation_func",
    "pipeline_model_parallel_layout", "window_size", "window_attn_skip_freq", "no_rope_freq", "moe_layer_freq",
    "linear_attention_freq", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "cp_comm_type",
    "cuda_graph_scope", "virtual_pipeline_model_parallel_size", "params_dtype", "enable_autocast", "autocast_dtype",
    "num_microbatches_with_partial_activation_checkpoints", "tp_comm_overlap_disable_qkv",
    "tp_comm_overlap_disable_fc1", "pipeline_dtype", "variable_seq_lengths", "batch_p2p_comm", "batch_p2p_sync",
    "deallocate_pipeline_outputs", "cpu_offloading", "cpu_offloading_activations", "cpu_offloading_weights",
    "cpu_offloading_double_buffering", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    "softmax_scale", "gated_linear_unit", "bias_activation_fusion", "activation_func_fp8_input_store", "test_mode",
    "memory_efficient_layer_norm", "fused_single_qkv_rope", "fp8_dot_product_attention", "fp8_multi_head_attention",
    "tp_only_amax_red", "use_kitchen", "moe_token_dropping", "cuda_graph_use_single_mempool",
    "cuda_graph_retain_backward_graph", "disable_parameter_transpose_cache", "inference_sampling_seed",
    "use_inference_optimized_layers", "heterogeneous_block_specs", "hetereogenous_dist_checkpoint", "quant_recipe",
    "tp_comm_atomic_ag", "tp_comm_atomic_rs", "moe_router_topk_limited_devices", "inference_rng_tracker",
    "use_te_rng_tracker", "log_max_attention_logit", "barrier_with_L1_time", "num_moe_experts", "fp8_param",
    "gradient_accumulation_fusion", "overlap_p2p_comm", "attention_softmax_in_fp32", "masked_softmax_fusion",
    "persist_layer_norm", "bias_dropout_fusion", "apply_rope_fusion",
)
# HEAD adds these to the exclude list.
NOT_ARGUMENTS_HEAD = ("moe_grad_scale_func", "mtp_grad_scale_func", "experimental_attention_variant_loss_scale_func",
                      "cuda_graph_modules", "fp4_param", "mamba_training_ssm_states_dtype", "gtp_weight_remat_size",
                      "expert_gtp_weight_remat_size")

# core_v0.16.1 arguments outside TransformerConfig that shape a GPT model, with their defaults
# (network size, MoE, MLA, experimental attention, heterogeneous, experimental, fusion, model
# family, tokenizer groups). Where a TransformerConfig field has the same name, the argument wins.
OTHER_ARGUMENTS = dict(
    encoder_num_layers=None, decoder_num_layers=None, group_query_attention=False, window_size=None,
    window_attn_skip_freq=None, max_position_embeddings=None, position_embedding_type="learned_absolute",
    relative_attention_num_buckets=32, relative_attention_max_distance=128, use_rotary_position_embeddings=False,
    rotary_base=10000, rotary_percent=1.0, rotary_seq_len_interpolation_factor=None, use_rope_scaling=False,
    rope_scaling_factor=8.0, no_rope_freq=None, add_position_embedding=True, make_vocab_size_divisible_by=128,
    openai_gelu=False, squared_relu=False, swiglu=False, quick_geglu=False, onnx_safe=None, bert_binary_head=True,
    untie_embeddings_and_output_weights=False, init_method_xavier_uniform=False, fp16_lm_cross_entropy=False,
    num_experts=None, moe_layer_freq=1, moe_use_upcycling=False, moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=0.0, moe_upcycling_granularity=1, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128,
    qk_pos_emb_head_dim=64, v_head_dim=128, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
    cache_mla_latents=False, linear_attention_freq=None, heterogeneous_layers_config_path=None,
    heterogeneous_layers_config_encoded_json=None, enable_experimental=False, spec=None, hybrid_attention_ratio=0.0,
    hybrid_mlp_ratio=0.0, hybrid_override_pattern=None, yaml_cfg=None, masked_softmax_fusion=True,
    bias_gelu_fusion=True, bias_swiglu_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=True, rope_type=None,
    use_flash_attn=False, gradient_accumulation_fusion=True, deprecated_use_mcore_models=False,
    use_legacy_models=False, attention_softmax_in_fp32=False, vocab_size=None, padded_vocab_size=None,
    tokenizer_type=None, legacy_tokenizer=False, seq_length=None, params_dtype=torch.float32,
)
# HEAD: arguments added since core_v0.16.1 (the last two mark the ModelBuilder era, see
# megalite.checkpoint.megatron.args), and those it removed.
HEAD_ARGUMENTS = dict(
    yarn_original_max_position_embeddings=None, yarn_beta_fast=None, yarn_beta_slow=None,
    yarn_correction_range_round_to_int=True, mla_down_proj_fusion=False, hybrid_layer_pattern=None,
    logit_dtype=None, null_tokenizer_eod_id=None, null_tokenizer_pad_id=-1, dataloader_inter_document_masking=False,
)
HEAD_REMOVED = ("use_legacy_models", "legacy_tokenizer", "hybrid_attention_ratio", "hybrid_mlp_ratio",
                "moe_use_legacy_grouped_gemm", "moe_extended_tp", "async_tensor_model_parallel_allreduce")
HEAD_CONFIG_FIELDS = {  # HEAD's TransformerConfig / ModelParallelConfig fields megatron-core 0.16.1 lacks
    "tensor_parallel_num_weight_shards": None, "gtp_weight_remat_size": 1,
    "expert_tensor_parallel_num_weight_shards": None, "expert_gtp_weight_remat_size": 1,
    "moe_grad_scale_func": None, "mtp_grad_scale_func": None,
    "overlap_dispatch_backward_with_experts_wgrad": False, "cpu_offloading_retain_pinned_cpu_buffers": False,
    "mtp_use_repeated_layer": False, "mtp_detach_heads": False, "mtp_hsm": False,
    "mtp_hybrid_override_pattern": None, "flash_attention_version": None,
    "experimental_attention_variant_loss_scale_func": None, "dsa_indexer_topk_freq": 1,
    "dsa_indexer_skip_topk_offset": 0, "dsa_kernel_backend": "none", "dsa_indexer_rope_interleaved": False,
    "dsa_indexer_rotate_activation": True, "dsa_indexer_scoring_relu": True, "dsa_indexer_k_norm_epsilon": None,
    "dsa_indexer_k_norm_fp32": False, "use_mup": False, "mup_width_mult": 1.0, "mup_base_hidden_size": None,
    "mup_embedding_mult": 1.0, "mup_output_mult": 1.0, "mup_base_head_dim": None, "mup_attn_scale_power": 1.0,
    "fused_residual_rmsnorm": False, "use_transformer_engine_op_fuser": False, "fp8_output_proj": False,
    "high_priority_a2a_comm_stream": False, "use_grouped_gemm_for_shared_expert": False,
    "moe_shared_expert_glu_interleave_size": None, "moe_router_quantile_balancing_ema": 0.0,
    "moe_router_force_biased": None, "use_grouped_gemm_for_dense_mlp": False, "moe_use_grouped_tensor": False,
    "moe_single_grouped_weight": False, "moe_single_grouped_bias": False,
    "moe_permute_fusion_into_hybridep": False, "moe_hybridep_pad_uneven_dispatch_inputs": False,
    "moe_pad_experts_for_cuda_graph_inference": False, "gtp_remat_opt_in_modules": [],
    "moe_flex_dispatcher_num_sms": None, "moe_hybridep_num_blocks_permute": None,
    "moe_hybridep_num_blocks_unpermute": None, "moe_hybridep_num_sms_preprocessing": 108,
    "moe_ncclep_zero_copy": False, "moe_dispatch_fwd_dtype": "bf16", "moe_combine_bwd_dtype": "bf16",
    "moe_mlp_glu_interleave_size": None, "moe_expert_rank_capacity_factor": None, "cuda_graph_modules": "full",
    "inference_cuda_graph_scope": None, "enable_mhc_connections": False, "mhc_num_residual_streams": 4,
    "mhc_sinkhorn_iterations": 20, "mhc_init_gating_factor": 0.01, "mhc_recompute_layer_num": None,
    "batch_invariant_backend": "te_native", "nccl_all_reduce_for_prefill": False,
    "inference_disable_triton_nvls_kernels": False, "inference_grouped_gemm_backend": "vllm",
    "inference_moe_disable_fused_quant_kernels": False, "inference_moe_token_dispatcher_type": "nvls",
    "gdp_num_householder": 3, "mamba_training_ssm_states_dtype": None, "gdp_cutedsl_kernel": False,
    "gdp_num_chunk_states_to_recompute": 2, "mlp_chunks_for_training": 1, "delay_offload_until_cuda_graph": False,
    "delta_offload_bytes_across_pp_ranks": 0, "activation_offload_fraction": 1.0, "moe_paged_stash": False,
    "moe_paged_stash_page_size": 64, "moe_paged_stash_buffer_size_factor_cuda": 1.1,
    "moe_paged_stash_buffer_size_factor_cpu": 0.0, "fine_grained_offloading_max_inflight_offloads": None,
}

# The model values of the two families the tests use (after Megatron's validate_args).
FAMILY_ARGS = {
    "llama": dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, group_query_attention=True,
                  ffn_hidden_size=48, kv_channels=8, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  add_qkv_bias=False, bias_gelu_fusion=False, position_embedding_type="rope",
                  untie_embeddings_and_output_weights=True),
    "gpt2": dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=4, group_query_attention=False,
                 ffn_hidden_size=64, kv_channels=8, normalization="LayerNorm", swiglu=False, add_bias_linear=True,
                 add_qkv_bias=True, bias_gelu_fusion=False, bias_swiglu_fusion=False,
                 position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False),
}


def megatron_lm_args(version: str = "0.16.1", family: str = "llama", **overrides) -> argparse.Namespace:
    """The args a Megatron-LM of `version` stores for a `family` model (TP=2, NullTokenizer with
    90 tokens, 96 embedding rows): "0.16.1", "head", "0.15" (norm_epsilon and apply_layernorm_1p
    under their pre-0.16 names) or "0.7" (also use_mcore_models, before use_legacy_models)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = {}
    for f in dataclasses.fields(TransformerConfig):
        if f.name not in NOT_ARGUMENTS:
            values[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    values.update(OTHER_ARGUMENTS)
    if version == "head":
        values.update({k: v for k, v in HEAD_CONFIG_FIELDS.items() if k not in NOT_ARGUMENTS_HEAD}, **HEAD_ARGUMENTS)
        for name in HEAD_REMOVED:
            values.pop(name, None)
    values.update(FAMILY_ARGS[family], seq_length=12, max_position_embeddings=64, tensor_model_parallel_size=2,
                  make_vocab_size_divisible_by=8, tokenizer_type="NullTokenizer", padded_vocab_size=96,
                  vocab_size=90 if version == "head" else 89, layernorm_epsilon=1e-5, hidden_dropout=0.0,
                  attention_dropout=0.0, init_method_std=0.02, ckpt_format="torch_dist", iteration=7,
                  consumed_train_samples=56, consumed_valid_samples=0, micro_batch_size=2, global_batch_size=8,
                  lr=1e-3, seed=1234)
    if version in ("0.15", "0.7"):
        values["norm_epsilon"] = values.pop("layernorm_epsilon")
        values["apply_layernorm_1p"] = values.pop("layernorm_zero_centered_gamma")
    if version == "0.7":
        del values["use_legacy_models"], values["deprecated_use_mcore_models"]
        values["use_mcore_models"] = True
    values.update(overrides)
    return argparse.Namespace(**values)
