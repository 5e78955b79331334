"""`plan.py --calibrate`: measure this machine as a cluster of `world_size` ranks, every rank
busy at once as in a run: matmul rate, memory bandwidth, per-operator host overhead, the
optimizer's bytes per parameter, and for each group size the latency and bus bandwidth of
megalite's own collectives (megalite.parallel.comm, the expert all-to-all, batched send and
receive), with every group of that size communicating at the same time.

CPU: spawned processes, one thread each, joined by gloo (megalite.parallel.spawn). Compute rates
are measured for one process alone; a small GPT's training micro-batch is timed on 1, 2, 4, ...
`world_size` processes at once: the ratio is how much slower a rank computes while k ranks
compute (the cores shared, and on a loaded machine the other processes too), which the step
model applies to the stretches of the pipeline where k ranks compute. Collectives:
`world_size` processes. GPU: one
process per device, NCCL, bf16 matmuls; the same measurements with device synchronisation.
Each collective is timed at four sizes from 4 KiB to 4 MiB and its ring-model latency and
bandwidth fitted to them by least squares (cluster.py); times are medians over repetitions.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.planner.cluster import Cluster

SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)  # bytes per collective (fp32 elements x 4)
_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds_per_call(fn, device, window: float) -> float:
    """Seconds per call of `fn`, run back to back for at least `window` seconds: a window long
    beside the scheduler's time slices, so that on a loaded machine a process woken from a
    barrier is measured at the share of the cores it keeps, not at its wake-up delay."""
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= window:
            return elapsed / calls


def _median_time(fn, device, repeats: int, group=None) -> float:
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collective(kind: str, nbytes: int, group, device):
    n = comm.group_size(group)
    elements = max(n, nbytes // 4 // n * n)
    x = torch.ones(elements, device=device)
    if kind == "all_reduce":
        return lambda: comm.all_reduce(x, group)
    if kind == "all_gather":
        part = x[:elements // n].clone()
        return lambda: comm.all_gather_dim0(part, group)
    if kind == "reduce_scatter":
        return lambda: comm.reduce_scatter_dim0(x, group)
    splits = [elements // n] * n
    out = torch.empty_like(x)
    return lambda: dist.all_to_all_single(out, x, splits, splits, group=group)


def fit(kind: str, n: int, sizes, seconds) -> list[float]:
    """[latency, bus bandwidth] of the ring model (cluster.py) fitted by least squares to the
    seconds measured at `sizes` bytes: seconds = hops x latency + moved bytes / bandwidth."""
    hops, share = (1, 1.0) if kind == "p2p" else (_STEPS[kind] * (n - 1), _STEPS[kind] * (n - 1) / n)
    xs = [share * size for size in sizes]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(seconds)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, seconds)) / sum((x - mean_x) ** 2 for x in xs)
    slope = max(slope, 1e-12)  # noise can tilt it; a collective never gets faster with size
    intercept = max(mean_y - slope * mean_x, 0.0)
    return [intercept / hops, 1 / slope]


def _p2p(rank: int, world: int, nbytes: int, device):
    peer = rank ^ 1
    x = torch.ones(nbytes // 4, device=device)
    y = torch.empty_like(x)

    def exchange():
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return exchange


def _compute(device) -> dict:
    """This process's matmul FLOP/s, memory bandwidth, operator overhead and optimizer bytes."""
    a, b = _matmul_operands(device)
    (m, k), n = a.shape, b.shape[1]
    window = 0.5 if device.type == "cpu" else 0.2
    matmul = _seconds_per_call(lambda: [a @ b for _ in range(4)], device, window)
    x = torch.randn(1 << (25 if device.type == "cuda" else 23), device=device)
    y = torch.randn_like(x)
    add = _seconds_per_call(lambda: [torch.add(x, y) for _ in range(4)], device, window)
    from megalite.model.config import GPTConfig
    from megalite.planner.op_count import count_ops, micro_batch, tiny, tiny_model
    config = tiny(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64), 2)
    model, tokens = tiny_model(config)
    overhead = _seconds_per_call(lambda: micro_batch(model, tokens), device, window) / sum(count_ops(config))
    params = [torch.nn.Parameter(torch.randn(1 << 18, device=device)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    adam = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    adam.step()
    step = _seconds_per_call(adam.step, device, window)
    bandwidth = 4 * 3 * x.numel() * 4 / add
    return {"flops": 4 * 2 * m * k * n / matmul, "bandwidth": bandwidth, "op_overhead": overhead,
            "optimizer_bytes": step * bandwidth / sum(p.numel() for p in params)}


def _matmul_operands(device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    m, k, n = (8192, 8192, 8192) if device.type == "cuda" else (512, 1024, 1024)
    return torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)


def _sharing_model():
    from megalite.model.config import GPTConfig
    from megalite.planner.op_count import tiny_model

    model, tokens = tiny_model(GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1024,
                                         max_position_embeddings=128), 128)
    return model, tokens.expand(2, -1)


def _sharing(rank: int, world: int, repeats: int, model, tokens) -> dict:
    """{k: seconds per training micro-batch of a small GPT on a process while k processes run it
    at once}: the mix of matmuls, memory-bound kernels and host work a rank does, since how much
    processes slow each other depends on it (two matmuls on the two hyper-threads of one core
    share its multipliers; a matmul beside a softmax far less). Sweeps of k = 1, 2, 4, ... world
    alternate, so that the machine's drifting load hits every k alike; processes not computing
    wait in a barrier, which leaves their core free (gloo blocks)."""
    from megalite.planner.op_count import micro_batch

    device = torch.device("cpu")
    busy = sorted({1, world} | {k for k in (2, 4, 8, 16, 32) if k < world})
    times = {k: [] for k in busy}
    for _ in range(repeats):
        for k in busy:
            dist.barrier()
            if rank < k:
                times[k].append(_seconds_per_call(lambda: micro_batch(model, tokens), device, 1.0))
    dist.barrier()
    return {k: statistics.median(t) for k, t in times.items() if t}


def _measure(rank: int, world: int, backend: str, repeats: int) -> dict:
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gpu = device.type == "cuda"
    sharing = None if gpu else _sharing_model()  # everyone's set-up done before anyone measures
    dist.barrier()
    # on a CPU rank 0 measures its rates alone while the others wait in the barrier in _sharing
    result = {"compute": _compute(device) if rank == 0 or gpu else None,
              "sharing": {} if gpu else _sharing(rank, world, 3, *sharing), "measured": {}}
    sizes = [n for n in range(2, world + 1) if world % n == 0]
    for n in sizes:
        groups = [dist.new_group(list(range(g, g + n))) for g in range(0, world, n)]
        group = groups[rank // n]
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            seconds = [_median_time(_collective(kind, size, group, device), device, repeats, dist.group.WORLD)
                       for size in SIZES]
            result["measured"].setdefault(kind, {})[n] = fit(kind, n, SIZES, seconds)
    if world % 2 == 0:
        seconds = [_median_time(_p2p(rank, world, size, device), device, repeats, dist.group.WORLD) for size in SIZES]
        result["measured"]["p2p"] = {2: fit("p2p", 2, SIZES, seconds)}
    return result


def _nccl_worker(rank: int, world: int, port: int, repeats: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        results.put((rank, _measure(rank, world, "nccl", repeats)))
    finally:
        dist.destroy_process_group()


def _run(world: int, backend: str, repeats: int) -> tuple[list[dict], dict]:
    """(per-rank collective measurements with compute rates, {k: micro-batches per second of one
    process while k compute})."""
    if backend == "gloo":
        from megalite.parallel.spawn import run_distributed
        ranks = list(run_distributed(_measure, world, backend, repeats, timeout=1800))
        seconds = {k: statistics.median(r["sharing"][k] for r in ranks if k in r["sharing"]) for k in ranks[0]["sharing"]}
        return [dict(r, compute=ranks[0]["compute"]) for r in ranks], {k: 1 / t for k, t in seconds.items()}
    import torch.multiprocessing as mp
    from megalite.parallel.spawn import free_port
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_nccl_worker, args=(r, world, port, repeats, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = [results.get(timeout=1800)[1] for _ in procs]
    for p in procs:
        p.join()
    return out, {}


def calibrate(world_size: int, backend: str | None = None, repeats: int = 7) -> Cluster:
    """This machine as a Cluster of `world_size` ranks (gloo on CPU, NCCL on GPUs)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"--world-size {world_size}: this machine has {torch.cuda.device_count()} GPUs")
    if world_size < 2:
        raise ValueError(f"--world-size must be at least 2 to measure collectives, got {world_size}")
    ranks, busy_rates = _run(world_size, backend, repeats)

    def median(key):
        return statistics.median(r["compute"][key] for r in ranks)
    measured = {}
    for kind in ranks[0]["measured"]:
        measured[kind] = {n: [statistics.median(r["measured"][kind][n][i] for r in ranks) for i in (0, 1)]
                          for n in ranks[0]["measured"][kind]}
    if backend == "gloo":
        with open("/proc/meminfo") as handle:
            total = int(next(line for line in handle if line.startswith("MemTotal")).split()[1]) * 1024
        memory, name = total / world_size, f"this CPU machine, {world_size} gloo processes ({os.cpu_count()} cores)"
    else:
        memory, name = torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    bandwidth = measured.get("all_reduce", {}).get(world_size, [0, 1e9])
    p2p = measured.get("p2p", {}).get(2, bandwidth)
    return Cluster(name=name, num_gpus=world_size, gpus_per_node=world_size, memory_bytes=memory,
                   peak_flops=median("flops"),
                   matmul_efficiency=1.0, memory_bandwidth=median("bandwidth"),
                   intra_node_bandwidth=bandwidth[1], inter_node_bandwidth=p2p[1], intra_node_latency=bandwidth[0],
                   inter_node_latency=p2p[0], op_overhead=median("op_overhead") if backend == "gloo" else 0.0,
                   slowdown={k: busy_rates[1] / r for k, r in busy_rates.items() if k > 1},
                   optimizer_bytes_per_parameter=median("optimizer_bytes"), measured=measured,
                   source=f"--calibrate on {time.strftime('%Y-%m-%d %H:%M')}, {backend}, {world_size} ranks, "
                          f"load {os.getloadavg()[0]:.1f}")
