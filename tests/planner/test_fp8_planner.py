"""--fp8-format in the dry run and the planner: the dry run runs the FP8 GEMMs (torch._scaled_mm
on fake tensors; blockwise: torch.nn.functional.scaled_mm's block-scaled GEMM, its meta checks) and holds their delayed-scaling state and quantization copies; the planner's
FP8 memory against the dry run of the same flags, and its FP8 step faster than the 16-bit one
by half the FP8 linears' GEMM time (the FP8 peak is twice bf16's) less the casts."""

import dataclasses

import pytest

from megalite.parallel.tensor.fp8_scaling import delayed_state_bytes
from megalite.planner.cluster import preset
from megalite.planner.fp8 import QUANTIZE_BYTES, TRANSPOSE_BYTES, fp8_layer_seconds, fp8_memory_bytes, quantize_bytes
from megalite.planner.layouts import Layout
from megalite.planner.memory import rank_memory
from megalite.planner.search import plan
from megalite.planner.step import predict
from megalite.planner.workload import from_flags
from tests.parallel.mla_harness import mla_config
from tests.planner.fsdp2_dry_runs import measure

SMALL = ("--bf16 --tokenizer-type NullTokenizer --vocab-size 1000 --num-layers 4 --hidden-size 256 "
         "--num-attention-heads 4 --ffn-hidden-size 1024 --swiglu --normalization RMSNorm "
         "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
         "--attention-dropout 0 --hidden-dropout 0").split()
SEQ, BATCH = 256, 2
DELAYED = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "4"]
TENSORWISE = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
BLOCKWISE = ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"]  # on fake CUDA: torch's block-scaled GEMM
# (model flags, layout): 16-bit and FP8 on one rank, FP8 with TP 2 + SP
RUNS = [(SMALL, Layout(1, 1, 1, micro_batch_size=2)), (SMALL + DELAYED, Layout(1, 1, 1, micro_batch_size=2)),
        (SMALL + TENSORWISE, Layout(2, 1, 1, micro_batch_size=2, sequence_parallel=True)),
        (SMALL + BLOCKWISE, Layout(2, 1, 1, micro_batch_size=2, sequence_parallel=True))]


@pytest.fixture(scope="module")
def measured():
    """The dry run of every run's flags, in one process."""
    return measure([(flags, layout, BATCH) for flags, layout in RUNS], SEQ)


def test_dry_run_holds_fp8_state_and_quantized_copies(measured):
    """Delayed scaling's amax histories [4, 3] and scales [3], fp32, per FP8 linear (4 layers x
    4 linears) are held with the parameters, as formulas.md's count plus them; the FP8 GEMMs'
    quantized copies raise the peak, by at most the planner's working set."""
    bf16, fp8 = measured[0], measured[1]
    state = 16 * delayed_state_bytes(4)
    assert fp8["resident"]["parameters"] - bf16["resident"]["parameters"] == state == 16 * 4 * 15
    assert fp8["resident"] == fp8["formula"]
    for category in ("gradients", "optimizer"):
        assert fp8["resident"][category] == bf16["resident"][category]
    work = from_flags(SMALL + DELAYED, SEQ, BATCH)
    extra = fp8["peak_total"] - bf16["peak_total"]
    assert 0 < extra <= fp8_memory_bytes(work, RUNS[1][1], list(range(4))), (extra, fp8["peak"], bf16["peak"])


@pytest.mark.parametrize("index", range(len(RUNS)))
def test_fp8_memory_within_5_percent_of_the_dry_run(measured, index):
    flags, layout = RUNS[index]
    predicted = rank_memory(from_flags(flags, SEQ, BATCH), layout, 0)
    assert (predicted.fp8 > 0) == (index > 0)
    assert predicted.total == pytest.approx(measured[index]["peak_total"], rel=0.05), (layout.short(), measured[index])


