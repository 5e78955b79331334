"""Megatron's model-implementation, fusion, model-variant and tokenizer flags (the Megatron
drop-in's model families). The FP8 family: megalite/config/fp8.py.

Each flag either changes what megalite builds (model fields through `megatron_model_fields`,
kernel choices through `unfused_kernels`) or, where megalite reaches Megatron's result another
way, is accepted and explained in one start-up line (`start_up_notes`). Nothing is accepted
and ignored silently.
"""

from dataclasses import dataclass

from megalite.model.attention_backends import how_served
from megalite.model.config import ATTENTION_BACKENDS
from megalite.config.field import arg
from megalite.config.flash_attn import flash_attn_note, served_backend

@dataclass
class MegatronModelArgs:
    """Implementation choices, fusions, model variants and tokenizer details (Megatron names)."""

    use_mcore_models: bool = arg(
        False, "Megatron-Core's GPTModel (Megatron's only GPT since the legacy model was removed); "
        "megalite has one GPT implementation, laid out as Megatron-Core's.")
    transformer_impl: str = arg(
        "local", "Transformer implementation. megalite uses its own layers either way: with "
        "transformer_engine, its own fused kernels and scaled_dot_product_attention serve what "
        "Transformer Engine would.", choices=("local", "transformer_engine"))
    attention_backend: str = arg(
        "auto", "Attention: auto (scaled_dot_product_attention's fastest kernel for the card: "
        "measured, else cuDNN first on Hopper and Blackwell; SDPA's own choice on CPU), flash (its "
        "flash kernel), fused (its cuDNN kernel, else memory-efficient), unfused or local "
        "(megalite's explicit math attention).", choices=ATTENTION_BACKENDS)
    gradient_accumulation_fusion: bool | None = arg(
        None, "Accumulate each linear layer's weight gradient into its fp32 main_grad inside the "
        "weight-gradient GEMM (Megatron's default, its apex / TE kernel; megalite's is torch's "
        "addmm with an fp32 result), instead of forming the weight gradient and adding it. Needs "
        "main_grad buffers (megalite's DDP or distributed optimizer): the default does not apply "
        "under FSDP2, and an explicit --gradient-accumulation-fusion is refused there.",
        negative_flag="--no-gradient-accumulation-fusion")
    no_masked_softmax_fusion: bool = arg(
        False, "Megatron: no fused scale-mask-softmax kernel. megalite has none: the softmax is "
        "inside scaled_dot_product_attention or its explicit math path.")
    no_bias_gelu_fusion: bool = arg(
        False, "Megatron-Core's unfused bias + GeLU: exact (erf) GeLU in plain torch. Without it a GeLU MLP "
        "with biases computes the fused kernel's tanh approximation, as Megatron-Core's bias-GeLU fusion "
        "does (without biases GeLU is exact either way; --openai-gelu is tanh either way).")
    no_bias_swiglu_fusion: bool = arg(False, "SwiGLU in plain torch instead of megalite's fused kernel.")
    bias_dropout_fusion: bool | None = arg(
        None, "The bias add, dropout and residual add after attention and after the MLP as one kernel "
        "(Megatron's default; megalite's Triton kernel on CUDA, its mask drawn by the kernel), "
        "instead of the unfused torch ops (their dropout mask is F.dropout's).",
        negative_flag="--no-bias-dropout-fusion")
    no_rope_fusion: bool = arg(False, "RoPE in plain torch instead of megalite's fused kernel.")
    no_persist_layer_norm: bool = arg(
        False, "Megatron: not apex's persistent LayerNorm kernel. megalite's norm kernels have "
        "no persistent variant.")
    cross_entropy_loss_fusion: bool = arg(
        False, "The fused (vocab-parallel, never materialising fp32 logits) cross-entropy kernel; "
        "without it, the plain-torch cross-entropy (unless --fused-kernels turns every kernel on).")
    cross_entropy_fusion_impl: str = arg(
        "native", "Kernel of --cross-entropy-loss-fusion: native (megalite's Triton kernel) or te "
        "(Transformer Engine's; megalite serves it with its own).", choices=("native", "te"))
    apply_layernorm_1p: bool = arg(
        False, "Zero-centred norm weights: every norm multiplies by (1 + weight), weights start at 0.")
    qk_layernorm: bool = arg(False, "Normalise each query and key head (before RoPE).")
    apply_query_key_layer_scaling: bool = arg(
        False, "Megatron: scale q k^T by 1/layer-number and the softmax input back by it, for fp16 "
        "range; the result is unchanged. megalite's softmax runs in fp32, where it is an identity.")
    squared_relu: bool = arg(False, "Squared ReLU MLP activation instead of GeLU.")
    rotary_interleaved: bool = arg(False, "RoPE on adjacent channel pairs instead of the two halves.")
    use_rotary_position_embeddings: bool = arg(
        False, "Deprecated form of --position-embedding-type rope.")
    rotary_seq_len_interpolation_factor: float | None = arg(
        None, "Divide positions by this before RoPE (linear position interpolation; Megatron takes "
        "integers, megalite any positive number, as Hugging Face's linear rope scaling).")
    use_rope_scaling: bool = arg(False, "Llama 3.1 RoPE frequency scaling.")
    rope_scaling_factor: float = arg(8.0, "Factor of --use-rope-scaling.")
    no_position_embedding: bool = arg(
        False, "Deprecated: no learned position table; Megatron allows it only with "
        "--position-embedding-type rope (use --position-embedding-type none for none at all).")
    vocab_extra_ids: int = arg(
        0, "Extra tokens <extra_id_0>... appended to a SentencePieceTokenizer's vocabulary.")
    no_use_tokenizer_model_from_checkpoint_args: bool = arg(
        False, "With --use-checkpoint-args: keep this command line's --tokenizer-type and "
        "--tokenizer-model instead of the checkpoint's.")
    tiktoken_pattern: str | None = arg(
        None, "TikTokenizer pre-tokenisation pattern (megalite's default v2).", choices=("v1", "v2"))
    tiktoken_num_special_tokens: int = arg(1000, "Special-token ids before a TikTokenizer's ranks.")
    tokenizer_special_tokens: list[str] | None = arg(
        None, "TikTokenizer special tokens (must include <unk> <s> </s>).")
    tokenizer_type_from_files: bool = arg(
        False, "Set by validate_args: --tokenizer-type was absent and GPT2BPETokenizer was taken "
        "from --vocab-file and --merge-file.", cli=False)


