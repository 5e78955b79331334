"""Megatron's Muon flags (megatron/training/arguments.py: names, defaults and choices), for
--optimizer muon (and the deprecated dist_muon, which Megatron maps to muon with
--use-distributed-optimizer, as here). The optimizer is megalite.optimizer.muon / muon_mixed.
"""

from dataclasses import dataclass

from megalite.config.field import arg
from megalite.optimizer.muon import NS_COEFFICIENTS

MUON_OPTIMIZERS = ("muon", "dist_muon")


@dataclass
class MuonArgs:
    """Muon: Newton-Schulz orthogonalised momentum for 2-D weights, Adam or Lion for the rest."""

    muon_momentum: float = arg(0.9, "Momentum factor of Muon.")
    muon_split_qkv: bool | None = arg(
        True, "Orthogonalise the q, k and v blocks of the fused QKV weight separately.",
        negative_flag="--muon-no-split-qkv")
    muon_nesterov: bool = arg(False, "Nesterov-style momentum in Muon's internal SGD.")
    muon_scale_mode: str = arg(
        "spectral", "Scale of the orthogonalised update: spectral sqrt(max(rows, cols)), unit_rms_norm "
        "sqrt(rows / cols), shape_scaling sqrt(max(1, rows / cols)).",
        choices=("spectral", "unit_rms_norm", "shape_scaling"))
    muon_fp32_matmul_prec: str = arg(
        "medium", "Float32 matmul precision of the Newton-Schulz iteration (medium: it runs in bf16).",
        choices=("low", "medium", "high"), unsupported=("low",))
    muon_coefficient_type: str = arg(
        "quintic", "Newton-Schulz coefficients: simple, quintic, polar_express, cans, aol or deepseekv4.")
    muon_num_ns_steps: int = arg(5, "Newton-Schulz steps.")
    muon_tp_mode: str = arg(
        "duplicated", "Newton-Schulz of tensor-parallel weights: blockwise (each shard alone), duplicated "
        "(all-gather, every rank computes the full matrix) or distributed (Gram matrices all-reduced).",
        choices=("blockwise", "duplicated", "distributed"))
    muon_use_syrk: bool = arg(False, "Triton SYRK kernel for the Gram matrix (CUDA only; not implemented).")
    muon_extra_scale_factor: float = arg(1.0, "Additional factor on the Muon update.")
    muon_scalar_optimizer: str = arg(
        "adam", "Optimizer of the embeddings, output layer, norms and biases under Muon.", choices=("adam", "lion"))
    lion_beta1: float = arg(0.95, "Lion's beta1 (the sign update's interpolation).")
    lion_beta2: float = arg(0.98, "Lion's beta2 (the momentum EMA).")


def check_muon_args(args, fail) -> None:
    """Megatron's mapping of dist_muon, and the combinations megalite refuses, one line each."""
    if args.optimizer not in MUON_OPTIMIZERS:
        return
    if args.optimizer == "dist_muon":  # Megatron: "deprecated, use --optimizer muon --use-distributed-optimizer"
        args.optimizer = "muon"
        args.use_distributed_optimizer = True
    if args.use_megatron_fsdp:
        fail("--optimizer muon with --use-megatron-fsdp is not supported (Megatron refuses it too)")
    if args.overlap_param_gather_with_optimizer_step:
        fail("--optimizer muon with --overlap-param-gather-with-optimizer-step is not implemented")
    if args.num_distributed_optimizer_instances > 1:
        fail("--optimizer muon with --num-distributed-optimizer-instances > 1 is not implemented")
    if args.fp16:
        fail("--optimizer muon with --fp16 is not supported (as in Megatron); use --bf16")
    if args.muon_coefficient_type not in NS_COEFFICIENTS:
        fail(f"--muon-coefficient-type {args.muon_coefficient_type!r} is not one of {', '.join(NS_COEFFICIENTS)}")
    if args.muon_num_ns_steps < 1:
        fail(f"--muon-num-ns-steps must be at least 1, got {args.muon_num_ns_steps}")
    if args.muon_use_syrk:
        fail("--muon-use-syrk (a Triton kernel) is not implemented in megalite")
    if args.decoupled_lr is not None:
        fail("--optimizer muon with --decoupled-lr is not implemented")
    if args.optimizer_cpu_offload:
        fail("--optimizer muon with --optimizer-cpu-offload is not implemented")


def muon_options(args) -> dict | None:
    """build_muon_optimizer's Muon keywords from the flags (None unless --optimizer muon)."""
    if args.optimizer != "muon":
        return None
    return dict(momentum=args.muon_momentum, nesterov=args.muon_nesterov, scale_mode=args.muon_scale_mode,
                num_ns_steps=args.muon_num_ns_steps, coefficient_type=args.muon_coefficient_type,
                tp_mode=args.muon_tp_mode, split_qkv=args.muon_split_qkv is not False,
                extra_scale_factor=args.muon_extra_scale_factor, fp32_matmul_prec=args.muon_fp32_matmul_prec,
                scalar_optimizer=args.muon_scalar_optimizer, lion_beta1=args.lion_beta1, lion_beta2=args.lion_beta2)
