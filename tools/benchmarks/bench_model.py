"""Training throughput of megalite against Hugging Face transformers on one GPU, in bf16.

    python tools/benchmarks/bench_model.py                       # both models, every row
    python tools/benchmarks/bench_model.py --models llama-1.3b --micro-batch-size llama-1.3b=4
    python tools/benchmarks/bench_model.py --with-kernels        # also run bench_kernels.py
    python tools/benchmarks/bench_model.py --cpu-smoke           # tiny configs on the CPU

Models: GPT-2 124M at seq 1024 (12 layers, hidden 768, 12 heads, GeLU-tanh MLP 3072, learned
positions, tied embeddings, vocab 50257) and a Llama-style 1.3B at seq 2048 (24 layers, hidden
2048, 16 heads of 128 (MHA), SwiGLU MLP 5632 = 8/3 h rounded up to a multiple of 256, RMSNorm,
RoPE, untied embeddings, vocab 32000). Dropout off everywhere.

Rows per model: megalite with its Triton kernels (fused_kernels=True) and with the plain-torch
references (False), each eager and with --torch-compile (each transformer layer compiled, as
megalite/training/setup_run.py does), and the peer: transformers' GPT2LMHeadModel /
LlamaForCausalLM built from megalite.model.hf_mapping.hf_config_dict(config) (random weights,
nothing downloaded), attn_implementation="sdpa", the whole model torch.compile'd.

Identical work on both sides: bf16 parameters and gradients, one micro-batch per step of
forward + backward + torch.optim.AdamW(fused=True) on the bf16 parameters + zero_grad, same
batch and sequence, same tokens. (megalite's training keeps an fp32 master copy in its own
optimizer; that is left out here so that both sides run the same optimizer.) Each step is timed
between torch.cuda.synchronize calls; warm-up steps (compilation included) are excluded and the
median step is reported. On out-of-memory the model's micro-batch is halved and all its rows rerun.

FLOPs and MFU follow shared/docs/formulas.md through megalite.training.flops:
F_token = 6 P_mm + 12 L s h (attention non-causal, no recompute), MFU = F_token * tokens/s / peak
(989.4 TFLOP/s dense bf16 for H100 SXM and H200; no MFU for a device not in that table). Each
row counts its own output-layer width: megalite pads the vocabulary to a multiple of 128
(50257 -> 50304), transformers does not.

--cpu-smoke runs tiny configs of both families through every row on the CPU (Triton kernels in
Triton's interpreter, --compile-backend aot_eager by default there) to check the harness; its
numbers mean nothing and it has no MFU. Without --cpu-smoke and without a GPU it says so and
exits 0.
"""

import argparse
import datetime
import gc
import importlib.metadata
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from megalite.model.config import GPTConfig  # noqa: E402
from megalite.model.gpt import GPTModel, masked_mean_loss  # noqa: E402
from megalite.model.hf_mapping import family_of, hf_config_dict  # noqa: E402
from megalite.training.flops import flops_per_token, model_flops_utilization, peak_flops  # noqa: E402

PEER_SPEEDUP_TARGET = 1.2  # issue 7: >= 1.2x the peer's tokens/s


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: GPTConfig
    seq_length: int
    micro_batch: int
    mfu_target: float


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    megalite: bool
    fused_kernels: bool | None
    compiled: bool


ROWS = (
    Row("kernels", "megalite, Triton kernels", True, True, False),
    Row("no-kernels", "megalite, torch reference ops (fused_kernels=False)", True, False, False),
    Row("kernels-compile", "megalite, Triton kernels + --torch-compile", True, True, True),
    Row("no-kernels-compile", "megalite, torch reference ops + --torch-compile", True, False, True),
    Row("peer", "transformers {cls}, sdpa + torch.compile (peer)", False, None, True),
)


@dataclass
class Result:
    row: Row
    micro_batch: int
    step_s: float = math.nan
    tokens_per_s: float = math.nan
    tflops: float = math.nan
    mfu: float | None = None
    first_loss: float = math.nan
    last_loss: float = math.nan
    peak_gib: float | None = None
    params: int = 0
    error: str | None = None


def _gpt2(**shape) -> GPTConfig:
    return GPTConfig(activation="openai_gelu", attention_dropout=0.0, hidden_dropout=0.0, params_dtype="bfloat16",
                     **shape)


def _llama(**shape) -> GPTConfig:
    return GPTConfig(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                     add_bias_linear=False, untie_embeddings_and_output_weights=True, attention_dropout=0.0,
                     hidden_dropout=0.0, params_dtype="bfloat16", **shape)


