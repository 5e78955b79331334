"""The planner's step-time pieces: GEMM FLOPs equal formulas.md's model FLOPs (megalite's
flops.py), tensor-parallel collectives as formulas.md counts them, the ring model and its
topology, the pipeline part taken from megalite's schedule simulator (the bubble formula on
uniform stages), data-parallel traffic with overlap, the optimizer shard, the shared-core
bound of a CPU machine."""

from dataclasses import replace

import pytest

from megalite.parallel.pipeline.schedules import all_ranks
from megalite.parallel.pipeline.simulator import Costs, simulate
from megalite.planner.cluster import Cluster, preset
from megalite.planner.compute import layer_gemms, layer_times, output_times
from megalite.planner.layouts import Layout
from megalite.planner.step import chunk_times, predict
from megalite.training.flops import flops_per_token
from tests.planner.models import GPT, LLAMA, MOE, workload

H100 = preset("h100", 64).replace(kernels=None)  # the roofline (compute.py); measured kernels: test_gpu_model.py


def layout(tp=1, pp=1, dp=1, vp=1, cp=1, ep=1, mbs=1, sp=False, recompute="none", do=False):
    schedule = "none" if pp == 1 else "interleaved_1f1b" if vp > 1 else "1f1b"
    return Layout(tp, pp, dp, vp, cp, ep, mbs, sp, recompute, do, schedule)


@pytest.mark.parametrize("config, ep", [(GPT, 1), (LLAMA, 1), (MOE, 2)])
@pytest.mark.parametrize("t", [1, 2])
def test_gemm_flops_are_the_model_flops(config, ep, t):
    w = workload(config, seq=128, batch=16)
    lay = layout(tp=t, dp=ep, ep=ep, mbs=2)
    tokens = 2 * 128
    forward = 0.0
    for layer in range(config.num_layers):
        moe = config.moe is not None and config.moe.is_moe_layer(layer, config.num_layers)
        for m, k, n, b, kind in layer_gemms(w, lay, tokens, moe):  # router GEMMs: the same on every TP rank
            forward += 2 * m * k * n * b / (t if kind == "router" else 1)
    forward += 2 * tokens * config.hidden_size * config.padded_vocab_size(t) / t  # the output layer
    # one TP rank's share, times t ranks, is the whole forward: a third of the training FLOPs
    padded = config.padded_vocab_size(t)
    assert forward * t == pytest.approx(flops_per_token(config, 128, padded) * tokens / 3, rel=1e-9)


def test_tensor_parallel_collectives_per_layer():
    w = workload(GPT, seq=128, batch=16)
    nbytes = 2 * 128 * GPT.hidden_size * 2  # b x s x h, bf16
    group = list(range(2))
    all_reduce = H100.collective_time("all_reduce", nbytes, group)
    sp = H100.collective_time("all_gather", nbytes, group) + H100.collective_time("reduce_scatter", nbytes, group)
    ops = (0, 0)
    assert layer_times(H100, w, layout(tp=2, mbs=2), 0, ops).parts["tensor-parallel"] == pytest.approx(4 * all_reduce)
    # SP: the QKV and FC1 inputs gathered again in backward, overlapped with the input-gradient
    # GEMMs (about the forward's): what those do not hide is exposed
    from megalite.planner.compute import _layer_gemms
    dense, _ = _layer_gemms(H100, w, layout(tp=2, mbs=2, sp=True), 2 * 128, False)
    regather = 2 * H100.collective_time("all_gather", nbytes, group) - dense
    assert regather > 0  # this small layer's gathers are latency, longer than its GEMMs
    assert layer_times(H100, w, layout(tp=2, mbs=2, sp=True), 0, ops).parts["tensor-parallel"] == \
        pytest.approx(4 * sp + regather)
    fast = H100.replace(intra_node_latency=0.0, intra_node_bandwidth=1e18)
    fast_sp = fast.collective_time("all_gather", nbytes, group) + fast.collective_time("reduce_scatter", nbytes, group)
    assert layer_times(fast, w, layout(tp=2, mbs=2, sp=True), 0, ops).parts["tensor-parallel"] == \
        pytest.approx(4 * fast_sp)  # hidden
    full = layer_times(H100, w, layout(tp=2, mbs=2, recompute="full"), 0, ops)
    assert full.parts["tensor-parallel"] == pytest.approx(6 * all_reduce)  # the recomputed forward's two again
    assert layer_times(H100, w, layout(mbs=2), 0, ops).parts["tensor-parallel"] == 0


