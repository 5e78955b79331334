"""GPT model configuration covering the GPT-2 and Llama families."""

import math
from dataclasses import dataclass, field, fields, replace

from megalite.model.gdn_config import GDNConfig
from megalite.model.mla_config import MLAConfig
from megalite.model.moe_config import MoEConfig
from megalite.parallel.context import CP_COMM_TYPES
from megalite.parallel.state import ParallelLayout

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
UNFUSABLE_OPS = ("bias_gelu", "swiglu", "rotary", "cross_entropy", "bias_dropout_add")

RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts", "layernorm", "moe_act", "mla_up_proj")
"""The --recompute-modules megalite's layers recompute (Megatron's names)."""

@dataclass
class GPTConfig:
    """Shape and behaviour of a GPT model. Field names follow Megatron's flags."""

    num_layers: int
    """Number of transformer layers (--num-layers)."""
    hidden_size: int
    """Model width h (--hidden-size)."""
    num_attention_heads: int
    """Query heads (--num-attention-heads)."""
    vocab_size: int
    """True vocabulary size of the tokenizer; the embedding is padded beyond it."""
    max_position_embeddings: int = 1024
    """Longest sequence the learned position table or rotary cache covers."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention (--num-query-groups); None means MHA."""
    kv_channels: int | None = None
    """Width of one attention head (--kv-channels); None means hidden_size // heads."""
    ffn_hidden_size: int | None = None
    """MLP inner width (--ffn-hidden-size); None means 4 * hidden_size."""
    position_embedding_type: str = "learned_absolute"
    """'learned_absolute' (GPT-2), 'rope' (Llama) or 'none' (no position information, NoPE)."""
    rotary_base: float = 10000.0
    """RoPE theta (--rotary-base)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that are rotated (--rotary-percent)."""
    rotary_interleaved: bool = False
    """RoPE rotates adjacent channel pairs (0,1), (2,3), ... instead of the two halves
    (--rotary-interleaved)."""
    rotary_seq_len_interpolation_factor: float | None = None
    """Positions are divided by this before RoPE (linear position interpolation,
    --rotary-seq-len-interpolation-factor)."""
    use_rope_scaling: bool = False
    """Llama 3.1 RoPE frequency scaling (--use-rope-scaling): low frequencies divided by
    rope_scaling_factor, high ones kept, a smooth blend between (low/high frequency factors 1
    and 4, original context 8192, as Megatron and Llama 3.1 fix them)."""
    rope_scaling_factor: float = 8.0
    """Factor of the Llama 3.1 RoPE scaling (--rope-scaling-factor)."""
    normalization: str = "LayerNorm"
    """'LayerNorm' or 'RMSNorm' (--normalization)."""
    norm_epsilon: float = 1e-5
    """Epsilon of every norm (--norm-epsilon)."""
    apply_layernorm_1p: bool = False
    """Zero-centred norm weights: every norm multiplies by (1 + weight), weights start at 0
    (--apply-layernorm-1p)."""
    qk_layernorm: bool = False
    """A norm of the `normalization` kind over each query and key head before RoPE
    (--qk-layernorm; Qwen3 / OLMo2 style)."""
    activation: str = "gelu"
    """'gelu' (exact erf), 'openai_gelu' (tanh approximation, GPT-2), 'swiglu' or
    'squared_relu' (relu(x)^2, --squared-relu)."""
    add_bias_linear: bool = True
    """Biases on every linear layer; False is --disable-bias-linear."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection even when add_bias_linear is False (Qwen-style)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer instead of reusing the input embedding."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocabulary is a multiple of this times the TP size."""
    init_method_std: float = 0.02
    """Std of the normal initialisation; output projections use std / sqrt(2 * num_layers)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (--attention-dropout)."""
    hidden_dropout: float = 0.1
    """Dropout after attention and MLP outputs and on embeddings (--hidden-dropout)."""
    sequence_parallel: bool = False
    """Split norms, dropouts and residuals along the sequence over the TP group."""
    recompute_granularity: str | None = None
    """None, 'full' (whole layers) or 'selective' (core attention only)."""
    recompute_modules: tuple = ("core_attn",)
    """With selective recompute, the submodules recomputed in backward (--recompute-modules):
    core_attn, mlp (dense MLPs), moe (whole MoE layers), shared_experts, layernorm and moe_act
    (their outputs, which the next module would save, recomputed instead); see recomputes()."""
    recompute_method: str = "uniform"
    """With full recompute: 'uniform' or 'block' (--recompute-method)."""
    recompute_num_layers: int | None = None
    """With full recompute: layers per recomputed group (uniform) or recomputed layers per
    stage (block); None recomputes every layer."""
    label_smoothing: float = 0.0
    """Label smoothing of the training loss (as F.cross_entropy defines it)."""
    attention_softmax_in_fp32: bool = True
    """16-bit runs with an explicit attention backend (unfused, local): scores from fp32 q, k and
    the fp32 probabilities kept for backward; False computes the softmax in fp32 but keeps 16-bit
    scores and probabilities, as Megatron's fused softmax kernel (attention_backends.py). No
    effect on fp32 runs or on the SDPA / flash backends, which accumulate in fp32."""
    fused_kernels: bool | None = None
    """Triton kernels for norms, activations, rotary and cross-entropy; None means on CUDA."""
    use_flash_attn: bool = False
    """Attention through the flash_attn package (--use-flash-attn; causal attention without a
    mask): an error when flash_attn is not importable."""
    cp_comm_type: str | tuple = "p2p"
    """Attention across the context-parallel group (--cp-comm-type): 'p2p' (ring),
    'all_gather', 'a2a' or 'a2a+p2p', or one of those per layer (a tuple of num_layers, as
    Megatron's list); unused without context parallelism."""
    cp_a2a_size: int = 1
    """With 'a2a+p2p': the a2a (inner) group size A of --hierarchical-context-parallel-sizes A P."""
    cp_ring_overlap: bool = True
    """With 'p2p': compute each key/value block while the next one travels (False waits for
    each transfer first; tools/benchmarks/bench_context_parallel.py measures the difference)."""
    attention_backend: str = "auto"
    """scaled_dot_product_attention's choice ('auto'), its flash kernel ('flash'), its cuDNN /
    memory-efficient kernels ('fused'), or megalite's explicit math path ('unfused', 'local')
    (--attention-backend)."""
    unfused_kernels: tuple = ()
    """Ops that use the plain-torch reference even where fused kernels run: any of 'bias_gelu',
    'swiglu', 'rotary', 'cross_entropy' (--no-bias-gelu-fusion, --no-bias-swiglu-fusion,
    --no-rope-fusion, no --cross-entropy-loss-fusion)."""
    params_dtype: str = "float32"
    """Dtype of the model parameters: 'float32', 'bfloat16' or 'float16'."""
    use_mup: bool = False
    """Maximal update parameterisation (--use-mup, Megatron's): hidden weights drawn with std /
    sqrt(mup_width_mult), output projections std / (sqrt(2 * num_layers) * sqrt(mup_width_mult)),
    embeddings and the output layer with std; embeddings times mup_embedding_mult, logits times
    mup_output_mult, attention scores times softmax_scale (the optimizer's part is
    megalite.optimizer.mup)."""
    mup_width_mult: float = 1.0
    """hidden_size / --mup-base-hidden-size (with use_mup)."""
    mup_embedding_mult: float = 1.0
    """Factor on the embedding output (--mup-embedding-mult, with use_mup)."""
    mup_output_mult: float = 1.0
    """Factor on the logits (--mup-output-mult; 1 / mup_width_mult when left at 1, with use_mup)."""
    softmax_scale: float | None = None
    """Factor on the attention scores; None is 1 / sqrt(kv_channels). use_mup sets
    sqrt(--mup-base-head-dim or 1) / kv_channels ** --mup-attn-scale-power."""
    moe: MoEConfig | None = None
    """Mixture of experts in place of the dense MLP of some layers (--num-experts); None: dense."""
    mla: MLAConfig | None = None
    """Multi-latent attention in place of self-attention (--multi-latent-attention); None: MHA/GQA.
    With it, qk_layernorm means the query and key/value latent norms."""
    gdn: GDNConfig | None = None
    """Gated DeltaNet linear attention in place of self-attention on the layers its
    linear_attention_freq picks (--experimental-attention-variant gdn); None: none."""
    attention_output_gate: bool = False
    """Full attention's output times sigmoid(a gate projected with q, k, v), per head
    (--attention-output-gate; Qwen3-Next's gated attention)."""
    offload_modules: tuple = ()
    """Submodules whose saved activations go to CPU memory between their forward and backward
    (--fine-grained-activation-offloading with --offload-modules; megalite.model.offload)."""
    min_offloaded_tensor_size: int = 1024 * 1024
    """Saved tensors of fewer elements stay on the device (--min-offloaded-tensor-size)."""
    activation_offload_fraction: float = 1.0
    """Of each chunk's offload groups, the share (the first in forward order) that still offloads
    after the warm-up step (--activation-offload-fraction; megalite.model.offload_plan)."""
    delta_offload_bytes_across_pp_ranks: int = 0
    """Pipeline rank r keeps r times this many bytes of its first groups on the device
    (--delta-offload-bytes-across-pp-ranks)."""
    offload_max_inflight: int | None = None
    """Offloads of one name and chunk not yet joined by the compute stream, at most
    (--fine-grained-offloading-max-inflight-offloads); None: no joins."""
    mtp_num_layers: int | None = None
    """Multi-token prediction depths after the last layer (--mtp-num-layers); None: none."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the mean of the MTP losses in the training loss (--mtp-loss-scaling-factor)."""
    extra: dict = field(default_factory=dict)
    """Free-form metadata carried along (tokenizer files, source model); not used by layers."""

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers `module` (a --recompute-modules name)."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    def __post_init__(self):
        # Shapes no layout can build, refused before the defaults below derive from them;
        # the checks that depend on the TP and PP sizes run when a GPTModel is built.
        ParallelLayout(1).check_model(self.num_layers, self.hidden_size, self.num_attention_heads,
                                      self.num_query_groups, self.kv_channels)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if self.moe is not None:
            self.moe.layer_pattern(self.num_layers)
        if isinstance(self.mla, dict):
            self.mla = MLAConfig(**self.mla)
        if isinstance(self.gdn, dict):
            self.gdn = GDNConfig(**self.gdn)
        if self.gdn is not None:
            self.gdn.layer_pattern(self.num_layers)
        if self.attention_output_gate and self.mla is not None:
            raise ValueError("GPTConfig.attention_output_gate: multi-latent attention has no output gate in megalite")
        if self.mtp_num_layers is not None and self.mtp_num_layers < 1:
            raise ValueError(f"GPTConfig.mtp_num_layers must be positive or None, got {self.mtp_num_layers}")
        choices = {
            "position_embedding_type": ("learned_absolute", "rope", "none"),
            "normalization": ("LayerNorm", "RMSNorm"),
            "activation": ("gelu", "openai_gelu", "swiglu", "squared_relu"),
            "attention_backend": ATTENTION_BACKENDS,
            "recompute_granularity": (None, "full", "selective"),
            "recompute_method": ("uniform", "block"),
            "params_dtype": ("float32", "bfloat16", "float16"),
        }
        self._check_cp_comm_type()
        unknown = set(self.unfused_kernels) - set(UNFUSABLE_OPS)
        if unknown:
            raise ValueError(f"GPTConfig.unfused_kernels: unknown ops {sorted(unknown)} (known: {UNFUSABLE_OPS})")
        self.unfused_kernels = tuple(op for op in UNFUSABLE_OPS if op in self.unfused_kernels)  # one order
        self.recompute_modules = tuple(self.recompute_modules)  # a list from a config file
        self.offload_modules = tuple(self.offload_modules)
        if unknown := set(self.recompute_modules) - set(RECOMPUTE_MODULES):
            raise ValueError(f"GPTConfig.recompute_modules: unknown modules {sorted(unknown)} (known: {RECOMPUTE_MODULES})")
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def _check_cp_comm_type(self) -> None:
        if isinstance(self.cp_comm_type, list):
            self.cp_comm_type = tuple(self.cp_comm_type)  # from a config file
        values = (self.cp_comm_type,) if isinstance(self.cp_comm_type, str) else self.cp_comm_type
        if isinstance(self.cp_comm_type, tuple) and len(values) != self.num_layers:
            raise ValueError(f"GPTConfig.cp_comm_type: {len(values)} values for {self.num_layers} layers (give one, "
                             "or one per layer)")
        for value in values:
            if value not in CP_COMM_TYPES:
                raise ValueError(f"GPTConfig.cp_comm_type must be one of {CP_COMM_TYPES} (or a tuple of them, one "
                                 f"per layer), got {value!r}")

    def cp_comm_type_for(self, layer_number: int) -> str:
        """The context-parallel comm type of layer `layer_number` (global, from 0; an MTP depth's
        layer, numbered from num_layers, takes the last layer's)."""
        if isinstance(self.cp_comm_type, str):
            return self.cp_comm_type
        return self.cp_comm_type[min(layer_number, self.num_layers - 1)]

    @property
    def kernel_impl(self) -> str:
        """The megalite.kernels implementation: Triton on CUDA by default ("auto")."""
        return {None: "auto", True: "triton", False: "torch"}[self.fused_kernels]

    def kernel_impl_for(self, op: str) -> str:
        """The implementation of one op: kernel_impl, or 'torch' where its fusion is off."""
        return "torch" if op in self.unfused_kernels else self.kernel_impl

    @property
    def hidden_init_std(self) -> float:
        """Std of the hidden (non-output-projection) weights: init_method_std, / sqrt(width) under muP."""
        return self.init_method_std / (math.sqrt(self.mup_width_mult) if self.use_mup else 1.0)

    @property
    def output_proj_init_std(self) -> float:
        """Std of the attention and MLP output projections: init_method_std / sqrt(2 * num_layers),
        / sqrt(width) under muP (Megatron's mup_scaled_init_method_normal)."""
        if self.use_mup:
            return self.init_method_std / (math.sqrt(2.0 * self.num_layers) * math.sqrt(self.mup_width_mult))
        return self.init_method_std / math.sqrt(2.0 * self.num_layers)

    def padded_vocab_size(self, tp_size: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["moe"] = self.moe.to_dict() if self.moe is not None else None
        values["mla"] = self.mla.to_dict() if self.mla is not None else None
        values["gdn"] = self.gdn.to_dict() if self.gdn is not None else None
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "GPTConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {', '.join(unknown)}")
        return cls(**values)

    def replace(self, **changes) -> "GPTConfig":
        return replace(self, **changes)