def _h100_predictions(hidden: int, ffn: int, extra=(), micro_batch_size: int = 2, base=()):
    """(16-bit, FP8 with `extra`) predictions; `base`: flags of both."""
    flags = list(base) + (
        f"--bf16 --tokenizer-type NullTokenizer --vocab-size 32000 --num-layers 4 --hidden-size {hidden} "
        f"--num-attention-heads 16 --ffn-hidden-size {ffn} --swiglu --disable-bias-linear "
        "--normalization RMSNorm --position-embedding-type rope").split()
    seq, layout, cluster = 4096, Layout(1, 1, 1, micro_batch_size=micro_batch_size), preset("h100", 1)
    return [predict(cluster, from_flags(flags + list(more), seq, micro_batch_size), layout)
            for more in ([], ["--fp8-format", "hybrid", *extra])]


@pytest.mark.parametrize("base,extra,cast_bytes,faster", [
    ([], [], 3, True),  # delayed scaling, the fused cast: a 16-bit read and a byte written
    ([], ["--fp8-recipe", "tensorwise"], 5, True),  # the fused amax pass, then the cast
    (["--no-fused-kernels"], [], QUANTIZE_BYTES, False),  # torch ops
])
def test_fp8_gemms_at_the_fp8_rate_and_the_casts_at_the_memory_bandwidth(base, extra, cast_bytes, faster):
    """The FP8 step's matmul part is the 16-bit one less the FP8 linears' GEMMs (6 T k n FLOPs
    each per micro-batch) at the bf16 rate, plus them at the FP8 rate (the embedding, output
    layer and attention core unchanged); --no-fp8-wgrad leaves a third of those GEMMs 16-bit;
    the memory-bound part grows by the casts, `cast_bytes` per element (quantize_bytes). At
    hidden 2048 the fused casts leave FP8 faster than 16-bit; megalite's unfused casts cost
    more than the GEMMs save (16-bit and FP8 both with --no-fused-kernels there)."""
    cluster, tokens, h, f = preset("h100", 1), 2 * 4096, 2048, 8192
    assert quantize_bytes(from_flags(base + SMALL + DELAYED + extra, SEQ, BATCH)) == cast_bytes
    bf16, fp8 = _h100_predictions(h, f, extra, base=base)
    no_wgrad = _h100_predictions(h, f, extra + ["--no-fp8-wgrad"], base=base)[1]
    shapes = [(h, 3 * h), (h, h), (h, 2 * f), (f, h)]  # QKV, projection, FC1 (SwiGLU), FC2
    gemm = 4 * sum(6 * tokens * k * n for k, n in shapes) / cluster.matmul_flops
    saved = gemm * (1 - cluster.peak_flops / cluster.fp8_peak_flops)  # the FP8 peak is twice bf16's: half
    # forward's x; dy once for dgrad and wgrad in both layouts (the fused cast writes one byte more,
    # the torch ops copy the result transposed); wgrad's x transposed (written so by the fused
    # cast, copied after the torch ops); the weight once per step (one micro-batch here), its
    # column-major copy for dgrad copied from that cast; --no-fp8-wgrad: dgrad's dy alone
    fused = cast_bytes != QUANTIZE_BYTES
    both = cast_bytes + (1 if fused else TRANSPOSE_BYTES)
    transposed = cast_bytes + (0 if fused else TRANSPOSE_BYTES)
    weight = cast_bytes + TRANSPOSE_BYTES
    casts = 4 * sum(cast_bytes * tokens * k + both * tokens * n + weight * k * n + transposed * tokens * k
                    for k, n in shapes) / cluster.memory_bandwidth
    casts_no_wgrad = 4 * sum(cast_bytes * (tokens * k + tokens * n) + weight * k * n
                             for k, n in shapes) / cluster.memory_bandwidth
    assert fp8.breakdown["matmul"] == pytest.approx(bf16.breakdown["matmul"] - saved, rel=1e-9)
    assert no_wgrad.breakdown["matmul"] == pytest.approx(bf16.breakdown["matmul"] - saved * 2 / 3, rel=1e-9)
    assert fp8.breakdown["memory-bound"] == pytest.approx(bf16.breakdown["memory-bound"] + casts, rel=1e-9)
    assert no_wgrad.breakdown["memory-bound"] == pytest.approx(bf16.breakdown["memory-bound"] + casts_no_wgrad,
                                                               rel=1e-9)
    assert fp8.step_time == pytest.approx(bf16.step_time - saved + casts, rel=1e-9)
    assert (fp8.step_time < bf16.step_time) == faster


