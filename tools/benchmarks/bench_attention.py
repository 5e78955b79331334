"""Time scaled_dot_product_attention's kernels, one at a time, and the flash_attn package on one GPU.

    python tools/benchmarks/bench_attention.py [--quick] [--shapes driver,gpt2,mla,driver-dropout]
                                              [--write-table megalite/model/attention_kernels.py]
    python tools/benchmarks/bench_attention.py --cpu-smoke    # the harness on tiny CPU shapes

For each shape (causal, bf16, [b, heads, s, d] as SDPA takes them), each kernel runs alone
(sdpa_kernel([kernel])): CUDNN_ATTENTION, FLASH_ATTENTION (for values narrower than the
queries: padded to the query width, as --attention-backend flash runs them), EFFICIENT_ATTENTION,
flash_attn.flash_attn_func where installed, and megalite's --attention-backend auto and fused
(attention_kernels.kernel_order for this card). Forward and backward are timed apart (CUDA
events around each, median over the iterations); output and gradients are checked against the
math kernel in fp32 first (a kernel SDPA refuses says why, from torch's own warning).

FLOPs count causal attention's useful half: forward 2 b h s^2 (d_qk + d_v) / 2; backward
2 b h s^2 (3 d_qk + 2 d_v) / 2, the recomputed q k^T included (FlashAttention's count: 2.5x
the forward at one width). Each kernel's share of the card's dense bf16 peak
(megalite.training.flops.PEAK_BF16_FLOPS; "-" for cards not in it).

Then the measured order for attention_kernels.MEASURED: per head-width key, the SDPA kernels
that passed, fastest forward + backward first (the dropout shape is left out: its key is the
driver's); --write-table records this card's rows in that file.
"""

import argparse
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, without `pip install -e .`

from megalite.model.attention_backends import core_attention, pad_values  # noqa: E402
from megalite.model.attention_kernels import (CUDNN, EFFICIENT, FLASH, Call, card_of, chosen_kernel,  # noqa: E402
                                              kernel_order, rewrite_table, shape_key)
from megalite.training.flops import peak_flops  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    groups: int
    seq: int
    d_qk: int
    d_v: int
    dropout: float = 0.0

    def fwd_flops(self) -> float:
        return 2 * self.batch * self.heads * self.seq ** 2 * (self.d_qk + self.d_v) / 2

    def bwd_flops(self) -> float:
        return 2 * self.batch * self.heads * self.seq ** 2 * (3 * self.d_qk + 2 * self.d_v) / 2


SHAPES = {  # the issue-23 driver's Llama (b 2, 16 heads, 8 KV groups), GPT-2 small's, DeepSeek-V2-Lite's MLA widths
    "driver": Shape("driver", 2, 16, 8, 4096, 128, 128),
    "gpt2": Shape("gpt2", 8, 12, 12, 1024, 64, 64),
    "mla": Shape("mla", 2, 16, 16, 4096, 192, 128),
    "driver-dropout": Shape("driver-dropout", 2, 16, 8, 4096, 128, 128, dropout=0.1),  # Megatron's default
}
SMOKE_SHAPES = {"driver": Shape("driver", 1, 4, 2, 64, 16, 16), "mla": Shape("mla", 1, 4, 4, 64, 24, 16)}


def flash_attn_func():
    try:
        from flash_attn import flash_attn_func as fn
    except ImportError:
        return None
    return fn


