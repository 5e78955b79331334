"""Shape of multi-latent attention (DeepSeek-V2/V3, Megatron's --multi-latent-attention) and its
rotary embedding: plain RoPE or YaRN over the decoupled rotary part of each head.

Field names follow Megatron's MLATransformerConfig. The rotary angles and YaRN's frequency blend
are Peng et al.'s (arXiv 2309.00071) as DeepSeek-V2 and Megatron-Core apply them; the
concentration factor ("mscale") multiplies cos and sin, and the softmax scale is
mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim).
"""

import math
from dataclasses import asdict, dataclass

import torch

ROPE_TYPES = ("rope", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(factor) + 1 for factor > 1, else 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass
class MLAConfig:
    """Multi-latent attention: queries through an optional low-rank latent, keys and values
    from one shared latent plus a rotary key shared by every head."""

    kv_lora_rank: int
    """Width of the key/value latent (--kv-lora-rank)."""
    q_lora_rank: int | None = None
    """Width of the query latent (--q-lora-rank); None projects queries directly from h."""
    qk_head_dim: int = 128
    """Per-head query/key channels without position information (--qk-head-dim)."""
    qk_pos_emb_head_dim: int = 64
    """Per-head rotary channels of queries and of the shared rotary key (--qk-pos-emb-head-dim)."""
    v_head_dim: int = 128
    """Per-head value channels (--v-head-dim)."""
    rope_type: str = "yarn"
    """'rope' or 'yarn' (--rope-type; Megatron's MLA default is yarn)."""
    rotary_scaling_factor: float = 1.0
    """YaRN's context extension factor s (--rotary-scaling-factor); also the softmax scale's."""
    original_max_position_embeddings: int = 4096
    """The context length YaRN extends (--yarn-original-max-position-embeddings)."""
    beta_fast: float = 32.0
    """Rotations above which frequencies are kept (--yarn-beta-fast)."""
    beta_slow: float = 1.0
    """Rotations below which frequencies are interpolated (--yarn-beta-slow)."""
    mscale: float = 1.0
    """--mscale: numerator of the concentration factor on cos and sin."""
    mscale_all_dim: float = 0.0
    """--mscale-all-dim: denominator of that factor, and the softmax scale's mscale."""
    correction_range_round_to_int: bool = True
    """Round YaRN's correction range to whole dimensions (--yarn-correction-range-round-to-int)."""

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"MLAConfig.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLAConfig.{name} must be positive, got {getattr(self, name)}")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_pos_emb_head_dim must be even (rotated in pairs), "
                             f"got {self.qk_pos_emb_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"MLAConfig.q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if self.rotary_scaling_factor <= 0:
            raise ValueError(f"MLAConfig.rotary_scaling_factor must be positive, got {self.rotary_scaling_factor}")

    @property
    def q_head_dim(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def softmax_scale(self) -> float:
        return yarn_mscale(self.rotary_scaling_factor, self.mscale_all_dim) ** 2 / math.sqrt(self.q_head_dim)

    def concentration(self) -> float:
        """The factor on cos and sin: 1 for plain RoPE, mscale(s, mscale) / mscale(s, mscale_all_dim) for YaRN."""
        if self.rope_type != "yarn":
            return 1.0
        return yarn_mscale(self.rotary_scaling_factor, self.mscale) / yarn_mscale(self.rotary_scaling_factor,
                                                                                  self.mscale_all_dim)

    def to_dict(self) -> dict:
        return asdict(self)


def _correction_dim(rotations: float, dim: int, base: float, original: int) -> float:
    """The dimension whose wavelength fits `rotations` times into `original` positions."""
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, mla: MLAConfig, device=None) -> torch.Tensor:
    """YaRN's dim / 2 frequencies: the original ones above beta_fast rotations over the
    original context, those divided by the factor below beta_slow, a linear blend between."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    extrapolated = 1.0 / (base ** exponents)
    interpolated = 1.0 / (mla.rotary_scaling_factor * base ** exponents)
    low = _correction_dim(mla.beta_fast, dim, base, mla.original_max_position_embeddings)
    high = _correction_dim(mla.beta_slow, dim, base, mla.original_max_position_embeddings)
    if mla.correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step, not a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def mla_cos_sin(config, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, 1, rotary dims] (fp32, rotate-half layout, the concentration factor
    folded in) of an MLA model's rotary part for positions 0..seq-1. Plain RoPE rotates
    rotary_percent of the qk_pos_emb_head_dim channels; YaRN all of them."""
    mla = config.mla
    dim = mla.qk_pos_emb_head_dim
    if mla.rope_type == "yarn":
        inv_freq = yarn_inv_freq(dim, config.rotary_base, mla, device)
    else:
        dim = int(dim * config.rotary_percent)
        inv_freq = 1.0 / (config.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    scale = mla.concentration()
    return emb.cos() * scale, emb.sin() * scale
