"""The machines a layout runs on: device speed and memory, node size, link bandwidths, and the
time of a collective over a group of ranks placed on them.

Two kinds of cluster: presets (and `Cluster(...)` built from flags), whose collectives follow
the ring model below from a bandwidth and a latency per link kind; and a machine measured by
`--calibrate` (megalite.planner.calibrate), which stores each collective's fitted latency and
bandwidth per group size, as measured with every group of that size communicating at once.

Ring model (per rank; S the bytes of the full tensor, n ranks, alpha the link latency, bw the
bus bandwidth a rank gets):

    all_reduce        2(n-1) alpha + 2(n-1)/n S / bw
    all_gather, reduce_scatter, all_to_all
                      (n-1) alpha + (n-1)/n S / bw
    p2p (send one S)  alpha + S / bw

Topology: a group whose ranks share a node uses the intra-node bandwidth; a group spanning
nodes the inter-node one, times the group's ranks per node (each GPU of a DGX-style node has
its own NIC and NCCL runs one ring per NIC), never more than the intra-node bandwidth. A
pipeline neighbour on another node is one NIC's bandwidth.

Compute: a cluster with measured kernel rates (`kernels`, KernelRates below: the h100 and h200
presets, or `plan.py --kernel-rates` with the file gpu_check.sh writes) is timed kernel class
by kernel class as megalite runs on that GPU (megalite.planner.gpu_kernels); the others by the
roofline of compute.py (matmul efficiency, one memory bandwidth).
"""

import json
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache

from megalite.planner.cards import nearest_preset