def runners(shape: Shape, device: torch.device) -> dict:
    """label -> fn(q, k, v) -> out, for the kernels this device has."""
    scale, p, gqa = shape.d_qk ** -0.5, shape.dropout, shape.groups != shape.heads

    def sdpa(kernel, padded=False):
        def run(q, k, v):
            from torch.nn.attention import sdpa_kernel

            width = v.shape[-1]
            with sdpa_kernel([kernel]):
                out = F.scaled_dot_product_attention(q, k, pad_values(v, q.shape[-1]) if padded else v,
                                                     dropout_p=p, is_causal=True, scale=scale, enable_gqa=gqa)
            return out[..., :width]
        return run

    def megalite(backend):
        return lambda q, k, v: core_attention(q, k, v, None, backend=backend, dropout=p, scale=scale)

    if device.type == "cpu":
        return {"MATH": sdpa(torch.nn.attention.SDPBackend.MATH), "FLASH_ATTENTION": sdpa(FLASH, True),
                "megalite auto": megalite("auto")}
    found = {"CUDNN_ATTENTION": sdpa(CUDNN), "EFFICIENT_ATTENTION": sdpa(EFFICIENT)}
    found["FLASH_ATTENTION" + (" (v padded)" if shape.d_v != shape.d_qk else "")] = sdpa(FLASH, shape.d_v != shape.d_qk)
    package = flash_attn_func()
    if package is not None:
        def flash_attn(q, k, v):
            out = package(q.transpose(1, 2), k.transpose(1, 2), pad_values(v, q.shape[-1]).transpose(1, 2),
                          dropout_p=p, softmax_scale=scale, causal=True)
            return out[..., :v.shape[-1]].transpose(1, 2)
        found["flash_attn package"] = flash_attn
    found["megalite auto"] = megalite("auto")
    found["megalite fused"] = megalite("fused")
    return found


def inputs(shape: Shape, device, dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(shape.batch, shape.heads, shape.seq, shape.d_qk, device=device, dtype=dtype, generator=gen)
    k = torch.randn(shape.batch, shape.groups, shape.seq, shape.d_qk, device=device, dtype=dtype, generator=gen)
    v = torch.randn(shape.batch, shape.groups, shape.seq, shape.d_v, device=device, dtype=dtype, generator=gen)
    grad = torch.randn(shape.batch, shape.heads, shape.seq, shape.d_v, device=device, dtype=dtype, generator=gen)
    return [t.requires_grad_() for t in (q, k, v)], grad


def forward_backward(fn, qkv, grad):
    for t in qkv:
        t.grad = None
    out = fn(*qkv)
    out.backward(grad)
    return out.detach().float(), [t.grad.float() for t in qkv]


def math_reference(shape: Shape, qkv, grad) -> list[torch.Tensor]:
    """Output and gradients of the math kernel in fp32."""
    ref_in = [t.detach().float().requires_grad_() for t in qkv]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, scale=shape.d_qk ** -0.5,
                                         enable_gqa=shape.groups != shape.heads)
    ref.backward(grad.float())
    return [ref.detach(), *[t.grad for t in ref_in]]


def check(fn, shape: Shape, qkv, grad, reference: list[torch.Tensor] | None) -> str:
    """"ok", the largest error against `reference` (math_reference) where over tolerance, or why
    SDPA refused the kernel."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out, grads = forward_backward(fn, qkv, grad)
        except Exception as error:  # noqa: BLE001 (any kernel's failure is a row, not the end of the run)
            why = [str(w.message).split("\n")[0] for w in caught]
            return "refused: " + ("; ".join(why[:2]) or str(error).split("\n")[0])[:160]
    if reference is None:
        return "ok (dropout: not compared)"
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
                for a, b in zip([out, *grads], reference))
    return "ok" if worst < 2e-2 else f"relative error {worst:.1e}"


def time_ms(fn, qkv, grad, device, iters: int) -> tuple[float, float]:
    """Median forward and backward milliseconds."""
    fwd, bwd = [], []
    for _ in range(iters):
        for t in qkv:
            t.grad = None
        if device.type == "cuda":
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
            out = fn(*qkv)
            marks[1].record()
            out.backward(grad)
            marks[2].record()
            torch.cuda.synchronize(device)
            fwd.append(marks[0].elapsed_time(marks[1]))
            bwd.append(marks[1].elapsed_time(marks[2]))
        else:
            import time

            t0 = time.perf_counter()
            out = fn(*qkv)
            t1 = time.perf_counter()
            out.backward(grad)
            fwd.append((t1 - t0) * 1e3)
            bwd.append((time.perf_counter() - t1) * 1e3)
    return statistics.median(fwd), statistics.median(bwd)


def measure(shapes, device, dtype, iters: int, peak: float | None) -> tuple[list[str], dict]:
    """The table's rows and, per shape, {label: (fwd ms, bwd ms)} of the kernels that passed."""
    rows, passed = [], {}
    for shape in shapes:
        qkv, grad = inputs(shape, device, dtype)
        passed[shape.name] = {}
        reference = math_reference(shape, qkv, grad) if shape.dropout == 0 else None
        for label, fn in runners(shape, device).items():
            verdict = check(fn, shape, qkv, grad, reference)
            if not verdict.startswith("ok"):
                rows.append(f"| {shape.name} | {label} | - | - | - | - | - | - | {verdict} |")
                continue
            fwd, bwd = time_ms(fn, qkv, grad, device, iters)
            passed[shape.name][label] = (fwd, bwd)
            tf = [shape.fwd_flops() / fwd / 1e9, shape.bwd_flops() / bwd / 1e9]  # TFLOP/s
            share = [f"{100 * t * 1e12 / peak:.0f}%" if peak else "-" for t in tf]
            rows.append(f"| {shape.name} | {label} | {fwd:.3f} | {bwd:.3f} | {tf[0]:.1f} | {tf[1]:.1f} | {share[0]} | "
                        f"{share[1]} | {verdict} |")
    return rows, passed


