"""Training throughput of megalite against Hugging Face transformers on one GPU, in bf16, and the
Triton kernels' bandwidth: one command for issue 7's whole table.

    python tools/benchmarks/bench_model.py --output bench.md           # everything (GPU)
    python tools/benchmarks/bench_model.py --time-limit 540 --output bench.md   # fits a 10-minute slot
    python tools/benchmarks/bench_model.py --models llama-1.3b --skip-kernels --micro-batch-size llama-1.3b=4
    python tools/benchmarks/bench_model.py --cpu-smoke                 # tiny configs on the CPU

First the kernel benchmark (tools/benchmarks/bench_kernels.py in a process of its own: each
Triton kernel against its torch reference, achieved bandwidth against the measured copy
bandwidth; --skip-kernels leaves it out, --kernel-ops picks ops), then the models, and one
markdown report with both at the end (also written to --output after every row).

Models: GPT-2 124M at seq 1024 (12 layers, hidden 768, 12 heads, GeLU-tanh MLP 3072, learned
positions, tied embeddings, vocab 50257) and a Llama-style 1.3B at seq 2048 (24 layers, hidden
2048, 16 heads of 128 (MHA), SwiGLU MLP 5632 = 8/3 h rounded up to a multiple of 256, RMSNorm,
RoPE, untied embeddings, vocab 32000). Dropout off everywhere.

Rows per model, in this order: megalite with its Triton kernels (fused_kernels=True) eager and
with --torch-compile (GPTModel.compile_regions, the driver's own call: the embedding, each
transformer layer and the output layer with the loss compiled),
the peer: transformers' GPT2LMHeadModel / LlamaForCausalLM built from
megalite.checkpoint.hf.mapping.hf_config_dict(config) (random weights, nothing downloaded),
attn_implementation="sdpa", the whole model torch.compile'd; then megalite with the plain-torch
reference ops (False), eager and compiled.

Identical work on both sides: bf16 parameters and gradients, one micro-batch per step of
forward + backward + torch.optim.AdamW(fused=True) on the bf16 parameters + zero_grad, same
batch and sequence, same tokens. (megalite's training keeps an fp32 master copy in its own
optimizer; that is left out here so that both sides run the same optimizer.) Each step is timed
between torch.cuda.synchronize calls; warm-up steps (compilation included) are excluded and the
median step is reported. A row that runs out of memory is rerun at half the micro-batch (the
report says so); the other rows keep theirs.

FLOPs and MFU follow shared/docs/formulas.md through megalite.training.flops:
F_token = 6 P_mm + 12 L s h (attention non-causal, no recompute), MFU = F_token * tokens/s / peak
(989.4 TFLOP/s dense bf16 for H100 SXM and H200; no MFU for a device not in that table, such as
"NVIDIA H100 PCIe" or "NVIDIA H100 NVL"). Each row counts its own output-layer width: megalite
pads the vocabulary to a multiple of 128 (50257 -> 50304), transformers does not.

Run time on one H100 (an estimate, not yet measured: compilation dominates): the kernel
benchmark 1-2 min, GPT-2 3-4 min, the 1.3B model 4-6 min, so 8-12 min for everything. Where a
command may run 10 minutes at most, pass --time-limit (a row starts only if the time so far plus
the longest row so far fits; rows left out say "not measured") or split the run:
`--models gpt2-124m` then `--models llama-1.3b --skip-kernels`. --quick takes fewer steps.

--cpu-smoke runs tiny configs of both families through every row on the CPU (Triton kernels in
Triton's interpreter, --compile-backend aot_eager by default there) and the kernel benchmark's
CPU smoke mode, to check the harness; its numbers mean nothing and it has no MFU. Without
--cpu-smoke and without a GPU it says so and exits 0.
"""

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

from bench_kernels import OPS as KERNEL_OPS  # noqa: E402
from bench_model_report import (  # noqa: E402,F401 - table and targets are part of this script's interface
    ROWS, ModelSpec, Result, Row, progress_line, report, table, targets,
)

from megalite.model.config import GPTConfig  # noqa: E402
from megalite.model.gpt import GPTModel, masked_mean_loss  # noqa: E402
from megalite.checkpoint.hf.mapping import hf_config_dict  # noqa: E402
from megalite.training.flops import flops_per_token, model_flops_utilization, peak_flops  # noqa: E402


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
        if row.compiled:  # what --torch-compile does (megalite/training/setup_run.py)
            model.compile_regions(**_compile_kwargs(args))

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


class Clock:
    """Elapsed time of the run against --time-limit."""

    def __init__(self, limit_s: float | None):
        self.start, self.limit_s, self.longest_row_s = time.monotonic(), limit_s, 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def reason_to_skip(self) -> str | None:
        if self.limit_s is not None and self.elapsed() + self.longest_row_s > self.limit_s:
            return f"--time-limit {self.limit_s:.0f} s reached"
        return None