def test_recompute_adds_its_forward_to_the_backward():
    w, ops = workload(GPT, seq=128, batch=16), (0, 0)
    none = layer_times(H100, w, layout(mbs=2), 0, ops)
    full = layer_times(H100, w, layout(mbs=2, recompute="full"), 0, ops)
    selective = layer_times(H100, w, layout(mbs=2, recompute="selective"), 0, ops)
    assert full.forward == none.forward
    assert full.backward == pytest.approx(none.backward + none.forward)
    assert none.backward < selective.backward < full.backward
    # selective recompute redoes the core attention: with a flash kernel its GEMMs only, without
    # one also the softmax and dropout over the s x s scores
    assert selective.parts["memory-bound"] == none.parts["memory-bound"]
    unfused = workload(GPT, seq=128, batch=16, flash=False)
    plain = layer_times(H100, unfused, layout(mbs=2), 0, ops).parts["memory-bound"]
    redone = layer_times(H100, unfused, layout(mbs=2, recompute="selective"), 0, ops).parts["memory-bound"]
    scores = 4 * 2 * 128 * 128 * GPT.num_attention_heads * 2 / H100.memory_bandwidth
    assert redone - plain == pytest.approx(scores)


def test_ring_model_and_topology():
    cluster = preset("a100", 32)
    s = 1e9
    inside, across = cluster.intra_node_bandwidth, cluster.inter_node_bandwidth
    assert cluster.collective_time("all_reduce", s, list(range(8))) == pytest.approx(
        2 * 7 / 8 * s / inside + 14 * cluster.intra_node_latency)
    # one rank per node: one NIC; 8 per node over 2 nodes: 8 NICs, capped by NVLink
    assert cluster.collective_time("all_gather", s, [0, 8, 16, 24]) == pytest.approx(
        3 / 4 * s / across + 3 * cluster.inter_node_latency)
    assert cluster.group_link(list(range(16)))[1] == min(inside, 8 * across)
    assert cluster.collective_time("p2p", s, [7, 8]) == pytest.approx(cluster.inter_node_latency + s / across)
    assert cluster.collective_time("p2p", s, [0, 1]) == pytest.approx(cluster.intra_node_latency + s / inside)
    assert cluster.collective_time("all_reduce", s, [3]) == 0


def test_pipeline_part_is_the_simulators_makespan():
    # untied embeddings, DP = 1, no latency, memory-bound work free: the step is the makespan and
    # the gradient norm's all-reduce
    w = workload(LLAMA, seq=128, batch=16)
    for lay in (layout(pp=2, mbs=1), layout(pp=2, vp=2, mbs=1), layout(pp=4, mbs=2)):
        cluster = H100.replace(num_gpus=lay.world_size, intra_node_latency=0.0, memory_bandwidth=1e30)
        table = chunk_times(cluster, w, lay)
        p2p = cluster.collective_time("p2p", lay.micro_batch_size * 128 * 64 * 2, [0, 1])
        costs = [[Costs(c.forward, c.backward, 0, p2p) for c in row] for row in table]
        makespan = simulate(all_ranks(lay.schedule, lay.pp, lay.num_microbatches(16), lay.vp), lay.vp, costs).makespan
        prediction = predict(cluster, w, lay)
        norm = cluster.collective_time("all_reduce", 4, list(range(lay.world_size)))  # the gradient norm's
        assert prediction.step_time == pytest.approx(makespan + norm, rel=1e-9)
        # and the formula estimate differs from it (the simulator is what the step uses)
        assert predict(cluster, w, lay, use_simulator=False).step_time != pytest.approx(makespan, rel=1e-3)


def test_uniform_stages_give_the_bubble_formula():
    # F = B/2 = 1, no latency: 1F1B's step is (m + p - 1)(F + B), interleaved's (m + (p-1)/v)(F + B)
    for p, v, m in ((4, 1, 8), (4, 2, 8), (2, 4, 4)):
        name = "interleaved_1f1b" if v > 1 else "1f1b"
        makespan = simulate(all_ranks(name, p, m, v), v, Costs(1 / v, 2 / v)).makespan
        assert makespan == pytest.approx((m + (p - 1) / v) * 3)


def test_data_parallel_traffic_is_exposed_beyond_the_backward_it_overlaps():
    w = workload(GPT, seq=128, batch=16)
    slow = H100.replace(num_gpus=16, gpus_per_node=1, inter_node_bandwidth=1e6)  # every rank its own node
    plain = predict(slow, w, layout(dp=16))
    distributed = predict(slow, w, layout(dp=16, do=True))
    params = sum(p for p in __import__("megalite.planner.parameters", fromlist=["x"]).rank_parameters(GPT, 1, 1, 1, 0))
    ranks = list(range(16))
    reduce = slow.collective_time("all_reduce", params * 4, ranks)
    backward = sum(c.backward for c in chunk_times(slow, w, layout(dp=16))[0])
    assert plain.breakdown["data-parallel"] == pytest.approx(reduce - backward)
    scatter = slow.collective_time("reduce_scatter", params * 4, ranks)
    gather = slow.collective_time("all_gather", params * 2, ranks)
    forward = sum(c.forward for c in chunk_times(slow, w, layout(dp=16, do=True))[0])
    assert distributed.breakdown["data-parallel"] == pytest.approx(scatter - backward + gather - forward)
    assert distributed.breakdown["optimizer"] < plain.breakdown["optimizer"]