def measured_order(shapes, passed) -> dict[str, tuple[str, ...]]:
    """attention_kernels.MEASURED rows: SDPA's kernels that passed, fastest forward + backward first."""
    rows = {}
    for shape in shapes:
        if shape.dropout > 0:
            continue
        timed = {label: sum(ms) for label, ms in passed[shape.name].items() if label in ("CUDNN_ATTENTION",
                                                                                        "FLASH_ATTENTION",
                                                                                        "EFFICIENT_ATTENTION")}
        if timed:
            key = shape_key(Call(torch.bfloat16, shape.d_qk, shape.d_v, shape.seq, shape.seq, 0.0, False, True))
            rows[key] = tuple(sorted(timed, key=timed.get))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--quick", action="store_true", help="5 timed iterations instead of 20")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (the harness only)")
    parser.add_argument("--write-table", metavar="ATTENTION_KERNELS_PY",
                        help="record this card's measured order in that file's MEASURED")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        device, dtype, shapes, iters = torch.device("cpu"), torch.float32, list(SMOKE_SHAPES.values()), 2
        card_name, peak = "CPU", None
    else:
        if not torch.cuda.is_available():
            print("bench_attention: no CUDA GPU here, nothing to measure (--cpu-smoke checks the harness)")
            return 0
        unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
        if unknown:
            print(f"bench_attention: --shapes: unknown {','.join(unknown)} (known: {','.join(SHAPES)})", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
        shapes, iters = [SHAPES[s] for s in args.shapes.split(",")], 5 if args.quick else 20
        card_name = torch.cuda.get_device_name(device)
        found = peak_flops(card_name)
        peak = found[1] if found else None
    card = card_of(device.index) if device.type == "cuda" else None
    print(f"card: {card_name}; torch {torch.__version__}; cuDNN {torch.backends.cudnn.version()}; "
          f"flash_attn {'installed' if flash_attn_func() else 'not installed'}; "
          f"bf16 peak {peak / 1e12:.1f} TFLOP/s" if peak else f"card: {card_name}; torch {torch.__version__}; no peak")
    rows, passed = measure(shapes, device, dtype, iters, peak)
    print("\n| shape | kernel | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd % peak | bwd % peak | check |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    if card is not None:
        for shape in shapes:
            call = Call(dtype, shape.d_qk, shape.d_v, shape.seq, shape.seq, shape.dropout, False, True)
            for backend in ("auto", "fused"):
                kernel, refused = chosen_kernel(kernel_order(backend, card, call), card, call)
                why = "; ".join(f"{k.name}: {reason}" for k, reason, _ in refused)
                print(f"megalite {backend} on {shape.name}: {kernel.name}" + (f" ({why})" if why else ""))
    order = measured_order(shapes, passed)
    print(f"measured order for attention_kernels.MEASURED[{card_name!r}]: {order}")
    if args.write_table and device.type == "cuda" and order:
        rewrite_table(args.write_table, card_name, order)
        print(f"wrote {card_name}'s rows into {args.write_table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
