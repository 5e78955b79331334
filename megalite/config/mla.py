"""Options for multi-latent attention with its rotary embedding (YaRN), and for multi-token
prediction: Megatron-LM's names and defaults. Megatron declares some of them in arguments.py
(_add_mla_args: --q-lora-rank ... --mscale-all-dim; --rope-type; --yarn-*) and generates others
from TransformerConfig's fields (--multi-latent-attention, --mtp-num-layers,
--mtp-loss-scaling-factor); MLATransformerConfig's own defaults apply where it has a field no
flag sets.

`check_mla_args` refuses what cannot run, `mla_model_fields` gives the GPTConfig fields,
`mla_notes` the start-up lines of flags megalite serves another way.
"""

from dataclasses import dataclass, fields

from megalite.config.field import arg, flag_of
from megalite.model.mla_config import MLAConfig


@dataclass
class MLAArgs:
    """Multi-latent attention, its rotary embedding, multi-token prediction."""

    multi_latent_attention: bool = arg(
        False, "Multi-latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents, a "
        "decoupled rotary part shared by the heads' keys. With --qk-layernorm the latents are normalised.")
    q_lora_rank: int | None = arg(None, "Width of the query latent (default: queries projected from h directly).")
    kv_lora_rank: int = arg(32, "Width of the key/value latent.")
    qk_head_dim: int = arg(128, "Query/key channels per head without position information.")
    qk_pos_emb_head_dim: int = arg(64, "Rotary query/key channels per head (the rotary key is shared by the heads).")
    v_head_dim: int = arg(128, "Value channels per head.")
    rope_type: str | None = arg(
        None, "Rotary embedding of multi-latent attention: rope or yarn (default yarn, as Megatron's MLA; "
        "standard attention takes RoPE from --position-embedding-type).", choices=("rope", "yarn"))
    rotary_scaling_factor: float = arg(
        1.0, "YaRN's context extension factor (also scales the softmax through --mscale-all-dim).")
    mscale: float = arg(1.0, "YaRN's concentration on cos and sin: mscale(factor, this) / mscale(factor, --mscale-all-dim).")
    mscale_all_dim: float = arg(0.0, "YaRN's mscale of the softmax scale, mscale(factor, this)^2 / sqrt(head width).")
    yarn_original_max_position_embeddings: int | None = arg(
        None, "The context YaRN extends (default 4096, MLATransformerConfig's).")
    yarn_beta_fast: float | None = arg(None, "YaRN: rotations above which frequencies are kept (default 32).")
    yarn_beta_slow: float | None = arg(None, "YaRN: rotations below which they are interpolated (default 1).")
    yarn_correction_range_round_to_int: bool | None = arg(
        None, "YaRN: round the correction range to whole dimensions (default on).",
        negative_flag="--no-yarn-correction-range-round-to-int")
    cache_mla_latents: bool = arg(
        False, "Megatron's dynamic-inference cache of MLA latents (Flash MLA): refused, it conflicts with training.")
    mla_down_proj_fusion: bool = arg(
        False, "Megatron: one fused GEMM for the query and key/value down projections; megalite runs the two "
        "projections (the same result, the same checkpoint names).")
    mtp_num_layers: int | None = arg(
        None, "Multi-token prediction depths (DeepSeek-V3's MTP modules) on the last pipeline stage.")
    mtp_loss_scaling_factor: float = arg(
        0.1, "Weight of the mean of the MTP depths' losses in the training loss.")


def mla_config_from_args(args) -> MLAConfig | None:
    if not args.multi_latent_attention:
        return None
    yarn = {}
    for flag, field in (("yarn_original_max_position_embeddings", "original_max_position_embeddings"),
                        ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_correction_range_round_to_int", "correction_range_round_to_int")):
        if getattr(args, flag) is not None:
            yarn[field] = getattr(args, flag)
    return MLAConfig(kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank, qk_head_dim=args.qk_head_dim,
                     qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                     rope_type=args.rope_type or "yarn", rotary_scaling_factor=args.rotary_scaling_factor,
                     mscale=args.mscale, mscale_all_dim=args.mscale_all_dim, **yarn)


def mla_model_fields(args) -> dict:
    """The GPTConfig fields these flags set."""
    return dict(mla=mla_config_from_args(args), mtp_num_layers=args.mtp_num_layers,
                mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)


_MLA_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_scaling_factor",
             "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
             "yarn_correction_range_round_to_int", "mla_down_proj_fusion")