def run_model(spec: ModelSpec, rows: list[Row], device: torch.device, peak: float | None, args,
              on_result=None) -> list[Result]:
    """Every row at the model's micro-batch; a row that runs out of memory is rerun at half of it.
    `on_result(results so far)` is called after each row."""
    clock = args.clock
    start_batch = args.micro_batch_size.get(spec.name, spec.micro_batch)
    results = []
    for row in rows:
        micro_batch, oom_at, started = start_batch, None, time.monotonic()
        skip = clock.reason_to_skip()
        result = Result(row, micro_batch, skipped=skip) if skip else None
        while result is None:
            print(f"[{spec.name}] {row.key} (micro-batch {micro_batch}) ...", file=sys.stderr, flush=True)
            try:
                result = run_row(spec, row, micro_batch, device, peak, args)
            except Exception as e:  # noqa: BLE001 - one broken row must not lose the others
                first_line = (str(e).splitlines() or [""])[0][:200]
                if not _is_oom(e):
                    traceback.print_exc()
                    result = Result(row, micro_batch, error=f"{type(e).__name__}: {first_line}")
                else:
                    print(f"[{spec.name}] out of memory at micro-batch {micro_batch} in row {row.key}: {first_line}",
                          file=sys.stderr, flush=True)
                    oom_at = oom_at or micro_batch
                    if micro_batch == 1:
                        result = Result(row, 1, error="out of memory at micro-batch 1")
                    micro_batch //= 2
            _release(device)
        if not skip:
            result.oom_at, result.wall_s = oom_at, time.monotonic() - started
            clock.longest_row_s = max(clock.longest_row_s, result.wall_s)
        print(progress_line(spec, result), file=sys.stderr, flush=True)
        results.append(result)
        if on_result is not None:
            on_result(results)
    return results


def run_kernel_benchmark(args, timeout_s: float | None) -> tuple[str, int]:
    """tools/benchmarks/bench_kernels.py in a process of its own (a fault in a kernel cannot take
    the model rows with it): (its markdown report, exit status). Its progress goes to stderr."""
    argv = [sys.executable, str(HERE / "bench_kernels.py"), "--ops", args.kernel_ops]
    argv += ["--cpu-smoke"] if args.cpu_smoke else []
    argv += ["--quick"] if args.quick else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    print("[kernels] " + " ".join(argv[1:]) + " ...", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"Kernel benchmark: not measured (stopped after {timeout_s:.0f} s by --time-limit)", 0
    if proc.returncode != 0:
        return f"Kernel benchmark: FAILED (exit status {proc.returncode}; its error is above in stderr)\n" \
               + proc.stdout, proc.returncode
    return proc.stdout, 0


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
    parser.add_argument("--skip-kernels", action="store_true",
                        help="leave out the kernel benchmark (tools/benchmarks/bench_kernels.py)")
    parser.add_argument("--kernel-ops", default=",".join(KERNEL_OPS),
                        help=f"comma-separated ops of the kernel benchmark (default all: {','.join(KERNEL_OPS)})")
    parser.add_argument("--quick", action="store_true", help="fewer steps (2 warm-up, 5 timed) and the kernel "
                                                            "benchmark's --quick")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="start no row that would end after SECONDS (judged by the longest row so far); "
                             "the kernel benchmark gets at most half")
    parser.add_argument("--output", type=Path, help="also write the markdown report to this file (after every row)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny configs on the CPU: checks the harness")
    parser.add_argument("--simulate-oom-above", type=int, default=None, metavar="B",
                        help="testing: raise out-of-memory for micro-batches above B (exercises the retry)")
    args = parser.parse_args(argv)
    args.clock = Clock(args.time_limit)
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
    if unknown := sorted(set(args.kernel_ops.split(",")) - set(KERNEL_OPS)):
        parser.error(f"--kernel-ops: unknown {unknown}; choose from {list(KERNEL_OPS)}")
    if args.time_limit is not None and args.time_limit <= 0:
        parser.error(f"--time-limit must be positive, got {args.time_limit:g}")
    for flag in ("warmup", "steps"):
        if getattr(args, flag) is not None and getattr(args, flag) < (0 if flag == "warmup" else 1):
            parser.error(f"--{flag} must be at least {0 if flag == 'warmup' else 1}, got {getattr(args, flag)}")
    args.specs = [specs[n] for n in names]
    args.row_list = [r for r in ROWS if r.key in keys]
    args.micro_batch_size = sizes
    args.warmup = args.warmup if args.warmup is not None else (1 if args.cpu_smoke else 2 if args.quick else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.cpu_smoke else 5 if args.quick else 10)
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
    kernels_text, status = None, 0
    if not args.skip_kernels:  # first, before this process holds GPU memory
        kernels_text, status = run_kernel_benchmark(args, args.time_limit and args.time_limit / 2)
    results = {}

    def write_report(done: list[Result] | None = None, spec: ModelSpec | None = None) -> str:
        if spec is not None:
            results[spec.name] = done
        specs = [s for s in args.specs if s.name in results]
        text = report(specs, results, device, peak, args, kernels_text)
        if args.output:
            tmp = args.output.with_name(args.output.name + ".tmp")
            tmp.write_text(text + "\n")
            tmp.replace(args.output)
        return text

    for spec in args.specs:
        run_model(spec, args.row_list, device, peak and peak[1], args,
                  on_result=lambda done, spec=spec: write_report(done, spec))
    print(write_report(), flush=True)
    return 1 if status or any(r.error for rs in results.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
