"""Options for the model shape, parallel layout, recompute and precision.

Names and defaults are Megatron-LM's; each field's metadata holds its help text (see
field.arg). The groups are combined into one `Arguments` in arguments.py.
"""

from dataclasses import dataclass

from megalite.config.field import MEGALITE, arg
from megalite.model.config import RECOMPUTE_MODULES

PIPELINE_SCHEDULES = ("none", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


@dataclass
class ParallelArgs:
    """Parallelism and distributed runtime."""

    tensor_model_parallel_size: int = arg(1, "Tensor-parallel size t.")
    pipeline_model_parallel_size: int = arg(1, "Pipeline-parallel size p.")
    num_layers_per_virtual_pipeline_stage: int | None = arg(
        None, "Layers per virtual pipeline stage (interleaved 1F1B); the number of virtual "
        "stages per rank is num_layers / (p x this).")
    num_virtual_stages_per_pipeline_rank: int | None = arg(
        None, "Virtual pipeline stages (model chunks) per pipeline rank (interleaved 1F1B).")
    decoder_first_pipeline_num_layers: int | None = arg(
        None, "Layers on the first pipeline stage when they differ from the even split.")
    decoder_last_pipeline_num_layers: int | None = arg(
        None, "Layers on the last pipeline stage when they differ from the even split.")
    pipeline_model_parallel_layout: str | None = arg(
        None, "Megatron's layer layout string, e.g. \"Et*3|(tt|)*6mL\": E embedding, t decoder layer, m MTP "
        "layer, L loss; '|' ends a stage, stage i is pipeline rank i % p and virtual stage i // p; \"x*n\" and "
        "\"(...)*n\" repeat. Sets the virtual stages (stages / p); E must be on the first virtual stage, L and "
        "m on the last.")
    virtual_stages_from_layout: bool = arg(
        False, "--num-virtual-stages-per-pipeline-rank was filled from --pipeline-model-parallel-layout.", cli=False)
    pipeline_schedule: str | None = arg(
        None, "Pipeline schedule. Default: none at p=1, 1f1b at p>1, interleaved_1f1b with "
        "virtual stages.", choices=PIPELINE_SCHEDULES, origin=MEGALITE)
    sequence_parallel: bool = arg(
        False, "Sequence parallelism: split norms, dropouts and residuals along the sequence "
        "over the tensor-parallel group (at t = 1 it has no effect: the run goes on without it and says so).")
    use_distributed_optimizer: bool = arg(
        False, "Shard the optimizer state and fp32 main parameters over the data-parallel group.")
    overlap_grad_reduce: bool = arg(False, "Overlap the gradient reduction with the backward pass.")
    overlap_param_gather: bool = arg(
        False, "Overlap the distributed optimizer's parameter all-gather with the forward pass.")
    ddp_bucket_size: int | None = arg(None, "Gradient bucket size in elements (default: automatic).")
    use_torch_fsdp2: bool = arg(False, "Shard parameters with PyTorch FSDP2 (ZeRO-3).")
    optimizer_cpu_offload: bool = arg(False, "Keep optimizer state and main parameters on the CPU.")
    distributed_backend: str | None = arg(
        None, "torch.distributed backend. Megatron's default is nccl; megalite's None means "
        "nccl with CUDA, gloo without.", choices=("nccl", "gloo"))
    distributed_timeout_minutes: float = arg(
        10, "Timeout of collective operations: a rank whose peer died exits after this long.")


@dataclass
class ModelArgs:
    """Transformer shape and behaviour."""

    num_layers: int | None = arg(None, "Number of transformer layers L.")
    hidden_size: int | None = arg(None, "Hidden size h.")
    ffn_hidden_size: int | None = arg(
        None, "MLP inner size f (default 4h; with --swiglu Megatron's int(8h/3 / 64) x 64).")
    num_attention_heads: int | None = arg(None, "Attention heads a.")
    group_query_attention: bool = arg(False, "Grouped-query attention (needs --num-query-groups).")
    num_query_groups: int | None = arg(None, "Key/value heads with --group-query-attention.")
    kv_channels: int | None = arg(None, "Width of one attention head (default h / a).")
    seq_length: int | None = arg(None, "Sequence length s of a training sample.")
    max_position_embeddings: int | None = arg(
        None, "Positions covered by the position table / rotary cache (default: --seq-length).")
    position_embedding_type: str = arg(
        "learned_absolute", "Position embedding.",
        choices=("learned_absolute", "rope", "mrope", "relative", "none"),
        unsupported=("mrope", "relative"))
    rotary_base: float = arg(10000.0, "RoPE base theta.")
    rotary_percent: float = arg(1.0, "Fraction of each head's channels that RoPE rotates.")
    swiglu: bool = arg(False, "SwiGLU MLP (Llama) instead of GeLU.")
    openai_gelu: bool = arg(
        False, "GPT-2's tanh approximation of GeLU (a GeLU MLP with biases computes it anyway unless "
        "--no-bias-gelu-fusion; this flag keeps it with that flag or without biases).")
    normalization: str = arg("LayerNorm", "Normalisation layer.", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = arg(1e-5, "Epsilon of every norm.")
    untie_embeddings_and_output_weights: bool = arg(
        False, "Separate output layer instead of reusing the input embedding.")
    disable_bias_linear: bool = arg(False, "No biases in linear layers (Llama).")
    add_qkv_bias: bool = arg(False, "Bias on the QKV projection even with --disable-bias-linear.")
    make_vocab_size_divisible_by: int = arg(
        128, "Pad the vocabulary to a multiple of this times t.")
    init_method_std: float = arg(
        0.02, "Std of the normal initialisation (output projections: std / sqrt(2L)).")
    attention_dropout: float = arg(0.1, "Dropout on attention probabilities.")
    hidden_dropout: float = arg(0.1, "Dropout on embeddings and after attention and MLP.")
    use_flash_attn: bool = arg(
        False, "FlashAttention: the flash_attn package's kernels on a CUDA run with the package installed; "
        "otherwise scaled_dot_product_attention serves it (its FLASH_ATTENTION kernel on CUDA, its own choice "
        "on CPU) and one start-up line says so (megalite/config/flash_attn.py).")
    flash_attn_served_by: str | None = arg(
        None, "Set by validate_args: who serves --use-flash-attn (flash_attn, sdpa_cuda or sdpa_cpu).", cli=False)
    fused_kernels: bool | None = arg(
        None, "Triton kernels for norms, activations, rotary and cross-entropy (default: on "
        "with CUDA).", negative_flag="--no-fused-kernels", origin=MEGALITE)
    torch_compile: bool = arg(False, "torch.compile the embedding, each transformer layer and the output "
                              "layer with its loss (GPTModel.compile_regions).",
                              origin=MEGALITE)


@dataclass
class RecomputeArgs:
    """Activation recomputation."""

    recompute_activations: bool = arg(
        False, "Selective recompute of core attention (same as --recompute-granularity selective).")
    recompute_granularity: str | None = arg(
        None, "full: recompute whole layers; selective: the --recompute-modules (default core attention).",
        choices=("full", "selective"))
    recompute_method: str | None = arg(
        None, "With full recompute: uniform (groups of --recompute-num-layers) or block (the "
        "first --recompute-num-layers of each stage). Default uniform.", choices=("uniform", "block"))
    recompute_num_layers: int | None = arg(
        None, "With full recompute: layers per group (uniform) or per stage (block); default all.")
    recompute_modules: list[str] | None = arg(
        None, "With selective recompute, what is recomputed (default core_attn): core_attn, mlp (dense MLPs), moe "
        "(whole MoE layers), shared_experts, layernorm, moe_act and mla_up_proj (multi-latent attention's up "
        "projections and RoPE: their outputs q, k, v recomputed for the attention's backward instead of kept); "
        "Megatron's gated-delta-net and hyper-connection modules are refused.")


MEGATRON_RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts",
                              "gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc")


def check_recompute_modules(args, fail) -> None:
    """Megatron's checks of --recompute-modules (TransformerConfig.__post_init__, selective
    recompute only), then the modules megalite's layers do not have."""
    modules = args.recompute_modules
    if modules is None or args.recompute_granularity != "selective":
        return  # without selective recompute Megatron ignores them (a start-up line says so)
    if unknown := [m for m in modules if m not in MEGATRON_RECOMPUTE_MODULES]:
        fail(f"--recompute-modules {unknown[0]}: unknown module (Megatron's: {', '.join(MEGATRON_RECOMPUTE_MODULES)})")
    if "moe_act" in modules and not args.moe_grouped_gemm:
        fail("--recompute-modules moe_act needs --moe-grouped-gemm (as in Megatron)")
    if "mla_up_proj" in modules and not args.multi_latent_attention:
        fail("--recompute-modules mla_up_proj needs --multi-latent-attention (as in Megatron)")
    discarding = [m for m in modules if m in ("layernorm", "moe_act")]
    if discarding and args.torch_compile:
        fail(f"--recompute-modules {discarding[0]} with --torch-compile: its output-discarding hooks "
             "(saved-tensor hooks) run eagerly only; give it without --torch-compile")
    if missing := [m for m in modules if m not in RECOMPUTE_MODULES]:
        fail(f"--recompute-modules {missing[0]}: not implemented in megalite (it recomputes "
             f"{', '.join(RECOMPUTE_MODULES)})")


def recompute_modules_of(args) -> tuple:
    """The GPTConfig's recompute_modules: Megatron's default core_attn when none are given."""
    return ("core_attn",) if args.recompute_modules is None else tuple(args.recompute_modules)


def recompute_notes(args) -> list[str]:
    if args.recompute_modules is not None and args.recompute_granularity != "selective":
        return [f"--recompute-modules {' '.join(args.recompute_modules)}: no effect without --recompute-granularity "
                "selective (as in Megatron)"]
    return []


@dataclass
class PrecisionArgs:
    """Mixed precision and loss scaling."""

    bf16: bool = arg(False, "bf16 parameters and activations with fp32 main weights and gradients.")
    fp16: bool = arg(False, "fp16 parameters and activations with loss scaling.")
    loss_scale: float | None = arg(None, "Static loss scale with --fp16 (default: dynamic).")
    initial_loss_scale: float = arg(2.0**32, "Initial dynamic loss scale.")
    min_loss_scale: float = arg(1.0, "Smallest dynamic loss scale.")
    loss_scale_window: float = arg(1000, "Iterations without overflow before the scale grows.")
    hysteresis: int = arg(2, "Overflows tolerated before the dynamic loss scale shrinks.")
    attention_softmax_in_fp32: bool = arg(
        False, "With --attention-backend unfused/local in fp16/bf16: attention scores from fp32 q, k and fp32 "
        "probabilities kept for backward (default: 16-bit scores and probabilities, the softmax computed in fp32, "
        "as Megatron's fused softmax kernel).")
    accumulate_allreduce_grads_in_fp32: bool = arg(
        False, "Accumulate and all-reduce gradients in fp32.")
