"""The step on a GPU whose kernels were measured (cluster.KernelRates): each kernel megalite
runs, in the class whose measured rate times it, and the host's time per operator call.

Per layer, micro-batch and rank (T tokens on the rank, t tensor-parallel ranks, e bytes per
activation element; bytes read + written):

- dense GEMMs: compute.py's roofline (matmul efficiency); the weight-gradient GEMMs equal the
  forward's.
- attention (flash kernel): the causal half of the scores, forward 2 GEMMs (q k^T, p v),
  backward 5 (the scores again, dV, dP, dQ, dK), at `attention` of the peak; flash-attention
  2's backward (csrc/flash_attn/flash_api.cpp mha_bwd, which PyTorch builds) also runs
  `dot_do_o` (reads dO and O, zeroes an fp32 dQ accumulator), `convert_dq` (fp32 dQ to e) and,
  with grouped k/v heads, sums dK and dV over each group from per-query-head buffers: torch
  class. Without a flash kernel (--attention-backend unfused/local) compute.py's roofline.
- memory-bound kernels, as megalite's layer issues them (traffic_per_layer), each class at its
  measured fraction of the copy bandwidth; an op whose fusion is off (--no-*-fusion,
  --no-fused-kernels) moves its torch reference's bytes (REFERENCE, counted by running the
  references under a dispatch counter) at the torch rate.
- host: each operator call costs the host `host[op]` seconds; the GPU idles when the host falls
  behind. The host queues a micro-batch from an empty queue (each micro-batch starts after a
  host sync: its tokens' copy to the device); a layer's forward takes max(GPU, host) and its
  backward what the host's lead left over: with the layers alike, a chunk's time is its layers'.

Outside the layers: the embedding lookup and its dense gradient, the final norm, the output
GEMM, the cross-entropy (megalite's Triton kernel, or the torch path: fp32 chunks of the logits,
30 + 56 bytes per 16-bit logit as cross_entropy_torch.py runs), and per step the optimizer
(optimizer_step.py): gradient norm, clipping (Megatron's default --clip-grad 1.0 clips a young
model's gradients) and the update (fused AdamW, ...) at the `optimizer` rate, the copy of the
fp32 main parameters into the 16-bit ones and the zeroing of the gradient buffers at the torch
rate.

Updating the constants: `bash tools/benchmarks/gpu_check.sh` on the GPU profiles one step of
the 1.1B run and writes kernel_rates.json beside its table (each class's kernel time over this
module's count for it; gpu_check_report.py), which `plan.py --kernel-rates kernel_rates.json`
reads as it is. To make a new measurement the preset, carry the profile's seconds per class
(gpu_check_logs/profile.json) and bench_kernels' copy bandwidth into cluster.py's
ISSUE23_PROFILE-style table, with the date, the GPU and the versions.
"""

from megalite.planner.cluster import Cluster
from megalite.planner.layouts import Layout
from megalite.planner.parameters import fused_linear_weights, layer_parameters
from megalite.planner.workload import Workload

# Bytes a torch reference moves, in units of its output's size (swiglu: the activation's, half
# its input), and its operator count: (forward bytes, backward bytes, forward ops, backward
# ops), counted on megalite.kernels' references in bf16 (tests/planner/test_gpu_model.py); the
# Triton kernels' (FUSED): read the input, write the output, and in backward read the output's
# gradient too.
REFERENCE = {"rms_norm": (18, 48, 9, 16), "layer_norm": (10, 12, 8, 5), "swiglu": (19, 35, 5, 6),
             "bias_gelu": (14, 14, 7, 5), "rotary": (26, 26, 10, 7)}
FUSED = {"rms_norm": (2, 3), "layer_norm": (2, 3), "swiglu": (3, 5), "bias_gelu": (2, 3), "rotary": (2, 2)}
CE_CHUNK_ELEMENTS = 1 << 24  # cross_entropy_torch.TORCH_CHUNK_ELEMENTS
CE_TORCH_OPS = (10, 12)  # operators per chunk