def test_shared_cores_stretch_the_computing_stretches_of_the_timeline():
    w = workload(GPT, seq=128, batch=16)
    own = H100.replace(num_gpus=4)
    one_core = own.replace(slowdown={2: 2.0, 4: 4.0})  # four processes on one core
    assert one_core.slowdown_at(3) == 3.0 and one_core.slowdown_at(8) == 8.0 and one_core.slowdown_at(0.5) == 1.0
    lay = layout(dp=4, mbs=2)  # all four compute all the time: four times as long
    alone, crowded = predict(own, w, lay), predict(one_core, w, lay)
    compute = sum(alone.breakdown[k] for k in ("matmul", "memory-bound", "operators"))
    assert crowded.breakdown["shared cores"] == pytest.approx(3 * compute, rel=1e-6)
    # TP=4: the four compute in lockstep between their collectives, so their compute is as
    # crowded as DP=4's whatever share of the time the collectives take
    lay = layout(tp=4, mbs=2)
    alone, crowded = predict(own, w, lay), predict(one_core, w, lay)
    compute = sum(alone.breakdown[k] for k in ("matmul", "memory-bound", "operators"))
    assert alone.breakdown["tensor-parallel"] > 0.1 * compute
    assert crowded.breakdown["shared cores"] == pytest.approx(3 * compute, rel=1e-6)
    # a pipeline of 4 one-rank stages computes alone in its bubbles: less than four times
    piped = layout(pp=4, mbs=2)
    alone, crowded = predict(own, w, piped), predict(one_core, w, piped)
    compute = sum(alone.breakdown[k] for k in ("matmul", "memory-bound", "operators"))
    assert 0 < crowded.breakdown["shared cores"] < 3 * compute


def test_operator_overhead_counts_the_models_operators():
    from megalite.planner.op_count import op_counts
    w = workload(GPT, seq=128, batch=16)
    (forward, backward), _ = op_counts(GPT)
    assert forward > 10 and backward > 10
    cluster = H100.replace(op_overhead=1e-3)
    times = layer_times(cluster, w, layout(mbs=2), 0, (forward, backward))
    assert times.parts["operators"] == pytest.approx((forward + backward) * 1e-3)


def test_output_layer_is_counted_on_the_last_stage_only():
    w = workload(GPT, seq=128, batch=16)
    table = chunk_times(H100.replace(num_gpus=2), w, layout(pp=2, mbs=2))
    head = output_times(H100, w, layout(pp=2, mbs=2))
    assert table[1][0].forward - table[0][0].forward == pytest.approx(head.forward, rel=0.05)


def test_gated_delta_net_layers_under_context_parallelism():
    """A Gated DeltaNet hybrid: context-parallel layouts only where the key heads divide TP x
    CP; a linear layer at CP2 pays its two all-to-alls (in_proj's output, out_proj's input)
    forward and backward, the full-attention layer the ring; a chunk sums both kinds."""
    from megalite.model.gdn_config import GDNConfig
    from megalite.planner.layouts import Space, enumerate_layouts
    gdn = GDNConfig(linear_attention_freq=2, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4)
    w, ops = workload(LLAMA.replace(gdn=gdn), seq=128, batch=16), (0, 0)
    space = Space(cp=[1, 2, 4, 8])
    assert {(lay.tp, lay.cp) for lay in enumerate_layouts(w, 8, space) if lay.cp > 1} == {(1, 2)}
    assert (2, 2) in {(lay.tp, lay.cp) for lay in enumerate_layouts(workload(LLAMA, 128, 16), 8, space)}
    lay = layout(cp=2, mbs=2)
    linear, full = (layer_times(H100, w, lay, layer, ops) for layer in (0, 1))
    tokens, group = 2 * 128 / 2, [0, 1]
    a2a = sum(H100.collective_time("all_to_all", tokens * channels * 2, group)
              for channels in (sum(gdn.in_proj_sections()), gdn.v_dim))
    assert linear.parts["context-parallel"] == pytest.approx(2 * a2a)
    ring = layer_times(H100, workload(LLAMA, seq=128, batch=16), lay, 1, ops).parts["context-parallel"]
    assert full.parts["context-parallel"] == pytest.approx(ring) != pytest.approx(2 * a2a)
    whole = chunk_times(H100, w, lay)[0][0].parts["context-parallel"]
    assert whole == pytest.approx(2 * linear.parts["context-parallel"] + 2 * full.parts["context-parallel"])