def check_megatron_model_args(args, fail) -> None:
    """Refuse contradictions, each in one line naming the flag. Fills one
    unset value: without --tokenizer-type, --vocab-file with --merge-file (Megatron's gpt3
    example gives only these) mean GPT2BPETokenizer, the only type those two files describe."""
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        args.tokenizer_type, args.tokenizer_type_from_files = "GPT2BPETokenizer", True
    if args.squared_relu and (args.swiglu or args.openai_gelu):
        fail(f"--squared-relu and {'--swiglu' if args.swiglu else '--openai-gelu'} contradict each other "
             "(give one activation)")
    if args.use_rotary_position_embeddings:
        if args.position_embedding_type not in ("learned_absolute", "rope"):
            fail(f"--use-rotary-position-embeddings and --position-embedding-type "
                 f"{args.position_embedding_type} contradict each other")
        args.position_embedding_type = "rope"
    rope_only = [flag for flag, on in (("--rotary-interleaved", args.rotary_interleaved),
                                       ("--use-rope-scaling", args.use_rope_scaling),
                                       ("--rotary-seq-len-interpolation-factor",
                                        args.rotary_seq_len_interpolation_factor is not None)) if on]
    if rope_only and args.position_embedding_type != "rope":
        fail(f"{rope_only[0]} needs --position-embedding-type rope (got {args.position_embedding_type})")
    if args.no_position_embedding and args.position_embedding_type != "rope":
        fail("--no-position-embedding is deprecated (Megatron refuses it without rope): use "
             "--position-embedding-type none (or rope)")
    factor = args.rotary_seq_len_interpolation_factor
    if factor is not None and factor <= 0:
        fail(f"--rotary-seq-len-interpolation-factor must be positive, got {factor}")
    if args.rope_scaling_factor <= 0:
        fail(f"--rope-scaling-factor must be positive, got {args.rope_scaling_factor}")
    if args.vocab_extra_ids < 0:
        fail(f"--vocab-extra-ids must not be negative, got {args.vocab_extra_ids}")
    if args.vocab_extra_ids and args.tokenizer_type != "SentencePieceTokenizer":
        fail(f"--vocab-extra-ids {args.vocab_extra_ids} applies only to --tokenizer-type "
             f"SentencePieceTokenizer (got {args.tokenizer_type}), as in Megatron")
    if args.tiktoken_num_special_tokens < 3:
        fail(f"--tiktoken-num-special-tokens must be at least 3 (<unk>, <s>, </s>), got "
             f"{args.tiktoken_num_special_tokens}")
    if args.attention_backend == "flash" and args.reset_attention_mask:
        fail("--attention-backend flash and --reset-attention-mask contradict each other (the flash "
             "kernel takes no attention mask)")