class Traffic:
    """Bytes per kernel class and host operator calls, forward and backward, of one piece of work."""

    def __init__(self):
        self.bytes = {}  # kind -> [forward, backward]
        self.calls = {}  # op -> [forward, backward]

    def move(self, kind: str, forward: float, backward: float) -> None:
        pair = self.bytes.setdefault(kind, [0.0, 0.0])
        pair[0] += forward
        pair[1] += backward

    def call(self, op: str, forward: float, backward: float) -> None:
        pair = self.calls.setdefault(op, [0.0, 0.0])
        pair[0] += forward
        pair[1] += backward

    def fused_or_reference(self, fused: bool, op: str, kind: str, unit: float) -> None:
        """One call of megalite op `op` whose output (swiglu, bias_gelu: activation) is `unit`
        bytes: its Triton kernel, or its torch reference."""
        if fused:
            self.move(kind, FUSED[op][0] * unit, FUSED[op][1] * unit)
            self.call(op, 1, 1)
        else:
            forward, backward, ops_f, ops_b = REFERENCE[op]
            self.move("torch", forward * unit, backward * unit)
            self.call("aten", ops_f, ops_b)

    def seconds(self, cluster: Cluster) -> tuple[float, float, float, float]:
        """(GPU forward, GPU backward, host forward, host backward) seconds."""
        rates = cluster.kernels
        gpu = [sum(pair[i] / rates.rate(kind) for kind, pair in self.bytes.items()) for i in (0, 1)]
        host = [sum(pair[i] * rates.host[op][i] for op, pair in self.calls.items()) for i in (0, 1)]
        return gpu[0], gpu[1], host[0], host[1]


def fused(workload: Workload, op: str) -> bool:
    return workload.config.kernel_impl_for(op) != "torch"


def _residual(traffic: Traffic, workload: Workload, elements: float, count: int) -> None:
    """`count` x bias-dropout-add on `elements` and their backward, with the sum of the two
    branches' gradients at the residual. Fused (megalite's kernel, classed and timed with the
    bias-GeLU kernels: Triton elementwise kernels with a bias): read x and the residual, write the
    sum; backward, with dropout, read the gradient and write dx (the mask regenerated, the
    row-parallel bias gradient summed inside). Unfused: torch's dropout (its mask a byte an
    element) and add; the row-parallel bias add before them is counted with the biases."""
    e, dropout = workload.activation_bytes, workload.config.hidden_dropout > 0
    traffic.move("torch", 0.0, count * 3 * e * elements)
    traffic.call("aten", 0, count)
    if bias_dropout_add_fused(workload):
        traffic.move("bias_gelu", count * 3 * e * elements, count * 2 * e * elements if dropout else 0.0)
        traffic.call("bias_gelu", count, count if dropout else 0)
        return
    per = (2 * e + 1) * elements if dropout else 0.0  # read, write, the mask's byte
    traffic.move("torch", count * (per + 3 * e * elements), count * per)
    traffic.call("aten", count * (1 + dropout), count * dropout)


def bias_dropout_add_fused(workload: Workload) -> bool:
    """Whether the layers' bias-dropout-add runs megalite's kernel (it does when there is a bias
    to add or a dropout to draw; else it is one torch add)."""
    config = workload.config
    return fused(workload, "bias_dropout_add") and (config.hidden_dropout > 0 or config.add_bias_linear)


def _norms(traffic: Traffic, workload: Workload, elements: float, count: float) -> None:
    op = "rms_norm" if workload.config.normalization == "RMSNorm" else "layer_norm"
    for _ in range(int(count)):
        traffic.fused_or_reference(fused(workload, op), op, "norm", elements * workload.activation_bytes)


