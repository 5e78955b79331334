"""An --fp8-format run's time and memory beyond the 16-bit run's, as megalite's FP8 linears
(megalite/parallel/tensor/fp8_gemm.py) run them: the attention's and the MLP's column- and
row-parallel linears of the FP8 decoder layers (a MoE layer's shared expert, not its routed
experts or router); the embedding, the output layer and the attention core stay 16-bit.

Time, per FP8 linear and micro-batch (x [T, k] W^T with W [n, k] on this rank):
- each of its GEMMs (fprop, dgrad, and wgrad unless --no-fp8-wgrad) at the card's dense FP8
  peak x the same matmul efficiency as 16-bit (an assumption until a GPU measures it), FP8
  operands (1 byte) and a 16-bit result, in place of the 16-bit GEMM;
- the casts, at the memory bandwidth, quantize_bytes per quantized element: on CUDA the fused
  Triton cast (megalite/kernels/fp8_cast_triton.py) reads the 16-bit element once and writes
  its byte with delayed scaling (e + 1 = 3 bytes, the amax from the same read), and reads it
  twice with tensorwise scaling (the amax pass, then the cast: 2e + 1 = 5); with the kernels
  off (--no-fused-kernels) or another recipe, unfused torch operators move QUANTIZE_BYTES
  (amax: abs 2 + 2, amax 2; fp32 copy 2 + 4; scale 4 + 4; clamp 4 + 4; cast 4 + 1 = 33 bytes).
  Forward quantizes x. Backward quantizes dy once for dgrad and wgrad in both layouts
  (cast_transpose_bytes: the fused cast writes one byte more, 4 or 6; the torch ops copy the
  FP8 result transposed, 33 + 2), and wgrad's x transposed (the fused cast writes it
  transposed; the torch ops cast, then copy: 33 + 2); with --no-fp8-wgrad only dgrad's dy,
  row-major. The weight is cast once per optimizer step (fp8_gemm.py's WeightCache) and its
  column-major copy for dgrad copied from that cast by the first dgrad (2 bytes more an
  element), spread over the step's micro-batches (charged to forward). With --fp8-param-gather under FSDP2 the
  gathered weight is not cached: each rank casts its fp32 shard (W / (DP x CP) elements)
  before each all-gather, forward and dgrad, per micro-batch: 4 + 1 bytes an element with the
  fused cast (plus, tensorwise, the amax pass once per step: 4), QUANTIZE_BYTES with torch ops;
- tensorwise scaling: an all-reduce of one fp32 amax over TP per split operand cast (the
  weight once per step, at its cached cast; dy of a column-parallel linear once per backward;
  x of a row-parallel one in forward and in wgrad), at the latency of the group.

Memory: per delayed-scaling FP8 linear its fp32 amax history [len, 3] and scales [3]; per FP8
linear its cached FP8 weight (1 byte per element of W, held through the step; its column-major
copy is made by the first dgrad, as activations are freed, and is not counted); and the quantization working set of the rank's largest FP8 linear, taken
as held on top of the activation peak (backward runs it while the activations are held): with
the torch ops the largest of forward's 5X (x's fp32 copy and FP8 copy) or X + 5W, dgrad's 5G
(dy's fp32 and FP8 copies; then its FP8 copy in both layouts), wgrad's G + 5X or G + 2X + 4W
(dy's transposed copy, x's, and the fp32 result added into main_grad); with the fused cast
(no fp32 copies, the transposed copies written by the cast) X, 2G or G + X + 4W; without the
FP8 wgrad only forward's and dgrad's (G or 5G);
with X = T k, G = T n, W = k n elements (T the micro-batch's tokens: a sequence-parallel
column linear gathers its input, a row linear reduce-scatters its output). --fp8-recipe
blockwise (parallel/tensor/fp8_blockwise.py) adds its fp32 scales, one per 128x128 block of W
and at most one per 128 elements of the working set; its casts move the same 33 bytes per
element (dy twice: dgrad's and wgrad's tiles run along different axes) and it reduces no
amax. Checked against the dry run (tests/planner/test_fp8_planner.py).
"""

from megalite.parallel.tensor.fp8_scaling import delayed_state_bytes
from megalite.planner.layouts import Layout
from megalite.planner.workload import Workload

