"""Shape of Gated DeltaNet linear attention (Megatron's --experimental-attention-variant gdn) and
which layers use it (--linear-attention-freq).

Field names follow Megatron-Core's TransformerConfig (linear_*).
"""

from dataclasses import asdict, dataclass


@dataclass
class GDNConfig:
    """Gated DeltaNet layers in place of self-attention on the layers `is_linear_layer` picks."""

    linear_attention_freq: int | tuple = 4
    """An interval N (every N-th layer, counting from 1, is full attention, the others linear)
    or one 1 (linear) / 0 (full attention) per layer (--linear-attention-freq)."""
    linear_conv_kernel_dim: int = 4
    """Width of the short causal depthwise convolution over q, k, v (--linear-conv-kernel-dim)."""
    linear_key_head_dim: int = 128
    """Query/key channels per head (--linear-key-head-dim)."""
    linear_value_head_dim: int = 128
    """Value channels per head (--linear-value-head-dim)."""
    linear_num_key_heads: int = 16
    """Query/key heads (--linear-num-key-heads)."""
    linear_num_value_heads: int = 32
    """Value heads (--linear-num-value-heads), a multiple of the key heads (each key head serves
    linear_num_value_heads / linear_num_key_heads consecutive value heads)."""
    chunk_size: int = 64
    """Tokens per chunk of the chunked delta rule in training (fla's and Megatron's 64)."""

    def __post_init__(self):
        if isinstance(self.linear_attention_freq, list):
            self.linear_attention_freq = tuple(self.linear_attention_freq)  # from a config file
        for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"GDNConfig.{name} must be positive, got {getattr(self, name)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"GDNConfig: linear_num_value_heads {self.linear_num_value_heads} is not a multiple "
                             f"of linear_num_key_heads {self.linear_num_key_heads}")
        freq = self.linear_attention_freq
        if isinstance(freq, int) and freq < 1 or isinstance(freq, tuple) and set(freq) - {0, 1}:
            raise ValueError(f"GDNConfig.linear_attention_freq must be a positive interval or a list of 0/1, "
                             f"got {freq!r}")

    def layer_pattern(self, num_layers: int) -> tuple:
        """1 (linear) or 0 (full attention) per layer, as Megatron's get_linear_attention_pattern."""
        freq = self.linear_attention_freq
        if isinstance(freq, int):
            return tuple(0 if (i + 1) % freq == 0 else 1 for i in range(num_layers))
        if len(freq) != num_layers:
            raise ValueError(f"--linear-attention-freq: the pattern has {len(freq)} entries for {num_layers} layers")
        return freq

    def is_linear_layer(self, layer_number: int, num_layers: int) -> bool:
        """Whether layer `layer_number` (global, from 0) is a Gated DeltaNet layer."""
        return layer_number < num_layers and bool(self.layer_pattern(num_layers)[layer_number])

    @property
    def qk_dim(self) -> int:
        return self.linear_key_head_dim * self.linear_num_key_heads

    @property
    def v_dim(self) -> int:
        return self.linear_value_head_dim * self.linear_num_value_heads

    def in_proj_sections(self) -> tuple:
        """The full in_proj's output blocks, Megatron's order: query, key, value, z (the output
        gate), beta, alpha; each is split over TP ranks on its own."""
        nv = self.linear_num_value_heads
        return (self.qk_dim, self.qk_dim, self.v_dim, self.v_dim, nv, nv)

    def to_dict(self) -> dict:
        values = asdict(self)
        if isinstance(values["linear_attention_freq"], tuple):
            values["linear_attention_freq"] = list(values["linear_attention_freq"])
        return values
