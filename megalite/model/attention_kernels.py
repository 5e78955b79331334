"""Which of scaled_dot_product_attention's CUDA kernels serves --attention-backend auto and fused.

SDPA runs under `sdpa_kernel(order, set_priority=True)`: torch takes the first kernel of `order`
that its own checks accept. `kernel_order` gives that order:

    fused   cuDNN, then memory-efficient (Megatron's fused attention is Transformer Engine's cuDNN
            kernel)
    auto    the fastest first, as tools/benchmarks/bench_attention.py measured them on this card
            (MEASURED, keyed by torch.cuda.get_device_name and the head widths); on a card without
            a measured row: cuDNN, flash, memory-efficient on sm90 / sm100 (cuDNN's Hopper and
            Blackwell kernels; FlashAttention-2 ran at ~22% of an H200's bf16 peak), else flash,
            memory-efficient, cuDNN (torch's own order); the math kernel last

`refusal` repeats torch's checks (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
can_use_*_attention) for what a training run can vary: dtype, head widths, mask, dropout, card,
cuDNN version, deterministic mode; `start_up_line` turns the first choice's refusal into one line
naming the flags, printed once at start-up instead of a silent fall to a slower kernel (Megatron's
default --attention-dropout 0.1 is one: cuDNN takes dropout in steps of 1/16 only).
"""

import functools
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

CUDNN, FLASH = SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION
EFFICIENT, MATH = SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH

# device name -> f"qk{d_qk}-v{d_v}" -> kernel names, fastest first (forward + backward, bf16, causal);
# bench_attention.py --write-table rewrites it, keeping other cards' rows.
MEASURED: dict[str, dict[str, tuple[str, ...]]] = {}
# (end of the measured table)


@dataclass(frozen=True)
class Card:
    """What SDPA's kernel checks read of a CUDA device."""
    name: str
    capability: tuple[int, int]
    cudnn: int | None  # torch.backends.cudnn.version(), 91002 for 9.10.2; None: torch without cuDNN
    deterministic: bool = False  # torch.use_deterministic_algorithms(True) without warn_only

    @property
    def sm(self) -> int:
        return self.capability[0] * 10 + self.capability[1]


@dataclass(frozen=True)
class Call:
    """One attention call's properties that decide the kernel (tensors [b, heads, s, d])."""
    dtype: torch.dtype
    d_qk: int
    d_v: int
    seq_q: int
    seq_k: int
    dropout: float
    masked: bool  # an explicit mask; False: causal
    grad: bool  # backward will run


def card_of(index: int | None) -> Card | None:
    """The card of CUDA device `index` (None: the current one), or None where there is none (fake
    CUDA in a dry run); asked once, and under torch.compile a constant of the graph (as
    megalite.kernels.speed_table's lookup)."""
    return _card_at(index)


card_of._dynamo_marked_constant = True


@functools.lru_cache(maxsize=None)
def _card_at(index: int | None) -> Card | None:
    try:
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    except (RuntimeError, AssertionError, AttributeError):
        return None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return Card(props.name, (props.major, props.minor), cudnn)


def call_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, dropout: float) -> Call:
    return Call(q.dtype, q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2], float(dropout), mask is not None,
                torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))


def shape_key(call: Call) -> str:
    return f"qk{call.d_qk}-v{call.d_v}"


def default_order(card: Card | None) -> tuple:
    if card is not None and card.capability[0] in (9, 10):
        return (CUDNN, FLASH, EFFICIENT)
    return (FLASH, EFFICIENT, CUDNN)


def kernel_order(backend: str, card: Card | None, call: Call,
                 measured: dict[str, dict[str, tuple[str, ...]]] | None = None) -> tuple:
    """SDPA's kernels for `backend` ("auto" or "fused") on a CUDA card, in priority order."""
    if backend == "fused":
        return (CUDNN, EFFICIENT)
    table = MEASURED if measured is None else measured
    row = table.get(card.name, {}).get(shape_key(call)) if card is not None else None
    order = tuple(getattr(SDPBackend, name) for name in row) if row else default_order(card)
    return order + tuple(k for k in (CUDNN, FLASH, EFFICIENT) if k not in order) + (MATH,)