QUANTIZE_BYTES = 33  # per element, unfused torch ops
TRANSPOSE_BYTES = 2
SHARD_BYTES = 4  # --fp8-param-gather: the fp32 main parameter's shard is cast
FUSED_RECIPES = ("delayed", "tensorwise")  # the scalings the fused cast serves (parallel/tensor/fp8_fused_cast.py)


def fused_cast(workload: Workload) -> bool:
    """Whether the run's FP8 casts are the fused Triton kernel (CUDA with the kernels on)."""
    return workload.config.kernel_impl != "torch" and workload.fp8.scaling in FUSED_RECIPES


def quantize_bytes(workload: Workload) -> float:
    """Bytes one FP8 cast moves per element (module docstring)."""
    if not fused_cast(workload):
        return QUANTIZE_BYTES
    e = workload.activation_bytes
    return e + 1 if workload.fp8.scaling == "delayed" else 2 * e + 1


def cast_transpose_bytes(workload: Workload) -> float:
    """Bytes a cast writing both layouts (dy for dgrad and wgrad, the weight and its column-major
    copy) moves per element: the fused cast's one more byte written, or the torch ops' cast then
    a transposing copy."""
    if not fused_cast(workload):
        return QUANTIZE_BYTES + TRANSPOSE_BYTES
    return quantize_bytes(workload) + 1


def check_fp8_plan(workload: Workload, cluster) -> None:
    """ValueError naming the flag when the planner has no FP8 model for this model or card."""
    if workload.fp8 is None:
        return
    if workload.config.mla is not None or workload.config.gdn is not None:
        raise ValueError("--fp8-format with multi-latent attention or Gated DeltaNet layers: the planner's FP8 "
                         "model covers standard attention's linears only")
    if cluster.fp8_peak_flops is None:
        raise ValueError(f"--fp8-format: cluster {cluster.name} has no FP8 peak (fp8_peak_flops): FP8 GEMMs need "
                         "an sm_89+ GPU; give fp8_peak_flops in the cluster JSON")


def is_fp8_layer(workload: Workload, layer: int) -> bool:
    return workload.fp8 is not None and workload.fp8.is_fp8_layer(layer, workload.config.num_layers)


def fp8_linears(workload: Workload, layout: Layout, layer: int) -> list[tuple[float, float, float, str]]:
    """(T, k, n, 'column' or 'row') of layer `layer`'s FP8 linears on one rank; [] for a 16-bit layer."""
    if not is_fp8_layer(workload, layer):
        return []
    config, t = workload.config, layout.tp
    tokens = layout.micro_batch_size * workload.seq_length / layout.cp
    h, d = config.hidden_size, config.kv_channels
    q, kv = config.num_attention_heads * d, config.num_query_groups * d
    up = 2 if config.activation == "swiglu" else 1
    linears = [(tokens, h, (q * (2 if config.attention_output_gate else 1) + 2 * kv) / t, "column"),
               (tokens, q / t, h, "row")]
    moe = config.moe
    if moe is not None and moe.is_moe_layer(layer, config.num_layers):
        ffn = moe.shared_expert_intermediate_size or 0
    else:
        ffn = config.ffn_hidden_size
    if ffn:
        linears += [(tokens, h, up * ffn / t, "column"), (tokens, ffn / t, h, "row")]
    return linears


def _gemm_seconds(flops_rate: float, bandwidth: float, m: float, k: float, n: float, operand: int,
                  result: int) -> float:
    return max(2 * m * k * n / flops_rate, (operand * (m * k + k * n) + result * m * n) / bandwidth)