def mlp_activation(args) -> str:
    """GPTConfig.activation of these flags, as Megatron-Core's MLP computes it: a GeLU MLP with
    biases runs the bias-GeLU fusion (on unless --no-bias-gelu-fusion), which is the tanh
    approximation (megatron/core/fusions/fused_bias_gelu.py); Megatron turns the fusion off
    without biases (validate_args), leaving exact GeLU. --openai-gelu (the legacy model's flag)
    is tanh either way."""
    if args.swiglu or args.squared_relu:
        return "swiglu" if args.swiglu else "squared_relu"
    fused = not args.no_bias_gelu_fusion and not args.disable_bias_linear
    return "openai_gelu" if args.openai_gelu or fused else "gelu"


def unfused_kernels(args) -> tuple:
    """The ops that run their plain-torch reference because a flag turned their fusion off."""
    ops = [op for op, off in (("bias_gelu", args.no_bias_gelu_fusion), ("swiglu", args.no_bias_swiglu_fusion),
                              ("rotary", args.no_rope_fusion),
                              ("bias_dropout_add", args.bias_dropout_fusion is False)) if off]
    if not args.cross_entropy_loss_fusion and args.fused_kernels is not True:
        ops.append("cross_entropy")
    return tuple(ops)


def megatron_model_fields(args) -> dict:
    """The GPTConfig fields these flags set."""
    return dict(
        apply_layernorm_1p=args.apply_layernorm_1p, qk_layernorm=args.qk_layernorm,
        rotary_interleaved=args.rotary_interleaved,
        rotary_seq_len_interpolation_factor=(None if args.rotary_seq_len_interpolation_factor is None
                                             else float(args.rotary_seq_len_interpolation_factor)),
        use_rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        attention_backend=served_backend(args), unfused_kernels=unfused_kernels(args))


def tokenizer_options(args) -> dict:
    """build_tokenizer's keyword options from these flags."""
    options = {"vocab_extra_ids": args.vocab_extra_ids}
    if args.tokenizer_type == "TikTokenizer":
        options.update(tiktoken_pattern=args.tiktoken_pattern or "v2",
                       tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                       tiktoken_special_tokens=args.tokenizer_special_tokens)
    return options


def tokenizer_from_args(args, tokenizer_type: str | None = None):
    """The run's tokenizer from its flags (`tokenizer_type` in place of --tokenizer-type where
    that is unset)."""
    from megalite.data.tokenizers import build_tokenizer

    return build_tokenizer(args.tokenizer_type or tokenizer_type, tokenizer_model=args.tokenizer_model,
                           vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
                           **tokenizer_options(args))


def start_up_notes(args, device_type: str) -> list[str]:
    """One line per flag that megalite serves another way than Megatron (printed at start-up)."""
    notes = []
    if args.use_mcore_models:
        notes.append("--use-mcore-models: megalite's GPTModel is its only model, laid out as Megatron-Core's")
    if args.transformer_impl == "transformer_engine":
        notes.append("--transformer-impl transformer_engine: megalite's own fused kernels and "
                     "scaled_dot_product_attention, Transformer Engine not used")
    backend = how_served(args.attention_backend, device_type)
    if backend:
        notes.append(backend)
    notes += flash_attn_note(args)
    explained = (
        ("no_masked_softmax_fusion", "--no-masked-softmax-fusion: megalite has no masked-softmax kernel (the "
         "softmax is inside scaled_dot_product_attention or its explicit path)"),
        ("no_persist_layer_norm", "--no-persist-layer-norm: megalite's norm kernels have no persistent variant"),
        ("apply_query_key_layer_scaling", "--apply-query-key-layer-scaling: an identity in exact arithmetic "
         "that Megatron uses for fp16 range; megalite's attention softmax runs in fp32"),
        ("no_use_tokenizer_model_from_checkpoint_args", "--no-use-tokenizer-model-from-checkpoint-args: "
         "the tokenizer is this command line's (megalite never takes it from a checkpoint)"),
    )
    notes += [line for name, line in explained if getattr(args, name)]
    if args.tokenizer_type_from_files:
        notes.append("--tokenizer-type not given: GPT2BPETokenizer, from --vocab-file and --merge-file")
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te":
        notes.append("--cross-entropy-fusion-impl te: megalite's own fused cross-entropy kernel, "
                     "Transformer Engine not used")
    if args.no_position_embedding:
        notes.append("--no-position-embedding: rope models have no learned position table anyway")
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        notes.append(f"--tiktoken-pattern {args.tiktoken_pattern}: not used by --tokenizer-type "
                     f"{args.tokenizer_type} (only TikTokenizer has a pattern)")
    return notes