def layer_traffic(workload: Workload, layout: Layout, tokens: float, moe_layer: bool) -> Traffic:
    """Memory-bound bytes and operator calls of one transformer layer (attention GEMMs and the
    flash kernel aside) on one rank, one micro-batch."""
    config, t, e = workload.config, layout.tp, workload.activation_bytes
    d = config.kv_channels
    q, kv, h = config.num_attention_heads * d / t, config.num_query_groups * d / t, config.hidden_size
    split = t if layout.sequence_parallel else 1
    traffic = Traffic()
    _norms(traffic, workload, tokens * h / split, 2)
    _residual(traffic, workload, tokens * h / split, 2)
    rotated = config.position_embedding_type == "rope"
    if config.qk_layernorm:
        _norms(traffic, workload, tokens * q, 1)
        _norms(traffic, workload, tokens * kv, 1)
    if rotated:
        tables = 2 * 2 * workload.seq_length * d * 4  # each call reads the fp32 cos and sin tables
        for width in (q, kv):
            traffic.fused_or_reference(fused(workload, "rotary"), "rotary", "rotary", tokens * width * e)
            traffic.move("rotary" if fused(workload, "rotary") else "torch", tables / 2, tables / 2)
    # q, k, v are views of the fused QKV output; a grouped q is copied by its reshape, and when
    # any of them is a new tensor the views among the others are cloned (attention.py)
    grouped = config.num_query_groups != config.num_attention_heads
    new_q, new_k = grouped or rotated or config.qk_layernorm, rotated or config.qk_layernorm
    copies = (q * grouped + (kv if new_q and not new_k else 0) + (kv if new_q or new_k else 0)) * tokens
    traffic.move("torch", 2 * e * copies, 0.0)
    traffic.call("aten", grouped + (new_q and not new_k) + (new_q or new_k), 0)
    # the QKV gradient is assembled from the three slice gradients by one cat (SplitGroupedQKV)
    traffic.move("torch", 0.0, 2 * e * tokens * (q + 2 * kv))
    traffic.call("aten", 0, 1)
    if config.add_bias_linear:  # the row-parallel biases added after the reduction; bias gradients
        fused_bias = bias_dropout_add_fused(workload)  # the adds, and with dropout the sums, in that kernel
        summed = 0.0 if fused_bias and config.hidden_dropout > 0 else 2 * h / split
        traffic.move("torch", 0.0 if fused_bias else 2 * 2 * e * tokens * h / split, e * tokens * (q + 2 * kv + summed))
        traffic.call("aten", 0 if fused_bias else 2, 1 + (2 if summed else 0))
    activation(traffic, workload, layout, tokens, moe_layer)
    return traffic


def activation(traffic: Traffic, workload: Workload, layout: Layout, tokens: float, moe_layer: bool) -> None:
    """The MLP's activation (MoE: the routed tokens' and the shared expert's) and MoE routing."""
    config, t, e = workload.config, layout.tp, workload.activation_bytes
    widths = [(tokens, config.ffn_hidden_size)]
    if moe_layer:
        moe = config.moe
        widths = [(tokens * moe.router_topk, moe.ffn_hidden_size)]
        if moe.shared_expert_intermediate_size:
            widths.append((tokens, moe.shared_expert_intermediate_size))
        # router scores and top-k, and each routed token's hidden state permuted there and back
        traffic.move("torch", e * (3 * tokens * moe.num_experts + 4 * tokens * moe.router_topk * config.hidden_size),
                     e * 4 * tokens * moe.router_topk * config.hidden_size)
        traffic.call("aten", 12, 12)
    for rows, width in widths:
        unit = rows * width / t * e
        if config.activation == "swiglu":
            traffic.fused_or_reference(fused(workload, "swiglu"), "swiglu", "swiglu", unit)
        elif config.activation == "squared_relu":  # relu and square, plain torch
            traffic.move("torch", 4 * unit, 6 * unit)
            traffic.call("aten", 2, 4)
        else:
            traffic.fused_or_reference(fused(workload, "bias_gelu"), "bias_gelu", "bias_gelu", unit)


def attention_seconds(cluster: Cluster, workload: Workload, layout: Layout, tokens: float) -> tuple[float, float, float]:
    """(forward, backward, backward auxiliary) seconds of the flash kernel for one layer on one
    rank: the causal FLOPs at the measured fraction of the peak, the auxiliary kernels at the
    torch rate."""
    config, t, e = workload.config, layout.tp, workload.activation_bytes
    d, heads, groups = config.kv_channels, config.num_attention_heads / t, config.num_query_groups / t
    keys = workload.seq_length  # with CP each rank's queries meet every earlier key: 1/cp of the causal work
    forward_flops = 4 * tokens * keys * heads * d / 2
    rate = cluster.peak_flops * cluster.kernels.attention
    q_bytes, k_bytes = tokens * heads * d * e, tokens * groups * d * e
    aux = 7 * q_bytes + (2 * q_bytes + 2 * k_bytes if groups != heads else 0.0)
    return forward_flops / rate, 2.5 * forward_flops / rate, aux / cluster.kernels.rate("torch")


def host_bound(gpu_f: float, gpu_b: float, host_f: float, host_b: float) -> tuple[float, float]:
    """(forward, backward) seconds the GPU waits for the host: the forward starts from an empty
    queue; the backward gets the lead the host built during the forward."""
    forward = max(gpu_f, host_f)
    backward = max(gpu_b, host_f + host_b - forward)
    return forward - gpu_f, backward - gpu_b