def model_specs(smoke: bool) -> list[ModelSpec]:
    if smoke:  # tiny, with GQA on the Llama side so that path runs too
        return [ModelSpec("gpt2-tiny", _gpt2(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=500,
                                             max_position_embeddings=32), 32, 2, 0.45),
                ModelSpec("llama-tiny", _llama(num_layers=2, hidden_size=64, num_attention_heads=4,
                                               num_query_groups=2, ffn_hidden_size=176, vocab_size=500,
                                               max_position_embeddings=32), 32, 2, 0.55)]
    return [ModelSpec("gpt2-124m", _gpt2(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257,
                                         max_position_embeddings=1024), 1024, 32, 0.45),
            ModelSpec("llama-1.3b", _llama(num_layers=24, hidden_size=2048, num_attention_heads=16,
                                           ffn_hidden_size=5632, vocab_size=32000, max_position_embeddings=2048),
                      2048, 8, 0.55)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_model(config: GPTConfig, device: torch.device):
    import transformers

    values = {k: v for k, v in hf_config_dict(config).items() if k not in ("architectures", "torch_dtype")}
    hf_config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa",
                                                              dtype=torch.bfloat16)


def _compile_kwargs(args) -> dict:
    return {"backend": args.compile_backend, **({"mode": args.compile_mode} if args.compile_mode else {})}


