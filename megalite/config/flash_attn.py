"""--use-flash-attn: who serves it.

Megatron-LM (d98e8a6) still parses --use-flash-attn but nothing reads it: its attention is
--attention-backend's (auto: Transformer Engine's choice, FlashAttention or cuDNN). A Megatron user
who gives it asks for FlashAttention, so megalite decides once, at validation
(args.flash_attn_served_by):

    flash_attn   the package is installed and the run is on CUDA: flash_attn's kernels
    sdpa_cuda    not installed, CUDA run: scaled_dot_product_attention's FLASH_ATTENTION kernel
                 (the same FlashAttention-2 algorithm), as --attention-backend flash
    sdpa_cpu     CPU run (gloo or no CUDA; flash_attn has no CPU kernels): scaled_dot_product_attention's
                 own choice on CPU, as --attention-backend auto

An explicit --attention-backend other than auto is kept where SDPA serves (it decides in Megatron).
Whenever SDPA serves, one start-up line says so and what to install (`flash_attn_note`).
"""

import importlib.util

import torch

INSTALL = "pip install flash-attn"


def flash_attn_served_by(args, *, installed: bool | None = None, cuda: bool | None = None) -> str | None:
    """flash_attn, sdpa_cuda or sdpa_cpu for a --use-flash-attn run (None without the flag).
    `installed`, `cuda`: this machine's, unless given."""
    if not args.use_flash_attn:
        return None
    installed = importlib.util.find_spec("flash_attn") is not None if installed is None else installed
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if args.distributed_backend == "gloo" or not cuda:
        return "sdpa_cpu"
    return "flash_attn" if installed else "sdpa_cuda"


def served_backend(args) -> str:
    """The --attention-backend the model runs: flash in place of auto where SDPA serves
    --use-flash-attn on CUDA, else the one given."""
    if args.flash_attn_served_by == "sdpa_cuda" and args.attention_backend == "auto":
        return "flash"
    return args.attention_backend


def uses_flash_attn_package(args) -> bool:
    return args.flash_attn_served_by == "flash_attn"


def check_flash_attn_args(args, fail, *, installed: bool | None = None, cuda: bool | None = None) -> None:
    """Decide who serves --use-flash-attn and refuse what that flash kernel cannot take on CUDA
    (fp32, an attention mask) before the first forward would."""
    args.flash_attn_served_by = flash_attn_served_by(args, installed=installed, cuda=cuda)
    sdpa_flash = args.flash_attn_served_by == "sdpa_cuda" and served_backend(args) == "flash"
    if not (uses_flash_attn_package(args) or sdpa_flash):
        return  # SDPA's own choice on CPU, or the --attention-backend given
    who = "flash_attn" if uses_flash_attn_package(args) else "scaled_dot_product_attention's flash kernel"
    if not (args.bf16 or args.fp16):
        fail(f"--use-flash-attn needs --bf16 or --fp16 on CUDA ({who} has no fp32 kernels)")
    if args.reset_attention_mask:
        fail(f"--use-flash-attn and --reset-attention-mask contradict each other ({who} takes no attention mask)")


def flash_attn_note(args) -> list[str]:
    """The start-up line of a --use-flash-attn run that scaled_dot_product_attention serves."""
    served_by = args.flash_attn_served_by
    if served_by not in ("sdpa_cuda", "sdpa_cpu"):
        return []
    if served_by == "sdpa_cpu":
        where = "--distributed-backend gloo" if args.distributed_backend == "gloo" else "no CUDA device"
        why = f"this run is on CPU ({where}), where flash_attn has no kernels"
    else:
        why = "the flash_attn package is not installed"
    backend = served_backend(args)
    if backend == "flash":
        how = ("scaled_dot_product_attention's FLASH_ATTENTION kernel serves attention (the same "
               "FlashAttention-2 algorithm, as --attention-backend flash)")
    elif backend == "auto":
        how = "scaled_dot_product_attention's own choice on CPU serves attention (as --attention-backend auto)"
    else:
        how = f"--attention-backend {backend} serves attention, as given"
    return [f"--use-flash-attn: {why}, so {how}; flash_attn's own kernels need a CUDA run with the "
            f"package installed ({INSTALL})"]
