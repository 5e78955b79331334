"""Expert parallelism on CPU: an 8-expert top-2 MoE GPT trained at EP = 1, 2 and 4 on four
gloo processes (DP = 4, the EP groups carved from it; one thread each), alltoall dispatcher:
step time and the bytes of tokens each rank sends by all-to-all per step, measured (counted in
the all-to-all itself, forward and backward) against the formula

    bytes/rank/step = 4 * m * L_moe * T * k * (EP - 1) / EP * h * 4 B

(T = b * s tokens per micro-batch, k = top-k, m micro-batches; dispatch and combine, each
forward and backward; a token's k experts land on another rank with probability
(EP - 1) / EP when the load is balanced). The allgather dispatcher is timed beside it.

    python tools/benchmarks/bench_moe.py                    # prints the table
    python tools/benchmarks/bench_moe.py --layers 1 --hidden 32 --steps 2   # a smoke run

Every step is a full one (forward, backward, expert/dense gradient reduction, Adam); the table
gives the median step time over the timed steps after one warm-up step. Four processes on
fewer cores time-share them: compare rows of one run, not across machines.
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalite.model.config import GPTConfig  # noqa: E402
from megalite.model.moe import moe_layers, set_loss_backward_scale  # noqa: E402
from megalite.model.moe_config import MoEConfig  # noqa: E402
from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step  # noqa: E402
from megalite.optimizer.mixed_precision import build_optimizer  # noqa: E402
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads  # noqa: E402
from megalite.parallel.expert.groups import ExpertState  # noqa: E402
from megalite.parallel.spawn import run_distributed  # noqa: E402
from megalite.parallel.state import ParallelLayout, ParallelState  # noqa: E402

WORLD, EXPERTS, TOPK = 4, 8, 2


def _config(o, dispatcher):
    moe = MoEConfig(num_experts=EXPERTS, ffn_hidden_size=o.ffn, router_topk=TOPK, token_dispatcher_type=dispatcher,
                    aux_loss_coeff=1e-2)
    return GPTConfig(num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=4, vocab_size=o.vocab,
                     max_position_embeddings=o.seq, ffn_hidden_size=o.ffn, activation="swiglu",
                     normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                     untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0, moe=moe)


def _worker(rank, world, o):
    pstate = ParallelState.create(ParallelLayout(world))
    g = torch.Generator().manual_seed(rank)
    batches = [dict(tokens=torch.randint(0, o.vocab, (o.micro, o.seq), generator=g),
                    labels=torch.randint(0, o.vocab, (o.micro, o.seq), generator=g)) for _ in range(o.micro_batches)]
    rows = []
    for ep in (1, 2, 4):
        for dispatcher in ("alltoall", "allgather"):
            pstate.expert = ExpertState.create(pstate, ep, EXPERTS)
            config = _config(o, dispatcher)
            (chunk,) = [DistributedDataParallel(c, pstate) for c in build_model_chunks(config, pstate)]
            optimizer = build_optimizer([chunk], pstate, lr=1e-4)
            times = []
            for step in range(o.steps + 1):
                start = time.perf_counter()
                optimizer.zero_grad()
                set_loss_backward_scale([chunk], 1 / len(batches))
                for i, batch in enumerate(batches):
                    if i < len(batches) - 1:
                        with chunk.no_sync():
                            (gpt_forward_step(chunk, batch, None) / len(batches)).backward()
                    else:
                        (gpt_forward_step(chunk, batch, None) / len(batches)).backward()
                finalize_model_grads([chunk], pstate)
                optimizer.step()
                times.append(time.perf_counter() - start)
                if step == 0:  # warm-up: reset the traffic counters
                    for layer in moe_layers([chunk]):
                        layer.dispatcher.traffic[0] = 0
            traffic = sum(layer.dispatcher.traffic[0] for layer in moe_layers([chunk])) / o.steps
            rows.append(dict(ep=ep, dispatcher=dispatcher, seconds=statistics.median(times[1:]), bytes=traffic))
            torch.distributed.barrier()
    return rows


def formula_bytes(o, ep) -> float:
    tokens = o.micro * o.seq
    return 4 * o.micro_batches * o.layers * tokens * TOPK * (ep - 1) / ep * o.hidden * 4


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    o = p.parse_args(argv)
    results = run_distributed(_worker, WORLD, o, timeout=3000)
    print(f"## bench_moe ({datetime.date.today()}, {platform.machine()} CPU, {os.cpu_count()} cores, "
          f"torch {torch.__version__}): `python tools/benchmarks/bench_moe.py {' '.join(argv or sys.argv[1:])}`")
    print(f"\n{EXPERTS} experts, top-{TOPK}, {o.layers} MoE layers, h={o.hidden}, f={o.ffn}, "
          f"{o.micro_batches}x{o.micro}x{o.seq} tokens per rank per step, DP={WORLD}, fp32\n")
    print("| EP | dispatcher | step time (median, rank max) | all-to-all bytes/rank/step (mean over ranks) "
          "| formula | measured / formula |")
    print("|---|---|---|---|---|---|")
    for i, row in enumerate(results[0]):
        seconds = max(r[i]["seconds"] for r in results)
        measured = statistics.mean(r[i]["bytes"] for r in results)
        if row["dispatcher"] == "alltoall":
            formula = formula_bytes(o, row["ep"])
            ratio = f"{measured / formula:.3f}" if formula else "-"
            print(f"| {row['ep']} | alltoall | {seconds * 1000:.0f} ms | {measured / 1e6:.3f} MB | "
                  f"{formula / 1e6:.3f} MB | {ratio} |")
        else:
            print(f"| {row['ep']} | allgather | {seconds * 1000:.0f} ms | (all-gather, not all-to-all) | | |")
    return results


if __name__ == "__main__":
    main()