def _in_sm_range(card: Card, low: int, high: int = 121) -> bool:
    return low <= card.sm <= high


def _cudnn_refusal(card: Card, call: Call) -> tuple[str, str] | None:
    if card.cudnn is None or card.cudnn < 90000:
        return "torch without cuDNN 9", ""
    if not _in_sm_range(card, 80):
        return f"sm{card.sm}, cuDNN attention needs sm80 to sm121", ""
    if card.deterministic:
        return "cuDNN attention is not deterministic", "--deterministic-mode"
    if call.dtype not in (torch.float16, torch.bfloat16):
        return f"{str(call.dtype)[6:]}, cuDNN attention takes fp16 / bf16 only", "without --bf16 / --fp16"
    if call.dropout > 0 and 91100 < card.cudnn < 91400:
        return f"cuDNN {card.cudnn} (9.11 to 9.13) has no attention dropout", f"--attention-dropout {call.dropout:g}"
    if call.dropout * 16 != int(call.dropout * 16):
        return (f"dropout {call.dropout:g} is not a multiple of 1/16, the only dropout cuDNN attention takes",
                f"--attention-dropout {call.dropout:g}")
    hopper_or_blackwell = card.capability == (9, 0) or card.capability[0] == 10
    widths = (call.d_qk, call.d_v)
    limit = 128
    if hopper_or_blackwell and card.cudnn > 92200:
        limit = 256
    elif hopper_or_blackwell and card.cudnn >= 91100 and widths == (192, 128):
        limit = 192
    if max(widths) > limit or call.d_qk % 8 or call.d_v % 8:
        return (f"head widths q/k {call.d_qk}, v {call.d_v}: cuDNN attention takes multiples of 8 up to {limit} "
                "here", "--kv-channels")
    if call.grad and limit == 256 and not (max(widths) <= 128 or widths in ((192, 128), (256, 256))):
        return f"head widths q/k {call.d_qk}, v {call.d_v}: cuDNN has no backward for them", "--kv-channels"
    if call.seq_k == 1:
        return "one key position", ""
    return None


def _flash_refusal(card: Card, call: Call) -> tuple[str, str] | None:
    if not _in_sm_range(card, 80):
        return f"sm{card.sm}, flash attention needs sm80 to sm121", ""
    if call.dtype not in (torch.float16, torch.bfloat16):
        return f"{str(call.dtype)[6:]}, flash attention takes fp16 / bf16 only", "without --bf16 / --fp16"
    if call.masked:
        return "flash attention takes no attention mask", "--reset-attention-mask"
    if call.d_qk != call.d_v or call.d_qk > 256:
        return f"head widths q/k {call.d_qk}, v {call.d_v}: flash attention needs one width up to 256", ""
    if call.grad and (_in_sm_range(card, 86, 89) or _in_sm_range(card, 120)) and (
            192 < call.d_qk <= 224 or (call.d_qk > 224 and call.dropout > 0)):
        return f"head width {call.d_qk}: no flash backward on sm{card.sm}", "--kv-channels"
    return None


def _efficient_refusal(card: Card, call: Call) -> tuple[str, str] | None:
    if not _in_sm_range(card, 50):
        return f"sm{card.sm}, memory-efficient attention needs sm50 to sm121", ""
    half = call.dtype in (torch.float16, torch.bfloat16)
    align = 4 if card.sm >= 80 else 1  # torch's minimum_gemm_alignment: 128 bits where tensor cores run
    if card.sm >= 80 or (card.sm >= 70 and half):
        align = max(align, 8 if half else 4)
    if call.d_qk % align or call.d_v % align:
        return f"head widths q/k {call.d_qk}, v {call.d_v}: memory-efficient attention needs multiples of {align}", ""
    if call.dtype == torch.bfloat16 and card.sm < 80:
        return "bf16 before sm80", ""
    return None


_REFUSALS = {CUDNN: _cudnn_refusal, FLASH: _flash_refusal, EFFICIENT: _efficient_refusal}


