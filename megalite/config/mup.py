"""Megatron's maximal update parameterisation flags (--use-mup and --mup-*; names, defaults and
their resolution from Megatron-Core's TransformerConfig.__post_init__). The model's part is in
GPTConfig (initialisation, embedding, logit and attention scaling), the optimizer's in
megalite.optimizer.mup (per-group learning rates and Adam epsilon).
"""

from dataclasses import dataclass, fields

from megalite.config.field import arg, flag_of


@dataclass
class MupArgs:
    """Maximal update parameterisation (muP)."""

    use_mup: bool = arg(
        False, "muP: hidden weights initialised with std / sqrt(m), output projections with std / "
        "(sqrt(2L) sqrt(m)), attention scores scaled by 1/d_head, logits by 1/m; Adam's learning rate and "
        "epsilon / m for hidden matrices (SGD: learning rate x m for vectors); m = hidden / base hidden size.")
    mup_base_hidden_size: int | None = arg(
        None, "Hidden size of the base (proxy) model the width multiplier is taken from (default: "
        "--hidden-size, m = 1).")
    mup_embedding_mult: float = arg(1.0, "Factor on the embedding output (with --use-mup).")
    mup_output_mult: float = arg(
        1.0, "Factor on the logits (with --use-mup; left at 1 it becomes 1 / width multiplier).")
    mup_base_head_dim: float | None = arg(
        None, "Base head dimension: attention scale sqrt(this) / kv_channels ** --mup-attn-scale-power "
        "(default: 1 / kv_channels ** power).")
    mup_attn_scale_power: float = arg(
        1.0, "Power of kv_channels in muP's attention scale (1: muP's 1/d, 0.5: the standard 1/sqrt(d)).")


def check_mup_args(args, fail) -> None:
    if not args.use_mup:
        return
    if args.mup_base_hidden_size is not None and args.mup_base_hidden_size <= 0:
        fail(f"--mup-base-hidden-size must be positive, got {args.mup_base_hidden_size}")
    if args.mup_base_head_dim is not None and args.mup_base_head_dim <= 0:
        fail(f"--mup-base-head-dim must be positive, got {args.mup_base_head_dim}")
    if args.optimizer not in ("adam", "sgd"):
        fail(f"--use-mup: megalite scales Adam and SGD (got --optimizer {args.optimizer})")
    scale_flags = [flag for flag, given in (("--mup-base-head-dim", args.mup_base_head_dim is not None),
                                            ("--mup-attn-scale-power", args.mup_attn_scale_power != 1.0)) if given]
    if scale_flags and args.multi_latent_attention:
        fail(f"{scale_flags[0]} and --multi-latent-attention contradict each other: multi-latent attention "
             "scales scores by its own mscale^2 / sqrt(qk head dim), not muP's attention scale (as Megatron-Core's "
             "MultiLatentAttention)")


def mup_width_mult(args) -> float:
    """hidden / base hidden size under --use-mup, else 1."""
    if not args.use_mup:
        return 1.0
    return args.hidden_size / (args.mup_base_hidden_size or args.hidden_size)


def mup_model_fields(args, kv_channels: int) -> dict:
    """GPTConfig's muP fields as Megatron resolves them (`kv_channels`: the head width). Under
    multi-latent attention there is no muP attention scale: Megatron-Core's MultiLatentAttention
    passes its own softmax scale (YaRN's mscale^2 / sqrt(qk head dim)) to core attention, where
    self-attention passes config.softmax_scale; muP's initialisation, multipliers and optimizer
    scaling apply as to any model."""
    if not args.use_mup:
        return {}
    width = mup_width_mult(args)
    base_head = 1.0 if args.mup_base_head_dim is None else args.mup_base_head_dim ** 0.5
    output_mult = 1.0 / width if args.mup_output_mult == 1.0 and width != 1.0 else args.mup_output_mult
    fields = {"use_mup": True, "mup_width_mult": width, "mup_embedding_mult": args.mup_embedding_mult,
              "mup_output_mult": output_mult}
    if not args.multi_latent_attention:
        fields["softmax_scale"] = base_head / kv_channels ** args.mup_attn_scale_power
    return fields


def mup_notes(args) -> list[str]:
    """One line for --mup-* flags given without --use-mup (Megatron ignores them there), and
    one for muP's attention scale, which multi-latent attention does not take."""
    if args.use_mup:
        return ["--use-mup with --multi-latent-attention: attention scores keep multi-latent attention's own "
                "scale, mscale^2 / sqrt(qk head dim), not muP's 1 / head dim (as in Megatron-Core); muP's "
                "initialisation, multipliers and learning rates apply"] if args.multi_latent_attention else []
    given = [flag_of(f) for f in fields(MupArgs) if getattr(args, f.name) != f.default]
    return [f"{given[0]}: no effect without --use-mup (as in Megatron)"] if given else []
