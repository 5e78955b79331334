"""Megatron's FP8 / FP4 flags (Transformer Engine's recipes in Megatron): which megalite
serves (megalite/parallel/tensor/fp8_gemm.py, fp8_scaling.py) and which it refuses, each in
one line saying what it would need. Megatron's defaults: --fp8-recipe delayed, --fp8-margin 0,
--fp8-amax-history-len 1, --fp8-amax-compute-algo most_recent, FP8 weight gradients on, one
bf16 layer at each end with --first-last-layers-bf16. None below means "Megatron's default,
not given" so that a flag given without --fp8-format can be refused instead of ignored.
"""

from dataclasses import dataclass, fields

from megalite.config.field import arg, on_cpu
from megalite.parallel.tensor.fp8_scaling import Fp8Recipe

RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
REFUSED_RECIPES = {
    "mxfp8": "MXFP8 (a scale per 32 elements) needs Blackwell (sm_100) tensor cores; on Hopper use "
             "--fp8-recipe delayed or tensorwise",
    "custom": "a custom recipe needs --fp8-quantizer-factory (a Transformer Engine quantizer), "
              "which megalite does not load; use delayed or tensorwise",
}
FP4 = ("NVFP4 training needs Blackwell (sm_100) FP4 tensor cores and Transformer Engine's NVFP4 "
       "recipe, which megalite does not have; on Hopper use --fp8-format hybrid")


@dataclass
class Fp8Args:
    """FP8 training (Megatron's --fp8-* flags) and FP4 (refused)."""

    fp8_format: str | None = arg(
        None, "FP8 GEMMs in every attention and MLP linear: e4m3 everywhere, or hybrid (e4m3 "
        "inputs and weights, e5m2 gradients).", choices=("e4m3", "hybrid"))
    fp8_recipe: str | None = arg(
        None, "FP8 scaling (default delayed): delayed (scales from an amax history, updated after "
        "each step), tensorwise (each tensor's own amax) or blockwise (a power-of-2 scale per 1x128 tile "
        "of activations and gradients and per 128x128 block of weights, Hopper); mxfp8, custom are refused.",
        choices=RECIPES)
    fp8_margin: int | None = arg(None, "Delayed scaling: scale = fp8_max / amax / 2**margin (default 0).")
    fp8_interval: int | None = arg(
        None, "Deprecated in Megatron (Transformer Engine ignores it since 1.8): scales are updated every step.")
    fp8_amax_history_len: int | None = arg(None, "Delayed scaling: steps of amax history (default 1).")
    fp8_amax_compute_algo: str | None = arg(
        None, "Delayed scaling: the amax a scale comes from, most_recent (default) or max over the history.",
        choices=("most_recent", "max"))
    fp8_wgrad: bool | None = arg(
        None, "FP8 weight-gradient GEMMs (default); --no-fp8-wgrad keeps them 16-bit.",
        negative_flag="--no-fp8-wgrad")
    fp8_param_gather: bool = arg(
        False, "Keep the parameters in FP8 for their all-gather. With --use-torch-fsdp2 each FP8 linear's "
        "weight shard is cast to FP8 before FSDP2's all-gather and the gathered FP8 weight feeds the GEMM; "
        "with the distributed optimizer the 16-bit weights are all-gathered (one line). Needs --fp8-format "
        "and the distributed optimizer or FSDP2, as Megatron checks.")
    first_last_layers_bf16: bool = arg(False, "Keep the first and last decoder layers' linears in 16-bit.")
    num_layers_at_start_in_bf16: int | None = arg(None, "With --first-last-layers-bf16: layers at the start (default 1).")
    num_layers_at_end_in_bf16: int | None = arg(None, "With --first-last-layers-bf16: layers at the end (default 1).")
    tp_only_amax_red: bool = arg(False, "Delayed scaling: reduce amaxes over TP x CP only, not DP.")
    fp8_dot_product_attention: bool = arg(False, "FP8 attention core: refused (no FP8 attention kernel).")
    fp8_multi_head_attention: bool = arg(False, "FP8 attention block: refused (no FP8 attention kernel).")
    fp4_format: str | None = arg(None, "FP4 training: refused (NVFP4 needs Blackwell).", choices=("e2m1",))
    fp4_recipe: str | None = arg(None, "FP4 recipe: refused (no FP4 path).", choices=("nvfp4", "custom"))
    fp4_param_gather: bool = arg(False, "FP4 parameters all-gathered in FP4: refused (no FP4 path).")