def build_step(spec: ModelSpec, row: Row, device: torch.device, args):
    """(step(tokens, labels) -> detached loss, parameter count, output-layer width) for one row."""
    torch.manual_seed(0)
    if row.megalite:
        model = GPTModel(spec.config.replace(fused_kernels=row.fused_kernels), init_seed=1234, device=device)
        if row.compiled:  # what --torch-compile does (setup_run.py)
            for layer in model.layers.values():
                layer.compile(**_compile_kwargs(args))

        def loss_of(tokens, labels):
            return masked_mean_loss(model(tokens, labels=labels), None)
        width = model.padded_vocab
    else:
        model = _hf_model(spec.config, device)
        model.compile(**_compile_kwargs(args))

        def loss_of(tokens, labels):  # transformers shifts the labels itself: it takes the tokens
            return model(input_ids=tokens, labels=tokens, use_cache=False).loss
        width = spec.config.vocab_size
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step(tokens, labels):
        loss = loss_of(tokens, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step, sum(p.numel() for p in model.parameters()), width


def run_row(spec: ModelSpec, row: Row, micro_batch: int, device: torch.device, peak: float | None, args) -> Result:
    if args.simulate_oom_above is not None and micro_batch > args.simulate_oom_above:
        raise torch.OutOfMemoryError(f"simulated: micro-batch {micro_batch} > {args.simulate_oom_above}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step, params, width = build_step(spec, row, device, args)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, spec.config.vocab_size, (micro_batch, spec.seq_length + 1), generator=g).to(device)
    tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    losses = [step(tokens, labels) for _ in range(args.warmup)]
    times = []
    for _ in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        losses.append(step(tokens, labels))
        _sync(device)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_s = micro_batch * spec.seq_length / step_s
    f_token = flops_per_token(spec.config, spec.seq_length, width)
    return Result(row, micro_batch, step_s, tokens_per_s, f_token * tokens_per_s / 1e12,
                  model_flops_utilization(f_token, tokens_per_s, peak), float(losses[0]), float(losses[-1]),
                  torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None, params)


def _release(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()  # compiled graphs of the previous row go; no recompile limit across rows
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _is_oom(error: BaseException | None) -> bool:
    """Out of memory, also when torch.compile or a library re-raised it as another error."""
    while error is not None:
        if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
            return True
        error = error.__cause__
    return False


def run_model(spec: ModelSpec, rows: list[Row], device: torch.device, peak: float | None, args) -> list[Result]:
    """Every row at one micro-batch size; halved and rerun from the first row on out-of-memory."""
    micro_batch = args.micro_batch_size.get(spec.name, spec.micro_batch)
    while True:
        results, oom = [], None
        for row in rows:
            print(f"[{spec.name}] {row.key} (micro-batch {micro_batch}) ...", file=sys.stderr, flush=True)
            try:
                results.append(run_row(spec, row, micro_batch, device, peak, args))
            except Exception as e:  # noqa: BLE001 - one broken row must not lose the others
                first_line = (str(e).splitlines() or [""])[0][:200]
                if _is_oom(e):
                    oom = f"out of memory at micro-batch {micro_batch} in row {row.key}: {first_line}"
                else:
                    traceback.print_exc()
                    results.append(Result(row, micro_batch, error=f"{type(e).__name__}: {first_line}"))
            _release(device)
            if oom:
                break
        if oom is None:
            return results
        print(f"[{spec.name}] {oom}", file=sys.stderr, flush=True)
        if micro_batch == 1:
            return [Result(row, 1, error="out of memory at micro-batch 1") for row in rows]
        micro_batch //= 2


def _label(row: Row, spec: ModelSpec) -> str:
    return row.label.format(cls="GPT2LMHeadModel" if family_of(spec.config) == "gpt2" else "LlamaForCausalLM")


def table(specs: list[ModelSpec], results: dict[str, list[Result]]) -> str:
    header = ["model", "implementation", "batch x seq", "step ms", "tokens/s", "TFLOP/s", "MFU",
              "vs peer (tokens/s)", "loss first -> last", "peak GiB"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for spec in specs:
        peer = next((r for r in results[spec.name] if not r.row.megalite and r.error is None), None)
        for r in results[spec.name]:
            cells = [spec.name, _label(r.row, spec), f"{r.micro_batch} x {spec.seq_length}"]
            if r.error:
                cells += [f"failed: {r.error}"] + [""] * (len(header) - 4)
            else:
                cells += [f"{1e3 * r.step_s:.1f}", f"{r.tokens_per_s:,.0f}", f"{r.tflops:.2f}",
                          "n/a" if r.mfu is None else f"{100 * r.mfu:.1f}%",
                          f"{r.tokens_per_s / peer.tokens_per_s:.2f}x" if peer else "n/a",
                          f"{r.first_loss:.3f} -> {r.last_loss:.3f}",
                          "n/a" if r.peak_gib is None else f"{r.peak_gib:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(specs: list[ModelSpec], results: dict[str, list[Result]]) -> list[str]:
    """Pass/miss lines for the issue's targets, judged on the best megalite row."""
    out = []
    for spec in specs:
        ours = [r for r in results[spec.name] if r.row.megalite and r.error is None]
        peer = next((r for r in results[spec.name] if not r.row.megalite and r.error is None), None)
        if not ours:
            out.append(f"- {spec.name}: no megalite row ran: targets not evaluated")
            continue
        best = max(ours, key=lambda r: r.tokens_per_s)
        name = f'best megalite row "{_label(best.row, spec)}"'
        if best.mfu is None:
            out.append(f"- {spec.name}: MFU >= {100 * spec.mfu_target:.0f}%: n/a (no peak FLOP/s for this device)")
        else:
            verdict = "pass" if best.mfu >= spec.mfu_target else "MISS"
            out.append(f"- {spec.name}: MFU >= {100 * spec.mfu_target:.0f}%: {name} {100 * best.mfu:.1f}% -> {verdict}")
        if peer is None:
            out.append(f"- {spec.name}: tokens/s >= {PEER_SPEEDUP_TARGET}x peer: n/a (the peer row did not run)")
        else:
            ratio = best.tokens_per_s / peer.tokens_per_s
            verdict = "pass" if ratio >= PEER_SPEEDUP_TARGET else "MISS"
            out.append(f"- {spec.name}: tokens/s >= {PEER_SPEEDUP_TARGET}x peer: {name} {ratio:.2f}x -> {verdict}")
    return out


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report(specs, results, device, peak, args) -> str:
    smoke = args.cpu_smoke
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    title = ("megalite model benchmark: SMOKE RUN on the CPU (tiny configs; the numbers mean nothing; MFU n/a)"
             if smoke else f"megalite model benchmark on {device_name}")
    peak_text = f"{peak[0]} {peak[1] / 1e12:.1f} TFLOP/s dense bf16" if peak else "unknown for this device: no MFU"
    mode = f", mode {args.compile_mode}" if args.compile_mode else ""
    lines = [f"# {title}", "",
             f"- date: {datetime.date.today().isoformat()}; device: {device_name}; torch {torch.__version__} "
             f"(CUDA {torch.version.cuda or 'n/a'}); triton {_version('triton')}; "
             f"transformers {_version('transformers')}",
             f"- command: `{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}`",
             "- work per step, both sides: bf16 parameters and gradients, forward + backward + "
             "torch.optim.AdamW(fused=True) on the bf16 parameters (no fp32 master copy) + zero_grad, "
             "one micro-batch, same tokens, dropout off",
             f"- timing: {args.warmup} warm-up step(s) (compilation included) excluded, median of "
             f"{args.steps} step(s), each between torch.cuda.synchronize calls",
             "- peer: transformers' model built from megalite.model.hf_mapping.hf_config_dict(config) (random "
             'weights, nothing downloaded), attn_implementation="sdpa"',
             f"- compile: backend {args.compile_backend}{mode}; megalite --torch-compile compiles each transformer "
             "layer, the peer is compiled whole",
             "- FLOPs (shared/docs/formulas.md): F_token = 6 P_mm + 12 L s h, each row with its own output width "
             f"(megalite pads the vocabulary); MFU = F_token x tokens/s / peak; peak: {peak_text}"]
    for spec in specs:
        c = spec.config
        f_token = flops_per_token(c, spec.seq_length, c.padded_vocab_size(1))
        params = {("megalite" if r.row.megalite else "transformers"): r.params for r in results[spec.name] if r.params}
        lines.append(f"- {spec.name}: {c.num_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads "
                     f"({c.num_query_groups} kv groups), ffn {c.ffn_hidden_size} ({c.activation}), "
                     f"vocab {c.vocab_size}, seq {spec.seq_length}; F_token {f_token:.3e}; parameters "
                     + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in params.items()))
    lines += ["", table(specs, results), "",
              "Targets (smoke run: the verdicts mean nothing):" if smoke else "Targets (issue 7, one H100):"]
    lines += targets(specs, results)
    lines += ["", "Kernel bandwidth against the measured copy bandwidth: `python tools/benchmarks/bench_kernels.py` "
              "(or this script with --with-kernels)."]
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated subset (default all: gpt2-124m,llama-1.3b; "
                                         "gpt2-tiny,llama-tiny with --cpu-smoke)")
    parser.add_argument("--rows", default=",".join(r.key for r in ROWS), help="comma-separated subset of rows")
    parser.add_argument("--micro-batch-size", action="append", default=[], metavar="MODEL=B",
                        help="micro-batch size of one model (default gpt2-124m=32, llama-1.3b=8); repeatable")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; 1 with --cpu-smoke)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --cpu-smoke)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; "
                                                                "aot_eager with --cpu-smoke)")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode (inductor only), e.g. max-autotune-no-cudagraphs")
    parser.add_argument("--with-kernels", action="store_true", help="then run tools/benchmarks/bench_kernels.py")
    parser.add_argument("--output", type=Path, help="also write the markdown report to this file")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny configs on the CPU: checks the harness")
    parser.add_argument("--simulate-oom-above", type=int, default=None, metavar="B",
                        help="testing: raise out-of-memory for micro-batches above B (exercises the retry)")
    args = parser.parse_args(argv)
    specs = {s.name: s for s in model_specs(args.cpu_smoke)}
    names = args.models.split(",") if args.models else list(specs)
    if unknown := [n for n in names if n not in specs]:
        parser.error(f"--models: unknown {unknown}; choose from {sorted(specs)}")
    keys = args.rows.split(",")
    if unknown := [k for k in keys if k not in {r.key for r in ROWS}]:
        parser.error(f"--rows: unknown {unknown}; choose from {[r.key for r in ROWS]}")
    sizes = {}
    for item in args.micro_batch_size:
        name, _, value = item.partition("=")
        if name not in specs or not value.isdigit() or int(value) < 1:
            parser.error(f"--micro-batch-size {item!r}: expected MODEL=B with MODEL in {sorted(specs)} and B >= 1")
        sizes[name] = int(value)
    for flag in ("warmup", "steps"):
        if getattr(args, flag) is not None and getattr(args, flag) < (0 if flag == "warmup" else 1):
            parser.error(f"--{flag} must be at least {0 if flag == 'warmup' else 1}, got {getattr(args, flag)}")
    args.specs = [specs[n] for n in names]
    args.row_list = [r for r in ROWS if r.key in keys]
    args.micro_batch_size = sizes
    args.warmup = args.warmup if args.warmup is not None else (1 if args.cpu_smoke else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.cpu_smoke else 10)
    args.compile_backend = args.compile_backend or ("aot_eager" if args.cpu_smoke else "inductor")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        # Triton kernels run in Triton's interpreter on CPU tensors; must be set before megalite's
        # Triton modules are first imported (on the first kernel call).
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("bench_model: no CUDA device, nothing to time (--cpu-smoke runs the harness on tiny CPU configs)")
        return 0
    peak = peak_flops() if device.type == "cuda" else None
    results = {spec.name: run_model(spec, args.row_list, device, peak and peak[1], args) for spec in args.specs}
    text = report(args.specs, results, device, peak, args)
    print(text, flush=True)
    if args.output:
        tmp = args.output.with_name(args.output.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.output)
    status = 1 if any(r.error for rs in results.values() for r in rs) else 0
    if args.with_kernels:
        print("", flush=True)
        kernel_args = ["--cpu-smoke"] if args.cpu_smoke else []
        status |= subprocess.run([sys.executable, str(ROOT / "tools" / "benchmarks" / "bench_kernels.py"),
                                  *kernel_args], cwd=ROOT).returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
