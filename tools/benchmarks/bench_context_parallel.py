"""Context parallelism on CPU: a long sequence (8192 tokens by default) trained at CP = 1 and at
CP = 2 with each --cp-comm-type, the same global batch (one sequence): step time and
activation memory per rank, and ring attention with its transfers overlapped against the
same run waiting for each transfer before computing. Then activation memory per rank at
CP = 1, 2, 4 against 1/N of CP = 1's.

    python tools/benchmarks/bench_context_parallel.py                 # prints both tables
    python tools/benchmarks/bench_context_parallel.py --json out.json
    python tools/benchmarks/bench_context_parallel.py --seq 256 --rounds 1 --memory-seq 256
                                                                      # a smoke run (tests)

Step: forward, loss (reduced over CP), backward, gradients summed over CP (the DDP buffers),
on a Llama-style model (fp32, 2 layers, hidden 128, 4 heads, 2 key/value groups). Each rank
runs one thread; CP = 1 runs on rank 0 while rank 1 waits in a barrier (no CPU used). The
table reports the best (minimum) step time over rounds and the median beside it.

Activation memory is the bytes of the distinct tensors autograd saves for backward during
the forward (torch.autograd.graph.saved_tensors_hooks; parameters excluded): what a rank holds
between forward and backward. Peak bytes at any instant also include transient buffers
(attention score blocks), which this does not count.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalite.model.config import GPTConfig  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.model.pipeline_chunks import gpt_forward_step  # noqa: E402
from megalite.parallel.context import split_sequence  # noqa: E402
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads  # noqa: E402
from megalite.parallel.spawn import run_distributed  # noqa: E402
from megalite.parallel.state import ParallelLayout, ParallelState  # noqa: E402

VOCAB = 256
VARIANTS = [("CP=1", 1, "p2p", True), ("CP=2 p2p (ring, overlapped)", 2, "p2p", True),
            ("CP=2 p2p (ring, transfer waited)", 2, "p2p", False), ("CP=2 all_gather", 2, "all_gather", True),
            ("CP=2 a2a", 2, "a2a", True)]


def _config(seq, comm_type="p2p", overlap=True):
    return GPTConfig(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                     max_position_embeddings=seq, ffn_hidden_size=256, activation="swiglu", normalization="RMSNorm",
                     position_embedding_type="rope", add_bias_linear=False, untie_embeddings_and_output_weights=True,
                     attention_dropout=0.0, hidden_dropout=0.0, cp_comm_type=comm_type, cp_ring_overlap=overlap)


def _batch(seq, state):
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, VOCAB, (2, 1, seq), generator=g)
    return {k: split_sequence(v, 1, state.cp_size, state.cp_rank)
            for k, v in (("tokens", tokens), ("labels", labels), ("loss_mask", torch.ones(1, seq)))}


def _saved_bytes(fn, params):
    """Run fn() and return (its result, bytes of the distinct non-parameter tensors saved)."""
    skip, seen = {p.data_ptr() for p in params}, {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _step(ddp, state, batch):
    ddp.zero_grad_buffer()
    loss, saved = _saved_bytes(lambda: gpt_forward_step(ddp, batch, None), list(ddp.parameters()))
    loss.backward()
    finalize_model_grads([ddp], state)
    return loss.item(), saved


def _measure(state, seq, comm_type, overlap, rounds):
    ddp = DistributedDataParallel(GPTModel(_config(seq, comm_type, overlap), state, init_seed=1), state)
    batch = _batch(seq, state)
    loss, saved = _step(ddp, state, batch)  # warm-up
    times = []
    for _ in range(rounds):
        if state.cp_size > 1:
            dist.barrier(group=state.cp_group)
        start = time.perf_counter()
        _step(ddp, state, batch)
        times.append(time.perf_counter() - start)
    return {"loss": loss, "saved_bytes": saved, "best_s": min(times, default=None),
            "median_s": statistics.median(times) if times else None}


def _timing_worker(rank, world_size, seq, rounds, memory_seq):
    """Ranks 0 and 1: every variant's timing (CP = 1 on rank 0 alone), then activation bytes at
    CP = 1 and 2."""
    single, pair = ParallelState.single(), ParallelState.create(ParallelLayout(2, context=2))
    timing, memory = {}, {}
    for name, cp, comm_type, overlap in VARIANTS:
        if cp == 2 or rank == 0:
            timing[name] = _measure(single if cp == 1 else pair, seq, comm_type, overlap, rounds)
        dist.barrier()
    for comm_type in ("p2p", "all_gather", "a2a"):
        if rank == 0:
            memory[(comm_type, 1)] = _measure(single, memory_seq, comm_type, True, 0)["saved_bytes"]
        memory[(comm_type, 2)] = _measure(pair, memory_seq, comm_type, True, 0)["saved_bytes"]
        dist.barrier()
    return timing, memory


def _memory_worker(rank, world_size, memory_seq):
    quad = ParallelState.create(ParallelLayout(4, context=4))
    return {(comm_type, 4): _measure(quad, memory_seq, comm_type, True, 0)["saved_bytes"]
            for comm_type in ("p2p", "all_gather", "a2a")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192, help="sequence length of the timed runs")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--memory-seq", type=int, default=8192, help="sequence length of the memory table")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    (timing, memory), _ = run_distributed(_timing_worker, 2, args.seq, args.rounds, args.memory_seq, timeout=3600)
    memory.update(run_distributed(_memory_worker, 4, args.memory_seq, timeout=3600)[0])
    base = timing["CP=1"]
    print(f"context parallelism, seq {args.seq}, one sequence per step, {args.rounds} rounds (best / median)")
    print("| run | step time (s) | vs CP=1 | activation memory per rank (MiB) | vs CP=1 |")
    print("|---|---|---|---|---|")
    for name, *_ in VARIANTS:
        r = timing[name]
        print(f"| {name} | {r['best_s']:.3f} / {r['median_s']:.3f} | {r['best_s'] / base['best_s']:.2f}x | "
              f"{r['saved_bytes'] / 2**20:.1f} | {r['saved_bytes'] / base['saved_bytes']:.3f} |")
    print(f"\nactivation memory per rank, seq {args.memory_seq}: measured / (CP=1's / N)")
    print("| comm type | CP=1 (MiB) | CP=2 (MiB) | CP=2 ratio | CP=4 (MiB) | CP=4 ratio |")
    print("|---|---|---|---|---|---|")
    for comm_type in ("p2p", "all_gather", "a2a"):
        one = memory[(comm_type, 1)]
        cells = [f"{one / 2**20:.1f}"]
        for n in (2, 4):
            cells += [f"{memory[(comm_type, n)] / 2**20:.1f}", f"{memory[(comm_type, n)] * n / one:.3f}"]
        print(f"| {comm_type} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"timing": timing, "memory": {f"{k[0]} cp={k[1]}": v for k, v in memory.items()},
                                               "seq": args.seq, "memory_seq": args.memory_seq}, indent=1))


if __name__ == "__main__":
    main()