def _given(args, names) -> list[str]:
    """Those of `names` given (not their default: identity, so `--fp8-margin 0` counts)."""
    defaults = {f.name: f.default for f in fields(Fp8Args)}
    return ["--" + ("no-" if getattr(args, n) is False else "") + n.replace("_", "-")
            for n in names if getattr(args, n) is not defaults[n]]


def check_fp8_args(args, fail) -> None:
    """Refuse what megalite cannot serve and contradictions, each in one line naming the flag."""
    if args.fp4_format or args.fp4_recipe or args.fp4_param_gather:
        flag = "--fp4-format" if args.fp4_format else "--fp4-recipe" if args.fp4_recipe else "--fp4-param-gather"
        fail(f"{flag}: {FP4}")
    for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
        if getattr(args, name):
            fail(f"--{name.replace('_', '-')}: needs an FP8 attention kernel (Transformer Engine's FP8 "
                 "fused attention, cuDNN); megalite's attention core runs in 16-bit (its linears take --fp8-format)")
    if args.fp8_param_gather and not (args.use_distributed_optimizer or args.use_torch_fsdp2
                                      or args.use_megatron_fsdp):
        fail("--fp8-param-gather needs --use-distributed-optimizer or --use-torch-fsdp2 (as Megatron checks)")
    if args.fp8_format is None:
        given = _given(args, ("fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len",
                              "fp8_amax_compute_algo", "fp8_wgrad", "first_last_layers_bf16",
                              "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "tp_only_amax_red",
                              "fp8_param_gather"))
        if given:
            fail(f"{given[0]} needs --fp8-format (e4m3 or hybrid)")
        return
    _check_fp8_device(args, fail)
    recipe = args.fp8_recipe or "delayed"
    if recipe in REFUSED_RECIPES:
        fail(f"--fp8-recipe {recipe}: {REFUSED_RECIPES[recipe]}")
    if recipe != "delayed":
        delayed_only = _given(args, ("fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo",
                                     "tp_only_amax_red"))
        if delayed_only:
            fail(f"{delayed_only[0]} applies to --fp8-recipe delayed only (got {recipe})")
    if recipe == "blockwise" and args.fp8_param_gather and args.use_torch_fsdp2:
        fail("--fp8-param-gather with --fp8-recipe blockwise under --use-torch-fsdp2: megalite's FP8 all-gather "
             "casts a weight shard with one scale (delayed or tensorwise), not in 128x128 blocks; drop one of them")
    if args.fp8_param_gather and args.use_torch_fsdp2 and args.tp_only_amax_red:
        fail("--tp-only-amax-red with --fp8-param-gather under --use-torch-fsdp2: a weight's FSDP2 shards are cast "
             "to FP8 with one scale, which needs its amax reduced over DP x CP too; drop --tp-only-amax-red")
    if args.fp8_param_gather and args.use_torch_fsdp2 and args.torch_compile:
        fail("--torch-compile with --fp8-param-gather under --use-torch-fsdp2: the compiled run's losses differ from "
             "the eager run's (4e-4 relative at step 2, measured; without --fp8-param-gather they agree), not yet "
             "found why; drop one of them")
    if args.fp8_margin is not None and args.fp8_margin < 0:
        fail(f"--fp8-margin must not be negative, got {args.fp8_margin}")
    if args.fp8_amax_history_len is not None and args.fp8_amax_history_len < 1:
        fail(f"--fp8-amax-history-len must be at least 1, got {args.fp8_amax_history_len}")
    if (args.num_layers_at_start_in_bf16 is not None or args.num_layers_at_end_in_bf16 is not None) \
            and not args.first_last_layers_bf16:
        fail("--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16 need --first-last-layers-bf16")
    per_stage = (args.num_layers or 0) // max(args.pipeline_model_parallel_size or 1, 1)
    for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= per_stage:
            fail(f"--{name.replace('_', '-')} {value} must be between 0 and the layers per pipeline "
                 f"stage ({per_stage})")


