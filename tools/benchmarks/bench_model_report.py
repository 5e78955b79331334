"""What tools/benchmarks/bench_model.py measures (models, rows, results) and its markdown report."""

import datetime
import importlib.metadata
import math
import shlex
import sys
from dataclasses import dataclass

import torch

from megalite.model.config import GPTConfig
from megalite.checkpoint.hf.mapping import family_of
from megalite.training.flops import flops_per_token

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


# In this order: the rows the targets are judged on come first, so that a run cut short by
# --time-limit has them.
ROWS = (
    Row("kernels", "megalite, Triton kernels", True, True, False),
    Row("kernels-compile", "megalite, Triton kernels + --torch-compile", True, True, True),
    Row("peer", "transformers {cls}, sdpa + torch.compile (peer)", False, None, True),
    Row("no-kernels", "megalite, torch reference ops (fused_kernels=False)", True, False, False),
    Row("no-kernels-compile", "megalite, torch reference ops + --torch-compile", True, False, True),
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
    skipped: str | None = None  # why the row was not run (time limit)
    oom_at: int | None = None  # the micro-batch that ran out of memory before this one ran
    wall_s: float = math.nan  # build + compile + warm-up + timed steps

    @property
    def measured(self) -> bool:
        return self.error is None and self.skipped is None


def label(row: Row, spec: ModelSpec) -> str:
    return row.label.format(cls="GPT2LMHeadModel" if family_of(spec.config) == "gpt2" else "LlamaForCausalLM")


def _peer(results: list[Result]) -> Result | None:
    return next((r for r in results if not r.row.megalite and r.measured), None)


def progress_line(spec: ModelSpec, r: Result) -> str:
    """One line per finished row (stderr), so that a run killed later still shows it."""
    head = f"[{spec.name}] {r.row.key}: "
    if not r.measured:
        return head + (f"not run ({r.skipped})" if r.skipped else f"failed: {r.error}")
    mfu = "n/a" if r.mfu is None else f"{100 * r.mfu:.1f}%"
    peak = "" if r.peak_gib is None else f", peak {r.peak_gib:.1f} GiB"
    return (head + f"{r.micro_batch} x {spec.seq_length}, {1e3 * r.step_s:.1f} ms/step, {r.tokens_per_s:,.0f} tokens/s, "
            f"{r.tflops:.1f} TFLOP/s, MFU {mfu}{peak} (row took {r.wall_s:.0f} s)")


def table(specs: list[ModelSpec], results: dict[str, list[Result]]) -> str:
    header = ["model", "implementation", "batch x seq", "step ms", "tokens/s", "TFLOP/s", "MFU",
              "vs peer (tokens/s)", "loss first -> last", "peak GiB"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for spec in specs:
        peer = _peer(results[spec.name])
        for r in results[spec.name]:
            cells = [spec.name, label(r.row, spec), f"{r.micro_batch} x {spec.seq_length}"]
            if r.skipped:
                cells += [f"not measured: {r.skipped}"] + [""] * (len(header) - 4)
            elif r.error:
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
        ours = [r for r in results[spec.name] if r.row.megalite and r.measured]
        peer = _peer(results[spec.name])
        if not ours:
            out.append(f"- {spec.name}: no megalite row ran: targets not evaluated")
            continue
        best = max(ours, key=lambda r: r.tokens_per_s)
        name = f'best megalite row "{label(best.row, spec)}"'
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


def _run_notes(specs: list[ModelSpec], results: dict[str, list[Result]]) -> list[str]:
    notes = []
    for spec in specs:
        for r in results[spec.name]:
            if r.oom_at is not None and r.measured:
                notes.append(f"- {spec.name} / {r.row.key}: out of memory at micro-batch {r.oom_at}; measured at "
                             f"{r.micro_batch} (tokens/s and MFU compare across batch sizes, step ms does not)")
        walls = [f"{r.row.key} {r.wall_s:.0f} s" for r in results[spec.name] if not math.isnan(r.wall_s)]
        if walls:
            notes.append(f"- {spec.name} wall time per row (build, compile, warm-up, timed steps): {', '.join(walls)}")
    return notes


def report(specs, results, device, peak, args, kernels_text: str | None = None) -> str:
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
             "- peer: transformers' model built from megalite.checkpoint.hf.mapping.hf_config_dict(config) (random "
             'weights, nothing downloaded), attn_implementation="sdpa"',
             f"- compile: backend {args.compile_backend}{mode}; megalite --torch-compile compiles the embedding, "
             "each transformer layer and the output layer with the loss (GPTModel.compile_regions), the peer "
             "is compiled whole",
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
    lines += ["", table(specs, results), ""] + _run_notes(specs, results)
    lines += ["", "Targets (smoke run: the verdicts mean nothing):" if smoke else "Targets (issue 7, one H100):"]
    lines += targets(specs, results)
    if kernels_text is None:
        lines += ["", "Kernel bandwidth against the measured copy bandwidth: not run here (--skip-kernels); "
                      "`python tools/benchmarks/bench_kernels.py`."]
    else:
        lines += ["", kernels_text.rstrip()]
    return "\n".join(lines)