def refusal(kernel: SDPBackend, card: Card, call: Call) -> tuple[str, str] | None:
    """(why, the flag that decides it or "") where `kernel` cannot take `call` on `card`; None if it can."""
    check = _REFUSALS.get(kernel)
    return None if check is None else check(card, call)


def chosen_kernel(order: tuple, card: Card, call: Call) -> tuple[SDPBackend, list]:
    """The kernel SDPA will run for `order`, and the (kernel, why, flag) refused before it."""
    refused = []
    for kernel in order:
        why = refusal(kernel, card, call)
        if why is None:
            return kernel, refused
        refused.append((kernel, *why))
    return MATH, refused


def start_up_line(backend: str, card: Card | None, call: Call) -> str | None:
    """One line when the first kernel of `backend`'s order cannot take the run's attention, naming
    the flag values and the kernel that serves it instead; None when the first one serves it."""
    if backend not in ("auto", "fused") or card is None:
        return None
    order = kernel_order(backend, card, call)
    kernel, refused = chosen_kernel(order, card, call)
    if not refused:
        return None
    first, why, flag = refused[0]
    flags = f"--attention-backend {backend}" + (f" {flag}" if flag else "")
    hint = ""
    if flag.startswith("--attention-dropout") and "1/16" in why:
        lower, upper = int(call.dropout * 16) / 16, (int(call.dropout * 16) + 1) / 16
        hint = f" (--attention-dropout {lower:g} or {upper:g} would keep {first.name})"
    return f"{flags} on {card.name}: {first.name} cannot take this attention ({why}); it runs {kernel.name}{hint}"


def training_call(config, seq_length: int, dtype: torch.dtype, masked: bool) -> Call:
    """The attention call of a training run of GPTConfig `config` (MLA: its unequal widths)."""
    d_qk = d_v = config.kv_channels
    if config.mla is not None:
        d_qk, d_v = config.mla.q_head_dim, config.mla.v_head_dim
    return Call(dtype, d_qk, d_v, seq_length, seq_length, float(config.attention_dropout), masked, True)


def run_start_up_line(config, device: torch.device, *, seq_length: int, dtype: torch.dtype, masked: bool,
                      deterministic: bool, context_parallel: int) -> str | None:
    """start_up_line for a training run on `device` (None off CUDA, under context parallelism
    and with --use-flash-attn, which do not run core attention through SDPA's dispatch)."""
    if device.type != "cuda" or context_parallel > 1 or config.use_flash_attn:
        return None
    card = card_of(device.index)
    if card is None:
        return None
    card = Card(card.name, card.capability, card.cudnn, deterministic)
    return start_up_line(config.attention_backend, card, training_call(config, seq_length, dtype, masked))


def render_table(measured: dict[str, dict[str, tuple[str, ...]]]) -> str:
    """The MEASURED assignment as this file holds it (sorted, one row a line)."""
    if not measured:
        return "MEASURED: dict[str, dict[str, tuple[str, ...]]] = {}"
    lines = ["MEASURED: dict[str, dict[str, tuple[str, ...]]] = {"]
    for card in sorted(measured):
        lines.append(f"    {card!r}: {{")
        lines += [f"        {key!r}: {tuple(order)!r}," for key, order in sorted(measured[card].items())]
        lines.append("    },")
    return "\n".join(lines + ["}"])


def rewrite_table(path: str, card: str, rows: dict[str, tuple[str, ...]]) -> None:
    """Replace `card`'s rows of MEASURED in the attention_kernels.py at `path` by `rows` (other
    cards' rows kept; written beside it first, then moved over it whole)."""
    import ast
    import os

    with open(path, encoding="utf-8") as f:
        source = f.read()
    start = source.index("MEASURED: dict[str, dict[str, tuple[str, ...]]] = ")
    end = source.index("# (end of the measured table)")
    table = ast.literal_eval(source[start:end].split("=", 1)[1].strip())
    table[card] = {key: tuple(order) for key, order in rows.items()}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(source[:start] + render_table(table) + "\n" + source[end:])
    os.replace(tmp, path)