def read_json(path: str, flag: str):
    """The JSON in file `path` given to `flag`; a ValueError in one line when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read it ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag} {path}: not valid JSON ({error.msg}, line {error.lineno})") from None


KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}
GIB = 2 ** 30


@dataclass(frozen=True)
class Cluster:
    """A cluster of identical devices. Rates are per device."""

    name: str
    num_gpus: int
    gpus_per_node: int
    memory_bytes: float
    """Device memory a run may fill (the planner keeps --memory-fraction of it)."""
    peak_flops: float
    """Dense 16-bit peak FLOP/s (formulas.md); on a calibrated CPU the measured matmul rate."""
    matmul_efficiency: float
    """Fraction of peak_flops a large matmul reaches."""
    memory_bandwidth: float
    """Bytes/s that memory-bound kernels (norms, activations, softmax, optimizer) achieve."""
    intra_node_bandwidth: float
    """Bus bandwidth in bytes/s a rank gets in a collective inside a node."""
    inter_node_bandwidth: float
    """Bytes/s of one device's share of the inter-node network (its NIC)."""
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 10e-6
    op_overhead: float = 0.0
    """Seconds each operator costs beyond its kernel and is not hidden (host dispatch on a CPU;
    0 where launches overlap long GPU kernels)."""
    slowdown: dict = field(default_factory=dict, compare=False, hash=False)
    """Processes sharing a CPU: {k: how many times slower one process computes while k compute
    at once than alone} as --calibrate measures it (core sharing and the machine's other load
    together); empty for devices that compute on their own (GPUs)."""
    optimizer_bytes_per_parameter: float = 30.0
    """Bytes the optimizer step moves per parameter it updates: 30 for a fused AdamW pass over
    fp32 main weights, gradient, m and v (read and write) and the 16-bit copy; measured on a CPU
    (foreach AdamW makes several passes)."""
    measured: dict = field(default_factory=dict, compare=False, hash=False)
    """kind -> {group size: [latency s, bus bandwidth bytes/s]} from --calibrate; empty for a
    preset (the ring model above)."""
    source: str = ""
    """Where the numbers come from."""
    fp8_peak_flops: float | None = None
    """Dense FP8 tensor-core peak FLOP/s (H100 / H200 SXM: 1978.9 TFLOP/s, twice bf16); None: the
    card has none known, and --fp8-format plans are refused on it."""
    kernels: "KernelRates | None" = field(default=None, compare=False, hash=False)
    """megalite's kernels as measured on this GPU (gpu_kernels.py times them); None: the
    roofline of compute.py."""

    def __post_init__(self):
        for name in ("num_gpus", "gpus_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"cluster {self.name}: {name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("memory_bytes", "peak_flops", "matmul_efficiency", "memory_bandwidth",
                     "intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster {self.name}: {name} must be positive, got {getattr(self, name)!r}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(f"cluster {self.name}: {self.num_gpus} GPUs do not fill nodes of {self.gpus_per_node}")

    @property
    def matmul_flops(self) -> float:
        return self.peak_flops * self.matmul_efficiency

    def replace(self, **changes) -> "Cluster":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return Cluster(**values)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(asdict(self), handle, indent=1)

    @classmethod
    def load(cls, path: str) -> "Cluster":
        values = read_json(path, "--cluster")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"--cluster {path}: unknown keys {', '.join(unknown)}")
        values["measured"] = {kind: {int(n): tuple(v) for n, v in table.items()}
                              for kind, table in values.get("measured", {}).items()}
        values["slowdown"] = {int(k): float(v) for k, v in values.get("slowdown", {}).items()}
        if values.get("kernels") is not None:
            values["kernels"] = KernelRates.from_dict(values["kernels"], f"--cluster {path}")
        return cls(**values)

    def slowdown_at(self, busy: float) -> float:
        """How many times slower each of `busy` computing processes runs than one alone
        (piecewise linear in the measured table; 1 without one)."""
        if not self.slowdown or busy <= 1:
            return 1.0
        points = sorted({1: 1.0, **self.slowdown}.items())
        for (k0, f0), (k1, f1) in zip(points, points[1:]):
            if busy <= k1:
                return f0 + (f1 - f0) * (busy - k0) / (k1 - k0)
        k, f = points[-1]
        return f * busy / k  # beyond the table: as many more processes, as much slower

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def group_link(self, ranks: list[int]) -> tuple[float, float]:
        """(latency, bus bandwidth) of a collective over `ranks`, by where they sit."""
        per_node = _ranks_per_node(tuple(ranks), self.gpus_per_node)
        if per_node == len(ranks):
            return self.intra_node_latency, self.intra_node_bandwidth
        return self.inter_node_latency, min(self.intra_node_bandwidth, per_node * self.inter_node_bandwidth)

    def p2p_link(self, src: int, dst: int) -> tuple[float, float]:
        if self.node_of(src) == self.node_of(dst):
            return self.intra_node_latency, self.intra_node_bandwidth
        return self.inter_node_latency, self.inter_node_bandwidth

    def collective_time(self, kind: str, nbytes: float, ranks: list[int]) -> float:
        """Seconds one rank spends in `kind` over the group `ranks` (nbytes: the full tensor; for
        p2p, ranks = [src, dst])."""
        if kind not in KINDS:
            raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")
        n = len(ranks)
        if kind != "p2p" and n == 1 or nbytes == 0:
            return 0.0
        table = self.measured.get(kind)
        if table:
            latency, bandwidth = _nearest(table, 2 if kind == "p2p" else n)
        elif kind == "p2p":
            latency, bandwidth = self.p2p_link(ranks[0], ranks[-1])
        else:
            latency, bandwidth = self.group_link(ranks)
        if kind == "p2p":
            return latency + nbytes / bandwidth
        steps = _STEPS[kind]
        return steps * (n - 1) * latency + steps * (n - 1) / n * nbytes / bandwidth


KERNEL_CLASSES = ("norm", "swiglu", "bias_gelu", "rotary", "cross_entropy", "torch", "optimizer")
HOST_OPS = ("rms_norm", "layer_norm", "swiglu", "bias_gelu", "rotary", "cross_entropy", "aten")


@dataclass(frozen=True)
class KernelRates:
    """megalite's kernels on one GPU, as measured there. Memory-bound kernel classes run at a
    fraction of `copy_bandwidth` (bytes read + written per second of kernel time), the flash
    attention kernel at a fraction of the dense peak, and each operator call costs the host
    `host` seconds (megalite.planner.gpu_kernels says which kernels fall in which class)."""

    copy_bandwidth: float
    """Bytes/s of a large device copy, read + written (bench_kernels.py's reference)."""
    attention: float
    """Fraction of the dense peak the flash attention kernel reaches on the causal FLOPs it
    does, forward and backward alike."""
    norm: float
    """megalite's Triton RMSNorm / LayerNorm kernels (a reduction per row)."""
    swiglu: float
    """megalite's Triton SwiGLU kernels."""
    bias_gelu: float
    """megalite's Triton bias + GeLU kernels."""
    rotary: float
    """megalite's Triton rotary kernel."""
    cross_entropy: float
    """megalite's Triton cross-entropy (--cross-entropy-loss-fusion)."""
    torch: float
    """Plain-torch elementwise kernels: dropout, residual adds, copies, the gradient accumulation
    into fp32 main gradients, the torch cross-entropy, the reference of an op whose fusion is off."""
    optimizer: float
    """torch's multi_tensor_apply kernels of the optimizer step (gradient norm, clipping, fused
    AdamW)."""
    host: dict
    """{op: [forward s, backward s]} per call on the host: megalite's fused ops and 'aten' (one
    torch operator)."""
    source: str = ""

    def __post_init__(self):
        if not self.copy_bandwidth > 0:
            raise ValueError(f"kernel rates: copy_bandwidth must be positive, got {self.copy_bandwidth!r}")
        for name in ("attention",) + KERNEL_CLASSES:
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"kernel rates: {name} must be a fraction in (0, 1], got {getattr(self, name)!r}")
        missing = sorted(set(HOST_OPS) - set(self.host))
        if missing:
            raise ValueError(f"kernel rates: host lacks {', '.join(missing)}")
        for op, pair in self.host.items():
            if len(pair) != 2 or min(pair) < 0:
                raise ValueError(f"kernel rates: host[{op!r}] must be [forward s, backward s] >= 0, got {pair!r}")

    def rate(self, kind: str) -> float:
        """Bytes/s of kernel class `kind`."""
        return getattr(self, kind) * self.copy_bandwidth

    def with_copy_bandwidth(self, copy_bandwidth: float, source: str) -> "KernelRates":
        values = asdict(self)
        values.update(copy_bandwidth=copy_bandwidth, source=source)
        return KernelRates(**values)

    @classmethod
    def from_dict(cls, values: dict, where: str) -> "KernelRates":
        known = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(values) - known), sorted(known - set(values) - {"source"})
        if unknown or missing:
            raise ValueError(f"{where}: kernel rates with unknown keys {unknown} / missing keys {missing}")
        try:
            return cls(**dict(values, host={op: [float(v) for v in pair] for op, pair in values["host"].items()}))
        except (TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{where}: {error}") from None

    @classmethod
    def load(cls, path: str) -> "KernelRates":
        """The rates in a JSON file: gpu_check.sh's kernel_rates.json (its "kernels" object) or
        these fields at the top level."""
        values = read_json(path, "--kernel-rates")
        if not isinstance(values, dict):
            raise ValueError(f"--kernel-rates {path}: expected a JSON object")
        return cls.from_dict(values.get("kernels", values), f"--kernel-rates {path}")


@lru_cache(maxsize=65536)
def _ranks_per_node(ranks: tuple, gpus_per_node: int) -> int:
    """The fewest of `ranks` any node they use holds (all of them when they share one node)."""
    nodes = {}
    for r in ranks:
        nodes[r // gpus_per_node] = nodes.get(r // gpus_per_node, 0) + 1
    return len(ranks) if len(nodes) == 1 else min(nodes.values())


def _nearest(table: dict, n: int) -> tuple[float, float]:
    """The measured (latency, bandwidth) for group size n, or the nearest size measured."""
    if n in table:
        return tuple(table[n])
    return tuple(table[min(table, key=lambda size: (abs(size - n), size))])


# Presets. Peak dense 16-bit FLOP/s from formulas.md (NVIDIA's data sheets). Matmul efficiency
# is the "maximum achievable matmul FLOPS" (MAMF) measured with bf16 over a sweep of shapes and
# published in Stas Bekman's ml-engineering (compute/accelerator/README.md, CUDA 12.1): A100
# SXM 267.9 of 312 TFLOP/s (85.9%), H100 SXM 792.1 of 989 (80.1%; formulas.md's 8192^3 figure,
# about 798, agrees). HBM: 2.039 TB/s (A100 80GB SXM) and 3.35 TB/s (H100 SXM) data-sheet
# rates; that memory-bound kernels reach 90% of them is an assumption. NVLink: 300 GB/s per
# direction per GPU on A100 (NVLink 3, 12 links x 25 GB/s), 450 GB/s on H100 (NVLink 4); the
# bus bandwidth NCCL reaches on them is taken as 80% of that (assumption; a measured A100
# send/recv over NVLink gives 195 GB/s at 1 GiB). Inter-node: one 200 Gb/s HDR NIC per A100
# (DGX A100, 8 per node) and one 400 Gb/s NDR NIC per H100 (DGX H100), again at 80% (assumption).
# Latencies are assumptions of the usual order (NVLink ~5 us, InfiniBand ~10 us per step).
_LINK_EFFICIENCY = 0.8
_HBM_EFFICIENCY = 0.9
PRESETS = {
    "a100": dict(name="A100-80GB SXM, 8 per node (NVLink 3, 8x200 Gb/s HDR InfiniBand)", gpus_per_node=8,
                 memory_bytes=80 * GIB, peak_flops=312e12, matmul_efficiency=267.9 / 312,
                 memory_bandwidth=2.039e12 * _HBM_EFFICIENCY, intra_node_bandwidth=300e9 * _LINK_EFFICIENCY,
                 inter_node_bandwidth=25e9 * _LINK_EFFICIENCY,
                 source="presets: formulas.md peak; ml-engineering MAMF; NVIDIA data sheets; 80%/90% link/HBM "
                        "efficiency assumed"),
    "h100": dict(name="H100-80GB SXM, 8 per node (NVLink 4, 8x400 Gb/s NDR InfiniBand)", gpus_per_node=8,
                 memory_bytes=80 * GIB, peak_flops=989.4e12, fp8_peak_flops=1978.9e12, matmul_efficiency=792.1 / 989.4,
                 memory_bandwidth=3.35e12 * _HBM_EFFICIENCY, intra_node_bandwidth=450e9 * _LINK_EFFICIENCY,
                 inter_node_bandwidth=50e9 * _LINK_EFFICIENCY,
                 source="presets: formulas.md peak; ml-engineering MAMF; NVIDIA data sheets; 80%/90% link/HBM "
                        "efficiency assumed"),
}
# megalite's kernels on one H200 SXM, torch 2.11.0+cu130, triton 3.6.0, measured on 2026-11-26
# (issue 23; to update them from a run of tools/benchmarks/gpu_check.sh, see gpu_kernels.py's
# docstring). Copy bandwidth: bench_kernels.py --quick (bf16 x.copy_ of
# 1 GiB). The classes: torch.profiler's kernel time over one step of the 1.1B Llama driver run
# (16 layers, hidden 2048, 16 heads of 128 in 8 groups, SwiGLU 8192, vocab 32000, 2 micro-batches
# of 2 x 4096 tokens, dropout 0.1), over the bytes (FLOPs for attention) that gpu_kernels.py
# counts for those kernels in that step (tests/planner/test_gpu_model.py recounts them):
#   attention  flash backward 41.8 ms: 5 GEMMs over the causal half of 32 x 2 x 16 x 4096^2
#              scores of 128 channels (2.5x the causal forward); the forward is assumed to run at
#              the same fraction of peak (it was not listed separately)
#   norm       _norm_bwd 6.2 ms: 66 calls reading x and dy, writing dx, [8192, 2048] bf16
#   swiglu     _swiglu_bwd 5.3 ms: 32 calls reading gate, up, dy, writing both gradients, [8192, 8192]
#   torch      the fp32 adds 8.7 ms (198 calls): every micro-batch adds 1,138,296,832 bf16
#              gradients into fp32 main gradients (read 2 + 4 B, write 4 B)
#   optimizer  multi_tensor_apply 13.1 ms (168 launches): the gradient norm (4 B per parameter),
#              clipping (8 B) and fused AdamW (28 B)
# cross_entropy is bench_kernels.py's fused cross-entropy at [4096, 128256] (68% of the copy
# bandwidth, forward + backward). Not measured, assumed: bias_gelu and rotary run as SwiGLU does
# (megalite's elementwise Triton kernels without a reduction). Host seconds per call: issue 23's
# wall time of 300 calls at [8, 2048] bf16, launch-bound, on the H200's host: rms_norm forward
# 215.4 us, forward + backward 762.1; swiglu 123.6, 415.1; layer_norm forward 122.7; one torch
# operator (F.rms_norm forward) 17.6. Assumed: layer_norm's and rotary's backward as rms_norm's,
# rotary's forward as rms_norm's (the profiler saw both at 250-450 us per call), bias_gelu as
# swiglu, the fused cross-entropy as rms_norm, a torch operator's backward as its forward.
H200_COPY_BANDWIDTH = 4244e9
ISSUE23_PROFILE = {  # class: (kernel seconds in the profiled step, FLOPs or bytes counted for them)
    "attention": (41.8e-3, 10_995_116_277_760),
    "norm": (6.2e-3, 6_643_777_536),
    "swiglu": (5.3e-3, 21_474_836_480),
    "torch": (8.7e-3, 22_765_936_640),
    "optimizer": (13.1e-3, 45_531_873_280),
}
_MEASURED = {kind: amount / seconds / H200_COPY_BANDWIDTH for kind, (seconds, amount) in ISSUE23_PROFILE.items()}
_RMS_NORM_HOST = [215.4e-6, 762.1e-6 - 215.4e-6]
_SWIGLU_HOST = [123.6e-6, 415.1e-6 - 123.6e-6]
H200_KERNELS = KernelRates(
    copy_bandwidth=H200_COPY_BANDWIDTH,
    attention=ISSUE23_PROFILE["attention"][1] / ISSUE23_PROFILE["attention"][0] / 989.4e12,
    norm=_MEASURED["norm"], swiglu=_MEASURED["swiglu"], bias_gelu=_MEASURED["swiglu"], rotary=_MEASURED["swiglu"],
    cross_entropy=0.68, torch=_MEASURED["torch"], optimizer=_MEASURED["optimizer"],
    host={"rms_norm": _RMS_NORM_HOST, "layer_norm": [122.7e-6, _RMS_NORM_HOST[1]], "swiglu": _SWIGLU_HOST,
          "bias_gelu": _SWIGLU_HOST, "rotary": _RMS_NORM_HOST, "cross_entropy": _RMS_NORM_HOST,
          "aten": [17.6e-6, 17.6e-6]},
    source="measured on H200 2026-11-26, issue 23 (torch 2.11.0+cu130, triton 3.6.0)")
# H200 SXM: 141 GB HBM3e (a run may fill about 139 GiB, as measured), 4.8 TB/s, the H100 SXM's
# SMs and clocks (989.4 TFLOP/s dense bf16; the profiled step's GEMMs, about 130 ms, are this
# model's 133 ms at the H100's matmul efficiency), NVLink 4 (900 GB/s both ways, 450 per
# direction). The H100 preset runs the same kernels at the H200's measured fractions, on a copy
# bandwidth that is the same share of its 3.35 TB/s as the H200's 4244 GB/s is of 4.8 TB/s.
PRESETS["h200"] = dict(
    PRESETS["h100"], name="H200 SXM 141GB, 8 per node (NVLink 4, 8x400 Gb/s NDR InfiniBand)", memory_bytes=139 * GIB,
    memory_bandwidth=H200_COPY_BANDWIDTH, kernels=H200_KERNELS,
    source="presets: formulas.md peak; ml-engineering MAMF; kernels measured on H200 2026-11-26 (issue 23)")
PRESETS["h100"]["kernels"] = H200_KERNELS.with_copy_bandwidth(
    H200_COPY_BANDWIDTH * 3.35e12 / 4.8e12, "H200's kernel fractions (issue 23) at the H100's share of its HBM rate")

# Megatron-LM as Narayanan et al. 2021 ran it (SC21, arXiv 2104.04473: fp16, PyTorch 20.12, no
# fused attention) reached less of these rates than today's kernels: the same A100 cluster with
# matmul and memory-bound rates scaled by 0.808, the factor with which this model reproduces the
# paper's smallest Table 1 row (1.7B parameters, 32 GPUs, data parallelism only, batch 512,
# full recompute: 137 TFLOP/s per GPU counted as the paper counts, its equation 3). That row has
# no tensor or pipeline parallelism, so the factor measures the kernels, not the layout;
# tests/planner/test_gpt3_175b.py re-derives it.
MEGATRON_2021_KERNELS = 0.808
PRESETS["a100-megatron2021"] = dict(
    PRESETS["a100"], name="A100-80GB SXM (Selene) with Megatron-LM 2021's kernels",
    matmul_efficiency=PRESETS["a100"]["matmul_efficiency"] * MEGATRON_2021_KERNELS,
    memory_bandwidth=PRESETS["a100"]["memory_bandwidth"] * MEGATRON_2021_KERNELS,
    source="a100 preset with matmul and memory-bound rates x 0.808, calibrated on Narayanan et al. 2021 Table 1 row 1")


def preset(name: str, num_gpus: int, **overrides) -> Cluster:
    """A preset cluster of `num_gpus` devices, fields overridden where given (not None)."""
    if name not in PRESETS:
        near = nearest_preset(name, PRESETS)
        hint = (f"; the nearest preset is {near[0]} ({near[1]}): --cluster {near[0]} with --peak-tflops / "
                "--gpu-memory-gib / ... overrides, or --calibrate on the card" if near else "")
        raise ValueError(f"--cluster {name!r}: no preset for this card ({', '.join(PRESETS)}) and not a calibration "
                         f"JSON file{hint}")
    values = dict(PRESETS[name], num_gpus=num_gpus)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Cluster(**values)