@pytest.mark.parametrize("fused,shard_cast", [(True, 4 + 1), (False, QUANTIZE_BYTES)])
def test_fp8_param_gather_charges_each_ranks_shard_cast(fused, shard_cast):
    """--fp8-param-gather under FSDP2 (DP 2): no cached weight cast; each rank casts its fp32
    shard (half the weight) before the forward's and the backward's all-gather, with the fused
    cast (fp32 read, byte written) or the torch ops."""
    flags = ("--bf16 --tokenizer-type NullTokenizer --vocab-size 32000 --num-layers 4 --hidden-size 1024 "
             "--num-attention-heads 8 --ffn-hidden-size 4096 --disable-bias-linear --fp8-format hybrid").split()
    work = from_flags(flags + ([] if fused else ["--no-fused-kernels"]), 1024, 8)
    gathered = dataclasses.replace(work, fp8=dataclasses.replace(work.fp8, param_gather=True))
    cluster, layout = preset("h100", 2), Layout(1, 1, 2, micro_batch_size=2, fsdp2=True)
    per_step = 1 / layout.num_microbatches(8)
    weights = sum(k * n for k, n in [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)])
    weight_cast = quantize_bytes(work) + TRANSPOSE_BYTES  # the cached cast, copied column-major by dgrad
    cast_f, cast_b = fp8_layer_seconds(cluster, work, layout, 1)[2:]
    gathered_f, gathered_b = fp8_layer_seconds(cluster, gathered, layout, 1)[2:]
    bw = cluster.memory_bandwidth
    assert gathered_f - cast_f == pytest.approx((shard_cast * weights / 2 - weight_cast * weights * per_step) / bw, rel=1e-9)
    assert gathered_b - cast_b == pytest.approx(shard_cast * weights / 2 / bw, rel=1e-9)


def test_fp8_plans_the_planner_cannot_model_are_refused():
    """No FP8 peak on an A100 (no FP8 tensor cores); no FP8 model for MLA layers: one line each."""
    fp8 = from_flags("--bf16 --tokenizer-type NullTokenizer --vocab-size 1000 --num-layers 2 --hidden-size 64 "
                     "--num-attention-heads 4 --fp8-format hybrid".split(), 128, 2)
    assert preset("a100", 1).fp8_peak_flops is None
    with pytest.raises(ValueError, match="--fp8-format: cluster .* has no FP8 peak"):
        plan(fp8, preset("a100", 1))
    plan(dataclasses.replace(fp8, fp8=None), preset("a100", 1))  # the same model in 16-bit plans
    with pytest.raises(ValueError, match="--fp8-format with multi-latent attention"):
        plan(dataclasses.replace(fp8, config=mla_config(vocab_size=1000, hidden_size=32, num_layers=4)),
             preset("h100", 1))


def test_wide_fp8_plan_faster_by_the_gemm_share():
    """At hidden 16384 (FFN 53248) and 8 x 4096 tokens per micro-batch the GEMMs outgrow the
    casts: the FP8 step is faster, by the GEMM share the FP8 rate halves less the casts; with
    2 x 4096 tokens too, now that the weights are cast once per step (with their cast paid
    twice per micro-batch, as before the weight cache, it was slower: 4.60 s bf16, 3.95 s FP8
    at 8 x 4096 then)."""
    bf16, fp8 = _h100_predictions(16384, 53248, micro_batch_size=8)
    saved = bf16.breakdown["matmul"] - fp8.breakdown["matmul"]
    assert 0.3 * bf16.breakdown["matmul"] < saved < 0.5 * bf16.breakdown["matmul"]
    assert fp8.step_time < bf16.step_time
    assert bf16.step_time - fp8.step_time == pytest.approx(
        saved - (fp8.breakdown["memory-bound"] - bf16.breakdown["memory-bound"]), rel=1e-9)
    bf16, fp8 = _h100_predictions(16384, 53248, micro_batch_size=2)
    assert fp8.step_time < bf16.step_time