def measured_layer(cluster: Cluster, workload: Workload, layout: Layout, tokens: float, moe_layer: bool,
                   gemms: tuple, accumulate_bytes: float, score_elements: float) -> tuple[list, float]:
    """One layer's compute on a measured GPU: matmul (gemms: the forward's dense GEMM seconds,
    the attention core's by the roofline, the number of dense GEMMs), attention, memory-bound
    kernels, host-bound waits; recompute as layout.recompute says. Without a flash kernel the
    attention core is the roofline's and its softmax and dropout (`score_elements`) torch work.
    Returns ([(part, forward s, backward s)], the weight-gradient GEMMs' s)."""
    dense, core, dense_gemms = gemms
    traffic = layer_traffic(workload, layout, tokens, moe_layer)
    traffic.move("torch", 0.0, accumulate_bytes)
    traffic.call("aten", dense_gemms + 1, 2 * dense_gemms + 1)  # the GEMMs and the attention kernel
    traffic.call("aten", 0, accumulate_params(workload))
    full, selective = layout.recompute == "full", layout.recompute == "selective"
    if workload.flash_attention:
        attn_f, attn_b, aux = attention_seconds(cluster, workload, layout, tokens)
    else:
        scores = score_elements * workload.activation_bytes
        traffic.move("torch", scores, 2 * scores)
        redone = scores / cluster.kernels.rate("torch") if selective else 0.0  # the softmax again
        attn_f, attn_b, aux = core, 2 * core, redone
    gpu_f, gpu_b, host_f, host_b = traffic.seconds(cluster)
    parts = [("matmul", dense, 2 * dense + (dense if full else 0.0)),
             ("attention", attn_f, attn_b + (attn_f if full or selective else 0.0)),
             ("memory-bound", gpu_f, gpu_b + aux + (gpu_f if full else 0.0))]
    compute_f, compute_b = dense + attn_f + gpu_f, 2 * dense + attn_b + aux + gpu_b
    if full:
        compute_b, host_b = compute_b + compute_f, host_b + host_f
    return parts + [("operators", *host_bound(compute_f, compute_b, host_f, host_b))], dense


def accumulate_params(workload: Workload) -> int:
    """Parameter tensors of a layer (one gradient accumulation each)."""
    config = workload.config
    tensors = 4 + 2 + (2 if config.qk_layernorm else 0)  # QKV, proj, fc1, fc2, two norms
    if config.add_bias_linear:
        tensors += 4
    if config.normalization == "LayerNorm":
        tensors += 2
    return tensors


