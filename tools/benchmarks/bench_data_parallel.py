"""Data parallelism on CPU: step time at DP = 2 with and without --overlap-grad-reduce, beside
torch.nn.parallel.DistributedDataParallel on the same model in the same run, and the per-rank
memory of the distributed optimizer at DP = 1, 2, 4 against formulas.md.

    python tools/benchmarks/bench_data_parallel.py               # prints both tables
    python tools/benchmarks/bench_data_parallel.py --json out.json

Timing: two processes joined by gloo, one thread each (ranks 0 and 1 of the benchmark's one
spawn of 4; ranks 2 and 3 wait blocked in a barrier meanwhile, using no CPU). Every runner
does a full step (zero grads, forward, backward, gradient averaging, clip to norm 1, AdamW) on
the same GPT-2 style model (fp32) and micro-batch; "no communication" is the same megalite step
with DP = 1 on each rank at once (the compute floor under the same contention). Every round
runs every runner once, in turn; the table reports the best (minimum) step time over rounds,
the median beside it. megalite and torch DDP use the same bucket size.

Memory: bf16 parameters, fp32 main gradients, Adam, the distributed optimizer, one step taken;
the report's bytes per parameter against 6 + 12/d (and the plain optimizer's 18 at d = 2), and
with --optimizer-cpu-offload at d = 2 the device and host bytes apart (formulas.md counts one
device holding everything, so no formula). All memory setups run on the 4 processes after the
timing (d = 1: each rank alone; d = 2: ranks {0, 1} and {2, 3}); rank 0's figures are reported.

    python tools/benchmarks/bench_data_parallel.py --layers 1 --hidden 64 --vocab 256 --seq 16 --rounds 2
                                                   # a smoke run of a few seconds (tests use it)
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalite.model.config import GPTConfig  # noqa: E402
from megalite.model.gpt import GPTModel, masked_mean_loss  # noqa: E402
from megalite.optimizer.memory_report import memory_report  # noqa: E402
from megalite.optimizer.mixed_precision import build_optimizer  # noqa: E402
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads  # noqa: E402
from megalite.parallel.spawn import pair_state, run_distributed  # noqa: E402
from megalite.parallel.state import ParallelLayout, ParallelState  # noqa: E402

DP = 2


def model_config(args, params_dtype="float32") -> GPTConfig:
    return GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 64,
                     vocab_size=args.vocab, max_position_embeddings=args.seq, attention_dropout=0.0,
                     hidden_dropout=0.0, activation="openai_gelu", params_dtype=params_dtype)


def make_batch(args, rank, micro_batch=None):
    g = torch.Generator().manual_seed(rank)
    b = micro_batch or args.micro_batch
    tokens = torch.randint(0, args.vocab, (b, args.seq), generator=g)
    return tokens, torch.randint(0, args.vocab, (b, args.seq), generator=g), torch.ones(b, args.seq)


class MegaliteRunner:
    def __init__(self, args, pstate, overlap):
        self.pstate, self.batch = pstate, make_batch(args, pstate.rank)
        model = GPTModel(model_config(args), pstate, init_seed=1)
        self.chunk = DistributedDataParallel(model, pstate, bucket_size=args.bucket_size, overlap_grad_reduce=overlap)
        self.optimizer = build_optimizer([self.chunk], pstate, lr=1e-4, clip_grad=1.0)

    def step(self):
        self.optimizer.zero_grad()
        tokens, labels, mask = self.batch
        masked_mean_loss(self.chunk(tokens, labels=labels), mask).backward()
        finalize_model_grads([self.chunk], self.pstate)
        self.optimizer.step()


class TorchDDPRunner:
    def __init__(self, args, pstate):
        self.batch = make_batch(args, pstate.rank)
        model = GPTModel(model_config(args), pstate, init_seed=1)
        self.model = torch.nn.parallel.DistributedDataParallel(
            model, process_group=pstate.dp_group, bucket_cap_mb=args.bucket_size * 4 / 2**20)
        decay = [p for p in model.parameters() if p.ndim > 1]
        plain = [p for p in model.parameters() if p.ndim == 1]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                            {"params": plain, "weight_decay": 0.0}], lr=1e-4, foreach=True)

    def step(self):
        self.optimizer.zero_grad(set_to_none=True)
        tokens, labels, mask = self.batch
        masked_mean_loss(self.model(tokens, labels=labels), mask).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()


def _timed(runner, group) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    runner.step()
    dist.barrier(group=group)
    return time.perf_counter() - start


def _init(nice=0):
    if nice:
        os.nice(nice)  # negative needs root


def _timing(args, pstate) -> dict:
    runners = {"megalite DDP, overlap off": MegaliteRunner(args, pstate, overlap=False),
               "megalite DDP, overlap on": MegaliteRunner(args, pstate, overlap=True),
               "torch DDP (peer)": TorchDDPRunner(args, pstate),
               "no communication (DP=1 each)": MegaliteRunner(args, ParallelState.single(), overlap=False)}
    for runner in runners.values():
        runner.step()  # warm-up
    times = {}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            times.setdefault(name, []).append(_timed(runner, pstate.dp_group))
    num_params = sum(p.numel() for p in runners["torch DDP (peer)"].model.parameters())
    return {"times": times, "num_params": num_params}


MEMORY_SETUPS = ((1, True, False), (2, True, False), (4, True, False), (2, False, False), (2, True, True))
"""(d, distributed optimizer, CPU offload) per row of the memory table."""


def _memory_of(args, pstate, dist_opt, cpu_offload) -> dict:
    model = GPTModel(model_config(args, "bfloat16"), pstate, init_seed=1)
    chunk = DistributedDataParallel(model, pstate, use_distributed_optimizer=dist_opt)
    optimizer = build_optimizer([chunk], pstate, lr=1e-4, bf16=True, use_distributed_optimizer=dist_opt,
                                cpu_offload=cpu_offload)
    tokens, labels, mask = make_batch(args, pstate.rank, micro_batch=1)
    optimizer.zero_grad()
    masked_mean_loss(chunk(tokens[:, :32], labels=labels[:, :32]), mask[:, :32]).backward()
    finalize_model_grads([chunk], pstate)
    optimizer.step()
    info, line = memory_report([chunk], optimizer, pstate)
    return {"info": info, "line": line}


def _worker(rank, world, args):
    """Timing on ranks 0 and 1 (ranks 2 and 3 wait blocked in a barrier, using no CPU), then every
    row of MEMORY_SETUPS on all 4 ranks (d = 1: each alone; d = 2: pairs {0, 1} and {2, 3})."""
    _init(args.nice)
    pair = pair_state(rank)
    timing = _timing(args, pair) if rank < DP else None
    dist.barrier()
    states = {1: ParallelState.single(), 2: pair, 4: ParallelState.create(ParallelLayout(world))}
    memory = [_memory_of(args, states[d], dist_opt, cpu_offload) for d, dist_opt, cpu_offload in MEMORY_SETUPS]
    return {"timing": timing, "memory": memory}


def timing_table(args, raw) -> tuple[list[str], dict]:
    times = raw["times"]
    best = {name: min(t) for name, t in times.items()}
    floor = best["no communication (DP=1 each)"]
    lines = [f"\nDP = {DP}, {raw['num_params'] / 1e6:.1f}M parameters (fp32), bucket {args.bucket_size:,} elements: "
             f"best step time of {args.rounds} rounds (median beside it)",
             f"{'runner':32s} {'best ms':>9s} {'median':>9s} {'vs torch DDP':>13s} {'comm overhead':>14s}"]
    for name, t in best.items():
        lines.append(f"{name:32s} {1000 * t:9.1f} {1000 * statistics.median(times[name]):9.1f} "
                     f"{t / best['torch DDP (peer)']:13.3f} {1000 * (t - floor):11.1f} ms")
    saved = best["megalite DDP, overlap off"] - best["megalite DDP, overlap on"]
    overhead = best["megalite DDP, overlap off"] - floor
    share = f"{saved / overhead:.0%} of the communication overhead" if overhead > 0 else \
        "no communication overhead measured without overlap"
    lines.append(f"overlap_grad_reduce saves {1000 * saved:.1f} ms per step ({share})")
    return lines, {"best_s": best, "median_s": {k: statistics.median(t) for k, t in times.items()}}


def expected_optimizer_bytes_per_param(d: int, dist_opt: bool, cpu_offload: bool) -> float:
    """fp32 main parameter + Adam's two moments (12), sharded over d by the distributed
    optimizer; CPU offload adds an fp32 copy of the gradient shard (4/d)."""
    return (16 if cpu_offload else 12) / (d if dist_opt else 1)


def memory_table(results) -> tuple[list[str], list]:
    lines = ["\nper-rank memory, bf16 parameters + fp32 main gradients + Adam (after one step)",
             f"{'setup':40s} {'params':>8s} {'weights MiB':>12s} {'grads MiB':>10s} {'optim MiB':>10s} "
             f"{'device B/param':>15s} {'host B/param':>13s} {'formula':>8s} {'ratio':>7s} {'optim B/param':>14s} "
             f"{'expected':>9s}"]
    rows = []
    mib = 2**20
    for (d, dist_opt, cpu_offload), out in results:
        info = out["info"]
        label = f"d={d} " + ("distributed optimizer" if dist_opt else "plain optimizer") + \
            (" + CPU offload" if cpu_offload else "")
        formula = info["formula_bytes_per_param"]
        compared = (f"{formula:8.3f} {info['bytes_per_param'] / formula:7.4f}" if formula is not None
                    else f"{'n/a':>8s} {'n/a':>7s}")
        lines.append(f"{label:40s} {info['num_params'] / 1e6:7.2f}M {info['param_bytes'] / mib:12.2f} "
                     f"{info['grad_bytes'] / mib:10.2f} {info['optimizer_bytes'] / mib:10.2f} "
                     f"{info['device_bytes_per_param']:15.4f} {info['host_bytes_per_param']:13.4f} {compared} "
                     f"{info['optimizer_bytes_per_param']:14.4f} "
                     f"{expected_optimizer_bytes_per_param(d, dist_opt, cpu_offload):9.2f}")
        rows.append({"dp": d, "distributed_optimizer": dist_opt, **info})
    lines.append("formula: formulas.md's bytes per parameter for one device holding everything (n/a under CPU "
                 "offload); ratio: measured B/param / formula; expected: 12/d optimizer bytes (16/d with "
                 "offload's fp32 gradient copies)")
    return lines, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--bucket-size", type=int, default=2_000_000, help="elements per gradient bucket")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--nice", type=int, default=0,
                        help="niceness increment for the benchmark ranks (e.g. -10, as root, on a shared machine)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.hidden % 64:
        parser.error(f"--hidden {args.hidden} must be a multiple of 64 (heads of width 64)")
    try:
        # Rank 0's results: timing at DP = 2, memory of every setup.
        results = run_distributed(_worker, 4, args, timeout=3600)[0]
        timing, memory = results["timing"], list(zip(MEMORY_SETUPS, results["memory"]))
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"bench_data_parallel: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}, "
          f"micro-batch {args.micro_batch}, gloo on CPU, 1 thread per rank")
    time_lines, time_summary = timing_table(args, timing)
    memory_lines, memory_rows = memory_table(memory)
    print("\n".join(time_lines + memory_lines))
    print("\n" + "\n".join(out["line"] for _, out in memory))
    if args.json:
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "timing": time_summary,
                                   "memory": memory_rows}, indent=2))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