def fp8_layer_seconds(cluster, workload: Workload, layout: Layout, layer: int,
                      tp_group=None) -> tuple[float, float, float, float]:
    """(GEMM seconds forward, backward, casts forward, backward) that layer `layer`'s FP8
    linears add to its 16-bit time on one rank (GEMM seconds negative: FP8 is faster);
    `tp_group` the ranks of its TP group (tensorwise amax all-reduces)."""
    linears = fp8_linears(workload, layout, layer)
    if not linears:
        return 0.0, 0.0, 0.0, 0.0
    check_fp8_plan(workload, cluster)
    e, bw, recipe = workload.activation_bytes, cluster.memory_bandwidth, workload.fp8
    bf16_rate, fp8_rate = cluster.matmul_flops, cluster.fp8_peak_flops * cluster.matmul_efficiency
    per_step = 1 / layout.num_microbatches(workload.global_batch_size)
    quantize, fused, both = quantize_bytes(workload), fused_cast(workload), cast_transpose_bytes(workload)
    transposed = quantize + (0 if fused else TRANSPOSE_BYTES)  # wgrad's x: written transposed, or copied
    gathered = recipe.param_gather and layout.fsdp2
    gemm_f = gemm_b = cast_f = cast_b = 0.0
    for tokens, k, n, mode in linears:
        # fprop [T,k]x[k,n]; dgrad [T,n]x[n,k]; wgrad [k,T]x[T,n]: the same FLOPs and operand sizes
        delta = _gemm_seconds(fp8_rate, bw, tokens, k, n, 1, e) - _gemm_seconds(bf16_rate, bw, tokens, k, n, e, e)
        gemm_f += delta
        gemm_b += delta * (2 if recipe.wgrad else 1)
        x, g, w = tokens * k, tokens * n, k * n
        cast_f += quantize * x / bw
        if not recipe.wgrad:  # dgrad's dy, row-major
            cast_b += quantize * g / bw
        elif recipe.scaling == "blockwise":  # dy's 1x128 tiles differ between dgrad and wgrad: cast twice
            cast_b += (quantize * g + transposed * (g + x)) / bw
        else:
            cast_b += (both * g + transposed * x) / bw
        if gathered:  # each rank casts its fp32 shard before each all-gather: forward and dgrad
            shard = w / (layout.dp * layout.cp)
            shard_cast = SHARD_BYTES + 1 if fused else QUANTIZE_BYTES
            cast_f += shard_cast * shard / bw
            cast_b += shard_cast * shard / bw
            if fused and recipe.scaling == "tensorwise":  # the shard's amax pass, once per step
                cast_f += SHARD_BYTES * shard * per_step / bw
        else:  # cast once per step; the first dgrad copies the cast column-major
            cast_f += (quantize + TRANSPOSE_BYTES) * w * per_step / bw
        if recipe.scaling == "tensorwise" and tp_group is not None and len(tp_group) > 1:
            reduce = cluster.collective_time("all_reduce", 4, tp_group)
            # forward: W once per step (its cached cast; its FSDP2 scales: one reduction for all
            # weights, not counted), x of a row linear; backward: dy of a column linear once,
            # x of a row linear in wgrad
            cast_f += reduce * ((mode == "row") + (0 if gathered else per_step))
            cast_b += reduce * ((mode == "column") + (mode == "row" and recipe.wgrad))
    return gemm_f, gemm_b, cast_f, cast_b


def fp8_memory_bytes(workload: Workload, layout: Layout, layers: list[int]) -> float:
    """Bytes an FP8 rank holding decoder `layers` adds: delayed-scaling states, the cached FP8
    weights and the largest FP8 linear's quantization working set (module docstring)."""
    linears = [linear for layer in layers for linear in fp8_linears(workload, layout, layer)]
    if not linears:
        return 0.0
    state = delayed_state_bytes(workload.fp8.amax_history_len) * len(linears) \
        if workload.fp8.scaling == "delayed" else 0
    recipe = workload.fp8
    cached = 0.0 if recipe.param_gather and layout.fsdp2 else sum(k * n for _, k, n, _ in linears)
    working, fused = 0.0, fused_cast(workload)
    for tokens, k, n, _ in linears:
        x, g, w = tokens * k, tokens * n, k * n
        if fused:
            sizes = (x, 2 * g, g + x + 4 * w) if recipe.wgrad else (x, g)
        else:
            sizes = (5 * x, x + 5 * w, 5 * g) + ((g + 5 * x, g + 2 * x + 4 * w) if recipe.wgrad else ())
        working = max(working, *sizes)
    if recipe.scaling == "blockwise":  # fp32 scales: one per 128x128 block of W, at most one per 128 elements
        cached, working = cached * (1 + 4 / 128 ** 2), working * (1 + 4 / 128)
    return state + cached + working