def check_mla_args(args, fail) -> None:
    """Refuse what cannot run, with one line naming the flags."""
    defaults = {f.name: f for f in fields(MLAArgs)}
    if not args.multi_latent_attention:
        changed = [flag_of(defaults[n]) for n in _MLA_ONLY if getattr(args, n) != defaults[n].default]
        if changed:
            fail(f"{changed[0]} needs --multi-latent-attention")
        if args.rope_type == "yarn":
            fail("--rope-type yarn needs --multi-latent-attention (standard attention takes rope only, as in Megatron)")
    else:
        if args.group_query_attention:
            fail("--multi-latent-attention and --group-query-attention contradict each other (give one)")
        if args.cache_mla_latents:
            fail("--cache-mla-latents is Megatron's dynamic-inference latent cache; it conflicts with training")
        for flag, on in (("--rotary-interleaved", args.rotary_interleaved), ("--use-rope-scaling", args.use_rope_scaling),
                         ("--rotary-seq-len-interpolation-factor",
                          args.rotary_seq_len_interpolation_factor is not None)):
            if on:
                fail(f"{flag} does not apply to --multi-latent-attention (its rotary part is --rope-type rope or yarn)")
        if (args.rope_type or "yarn") == "yarn" and args.rotary_percent != 1.0:
            fail(f"--rotary-percent {args.rotary_percent} does not apply to --rope-type yarn (it rotates all "
                 "--qk-pos-emb-head-dim channels)")
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            value = getattr(args, name)
            if value is not None and value < 1:
                fail(f"{flag_of(defaults[name])} must be positive, got {value}")
        if args.qk_pos_emb_head_dim % 2:
            fail(f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim} must be even (rotated in pairs)")
        if args.rotary_scaling_factor <= 0:
            fail(f"--rotary-scaling-factor must be positive, got {args.rotary_scaling_factor}")
    if args.mtp_num_layers is not None:
        if args.mtp_num_layers < 1:
            fail(f"--mtp-num-layers must be positive, got {args.mtp_num_layers}")
        if args.position_embedding_type not in ("learned_absolute", "rope", "none"):
            fail(f"--mtp-num-layers needs --position-embedding-type learned_absolute, rope or none, "
                 f"got {args.position_embedding_type}")
    if args.mtp_loss_scaling_factor < 0:
        fail(f"--mtp-loss-scaling-factor must not be negative, got {args.mtp_loss_scaling_factor}")


def mla_notes(args) -> list[str]:
    """One start-up line per flag megalite serves another way."""
    notes = []
    if args.multi_latent_attention and args.kv_channels is not None:
        notes.append(f"--kv-channels {args.kv_channels}: not used by --multi-latent-attention, whose head widths are "
                     "--qk-head-dim + --qk-pos-emb-head-dim (queries, keys) and --v-head-dim (values)")
    if args.mla_down_proj_fusion:
        notes.append("--mla-down-proj-fusion: megalite runs the query and key/value down projections as two GEMMs "
                     "(the same result)")
    if args.rope_type == "rope" and not args.multi_latent_attention:
        notes.append("--rope-type rope: standard attention's RoPE is --position-embedding-type rope; nothing changes")
    return notes


def mla_flags(config) -> list[str]:
    """The flags giving a GPTConfig's multi-latent attention and multi-token prediction (none
    for a model without them); --qk-layernorm comes with the other model flags."""
    flags = []
    mla = config.mla
    if mla is not None:
        flags += ["--multi-latent-attention", "--kv-lora-rank", str(mla.kv_lora_rank), "--qk-head-dim",
                  str(mla.qk_head_dim), "--qk-pos-emb-head-dim", str(mla.qk_pos_emb_head_dim), "--v-head-dim",
                  str(mla.v_head_dim), "--rope-type", mla.rope_type]
        if mla.q_lora_rank is not None:
            flags += ["--q-lora-rank", str(mla.q_lora_rank)]
        if mla.rope_type == "yarn":
            flags += ["--rotary-scaling-factor", repr(mla.rotary_scaling_factor), "--mscale", repr(mla.mscale),
                      "--mscale-all-dim", repr(mla.mscale_all_dim), "--yarn-original-max-position-embeddings",
                      str(mla.original_max_position_embeddings), "--yarn-beta-fast", repr(mla.beta_fast),
                      "--yarn-beta-slow", repr(mla.beta_slow)]
            if not mla.correction_range_round_to_int:
                flags.append("--no-yarn-correction-range-round-to-int")
    if config.mtp_num_layers:
        flags += ["--mtp-num-layers", str(config.mtp_num_layers), "--mtp-loss-scaling-factor",
                  repr(config.mtp_loss_scaling_factor)]
    return flags