def output_traffic(workload: Workload, layout: Layout, tokens: float, vocab: float) -> Traffic:
    """The final norm and the cross-entropy over `vocab` columns of the logits on this rank."""
    config, e = workload.config, workload.activation_bytes
    traffic = Traffic()
    split = layout.tp if layout.sequence_parallel else 1
    _norms(traffic, workload, tokens * config.hidden_size / split, 1)
    logits = tokens * vocab
    if fused(workload, "cross_entropy"):
        traffic.move("cross_entropy", e * logits, 2 * e * logits)
        traffic.call("cross_entropy", 1, 1)
    else:  # cross_entropy_torch.py, per logit: to fp32, max, subtract, exp, sum; backward: to fp32,
        # three subtractions, exp, scale, back to e, into the gradient (30 + 56 B at e = 2)
        traffic.move("torch", (e + 28) * logits, (4 * e + 48) * logits)
        chunks = -(-tokens // max(1, CE_CHUNK_ELEMENTS // vocab))
        traffic.call("aten", CE_TORCH_OPS[0] * chunks, CE_TORCH_OPS[1] * chunks)
    return traffic


def embedding_traffic(workload: Workload, layout: Layout, tokens: float, vocab: float) -> Traffic:
    """The lookup (and the embedding dropout), and the dense gradient of the table; a table the
    output layer shares on this stage gets two gradients, which autograd adds (unless gradient
    accumulation fusion adds the output layer's into main_grad in its GEMM)."""
    config, e = workload.config, workload.activation_bytes
    h = config.hidden_size
    traffic = Traffic()
    traffic.move("torch", 2 * e * tokens * h, e * (tokens * h + vocab * h))
    traffic.call("aten", 1, 1)
    tied = not config.untie_embeddings_and_output_weights and layout.pp == 1 and layout.vp == 1
    if tied and not workload.gradient_accumulation_fusion:  # fused, the output layer's share goes to main_grad
        traffic.move("torch", 0.0, 3 * e * vocab * h)
        traffic.call("aten", 0, 1)
    if config.position_embedding_type == "learned_absolute":  # the position lookup, added
        traffic.move("torch", 5 * e * tokens * h, e * (tokens * h + workload.seq_length * h))
        traffic.call("aten", 2, 1)
    if config.hidden_dropout > 0:
        traffic.move("torch", (2 * e + 1) * tokens * h, (2 * e + 1) * tokens * h)
        traffic.call("aten", 1, 1)
    return traffic


def output_seconds(cluster: Cluster, workload: Workload, layout: Layout, tokens: float, vocab: float,
                   accumulate_bytes: float, gemm: float) -> list:
    """[(part, forward s, backward s)] of the final norm, the output GEMM (`gemm` s forward) and
    the cross-entropy."""
    traffic = output_traffic(workload, layout, tokens, vocab)
    traffic.move("torch", 0.0, accumulate_bytes)
    traffic.call("aten", 1, 2)
    gpu_f, gpu_b, host_f, host_b = traffic.seconds(cluster)
    return [("matmul", gemm, 2 * gemm), ("memory-bound", gpu_f, gpu_b),
            ("operators", *host_bound(gemm + gpu_f, 2 * gemm + gpu_b, host_f, host_b))]


def embedding_seconds(cluster: Cluster, workload: Workload, layout: Layout, tokens: float, vocab: float,
                      accumulate_bytes: float) -> list:
    traffic = embedding_traffic(workload, layout, tokens, vocab)
    traffic.move("torch", 0.0, accumulate_bytes)
    gpu_f, gpu_b, _, _ = traffic.seconds(cluster)
    return [("memory-bound", gpu_f, gpu_b)]


def accumulated_parameters(workload: Workload, layer: int, layout: Layout) -> float:
    """Parameters of transformer layer `layer` on one rank whose gradients the DDP hook adds into
    main_grad (the rest are accumulated inside their GEMM under gradient accumulation fusion)."""
    config = workload.config
    total = sum(layer_parameters(config, layer, layout.tp, layout.ep))
    return total - fused_linear_weights(config, layer, layout.tp) * workload.gradient_accumulation_fusion


def accumulation_bytes(workload: Workload, num_params: float) -> float:
    """Bytes of adding one micro-batch's weight gradients into the main-gradient buffers."""
    weight, grad = (4, 4) if workload.precision == "fp32" else (2, 2) if workload.precision == "fp16" else (2, 4)
    return num_params * (weight + 2 * grad)


def step_traffic(workload: Workload, layout: Layout) -> dict:
    """{kernel class: [forward bytes, backward bytes]} of one step of a one-stage layout (pp = 1)
    on one rank, the optimizer aside: what a profile's kernel times are divided by to measure
    the classes' rates (tools/benchmarks/gpu_check_report.py) and what the tests recount."""
    if layout.pp != 1:
        raise ValueError("step_traffic: one pipeline stage only")
    config = workload.config
    tokens = layout.micro_batch_size * workload.seq_length / layout.cp
    vocab = config.padded_vocab_size(layout.tp) / layout.tp
    total = Traffic()
    for layer in range(config.num_layers):
        moe = config.moe is not None and config.moe.is_moe_layer(layer, config.num_layers)
        piece = layer_traffic(workload, layout, tokens, moe)
        piece.move("torch", 0.0, accumulation_bytes(workload, accumulated_parameters(workload, layer, layout)))
        _add(total, piece)
    _add(total, output_traffic(workload, layout, tokens, vocab))
    _add(total, embedding_traffic(workload, layout, tokens, vocab))
    # the embedding's gradient is added by the hook; an untied output layer's is fused
    untied_unfused = config.untie_embeddings_and_output_weights and not workload.gradient_accumulation_fusion
    tables = (1 + untied_unfused) * vocab * config.hidden_size
    if config.position_embedding_type == "learned_absolute":
        tables += config.max_position_embeddings * config.hidden_size
    total.move("torch", 0.0, accumulation_bytes(workload, tables + config.hidden_size))  # and the final norm's
    steps = layout.num_microbatches(workload.global_batch_size)
    return {kind: [steps * pair[0], steps * pair[1]] for kind, pair in total.bytes.items()}


def _add(total: Traffic, piece: Traffic) -> None:
    for kind, (forward, backward) in piece.bytes.items():
        total.move(kind, forward, backward)
    for op, (forward, backward) in piece.calls.items():
        total.call(op, forward, backward)