def _check_fp8_device(args, fail) -> None:
    """FP8 tensor cores: compute capability 8.9 (Ada) or later; the CPU runs torch's FP8 GEMM."""
    if on_cpu(args):
        return
    import torch

    capability = torch.cuda.get_device_capability()
    if args.fp8_recipe == "blockwise" and capability < (9, 0):
        fail(f"--fp8-recipe blockwise: block-scaled FP8 GEMMs need Hopper (compute capability 9.0, as Transformer "
             f"Engine's); {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}")
    if capability < (8, 9):
        fail(f"--fp8-format {args.fp8_format}: FP8 GEMMs need a GPU of compute capability 8.9 or later "
             f"(Ada, Hopper, Blackwell); {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}")


def fp8_recipe_from_args(args) -> Fp8Recipe | None:
    """The run's FP8 recipe, or None without --fp8-format."""
    if args.fp8_format is None:
        return None
    bf16_ends = args.first_last_layers_bf16
    return Fp8Recipe(
        format=args.fp8_format, scaling=args.fp8_recipe or "delayed",
        margin=args.fp8_margin or 0, amax_history_len=args.fp8_amax_history_len or 1,
        amax_compute_algo=args.fp8_amax_compute_algo or "most_recent", wgrad=args.fp8_wgrad is not False,
        tp_only_amax_reduction=args.tp_only_amax_red,
        param_gather=args.fp8_param_gather and args.use_torch_fsdp2,
        bf16_layers_at_start=(1 if args.num_layers_at_start_in_bf16 is None else args.num_layers_at_start_in_bf16)
        if bf16_ends else 0,
        bf16_layers_at_end=(1 if args.num_layers_at_end_in_bf16 is None else args.num_layers_at_end_in_bf16)
        if bf16_ends else 0)


def fp8_notes(args) -> list[str]:
    """Start-up lines: what the FP8 run does that a Megatron user might not expect."""
    if args.fp8_format is None:
        return []
    notes = []
    if args.fp8_interval is not None:
        notes.append(f"--fp8-interval {args.fp8_interval}: deprecated (Transformer Engine ignores it since "
                     "1.8); FP8 scales are updated after every optimizer step")
    if args.tp_comm_overlap:
        notes.append("--tp-comm-overlap with --fp8-format: the FP8 linears run without the overlap (its "
                     "chunked GEMMs are 16-bit only): the same numbers, the tensor-parallel communication "
                     "not hidden behind the GEMMs")
    if args.fp8_param_gather and args.use_torch_fsdp2:
        notes.append("--fp8-param-gather with --use-torch-fsdp2: each FP8 linear's weight shard is cast to FP8 with "
                     "its scale before FSDP2's all-gather (1 byte per element) and the gathered FP8 weight goes "
                     "straight to the GEMM; the optimizer's weights and checkpoints stay fp32")
    elif args.fp8_param_gather:
        notes.append("--fp8-param-gather: the parameters stay 16-bit and are all-gathered in 16-bit (twice the "
                     "bytes of an FP8 gather: FP8 all-gathers are served under --use-torch-fsdp2 only), each "
                     "GEMM quantizing the weight with its scale; the GEMMs run in FP8 either way")
    if args.fp8_recipe == "blockwise":
        notes.append(_blockwise_note(args))
    if args.num_experts:
        notes.append("--fp8-format with --num-experts: the routed experts' grouped GEMMs and the router stay "
                     "16-bit (no FP8 grouped GEMM); attention, dense and shared-expert linears run in FP8")
    if (args.fp8_recipe or "delayed") == "delayed" and args.first_last_layers_bf16:
        notes.append("--first-last-layers-bf16 with delayed scaling: Megatron refuses the pair (Transformer "
                     "Engine's global amax buffers); megalite keeps per-linear histories, so it runs")
    return notes


def _blockwise_note(args) -> str:
    """Where --fp8-recipe blockwise's GEMMs run (parallel/tensor/fp8_blockwise.py)."""
    where = "emulated (the operands dequantized with their block scales, multiplied in fp32)"
    if on_cpu(args):
        return f"--fp8-recipe blockwise on CPU: the block-scaled GEMMs are {where}"
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        return (f"--fp8-recipe blockwise: torch's block-scaled FP8 GEMM runs on Hopper (9.0) only; on this GPU "
                f"the GEMMs are {where}")
    return ("--fp8-recipe blockwise: GEMMs whose reduction dimension (the hidden size, the FFN size and the attention "
            f"width per tensor-parallel rank, the tokens of a micro-batch) is not a multiple of 128 are {where}")
