"""--torch-compile (GPTModel.compile_regions, as megalite/training/setup_run.py and the benchmark
call it: the embedding, each transformer layer, and the head -- final norm, output layer, loss --
each compiled) combined with megalite's Triton kernels and with activation recompute gives the
loss and gradients of the uncompiled model with kernels off. fp32; within 1e-5 relative (max
|error| over max |reference|, tests/numerics.py), the tolerance of the kernels-on vs kernels-off
test: the compiled graph runs the same kernels, so what differs is the kernels' rounding against
the references'. On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1).

Backend: aot_eager in the default run. It runs every stage of torch.compile that can break here
-- Dynamo's capture (the kernels' torch.library operators and their registered autograd,
torch.utils.checkpoint as a higher-order op, graph breaks), AOTAutograd's
functionalisation, fake-tensor propagation through the ops' register_fake, the joint forward and
backward trace and its partition, which is where checkpointed regions get recomputed -- and then
executes the resulting aten graphs eagerly. Only Inductor's lowering and code generation is left
out: it changes how the same graph executes, not what it computes, and it costs 5-12 s of C++
compilation per case on a CPU; the slow tests cover it with the default backend.

Beyond the numbers, each case checks that compilation really happened (no silent eager
fallback): every region compiles whole (fullgraph=True), three graphs each way (embedding, one
layer graph serving both layers, head), the kernels inside them -- the Triton cross-entropy in
the head's --, selective recompute recomputes attention inside the compiled backward, and full
recompute reruns the compiled layer forward. Without the kernels the head's loss is the traced
reference (parallel/tensor/cross_entropy.py): a small graph that saves no fp32 copy of the
logits for backward when split as inductor splits it. With dropout on (training mode, the RNG
tracker passed as training passes it) the compiled run with recompute equals the eager run
with the same kernels without recompute: the masks (F.dropout's in attention, the
bias-dropout-add kernel's after it) are replayed.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from megalite.kernels import cross_entropy_torch  # noqa: E402
from megalite.model.gpt import GPTModel, masked_mean_loss  # noqa: E402
from megalite.parallel.random import seed_everything  # noqa: E402
from tests.model.compile_recording import RecordingBackend  # noqa: E402
from tests.model.test_gpt_tp import make_config  # noqa: E402
from tests.numerics import assert_rel_close, rel_error  # noqa: E402

pytest.importorskip("triton")
TOL = 1e-5
SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16)
CE_OPS = {"ce_local_stats", "cross_entropy_loss", "ce_grad_logits"}
KERNEL_OPS = {"gpt2": {"norm_forward", "norm_backward", "bias_gelu_forward", "bias_gelu_backward"} | CE_OPS,
              "llama": {"norm_forward", "norm_backward", "swiglu_forward", "swiglu_backward", "rotary"} | CE_OPS}


def config(family, **overrides):
    extra = dict(num_query_groups=2, ffn_hidden_size=48) if family == "llama" else {}
    return make_config(family, **{**SMALL, **extra, **overrides})


def run(cfg, backend=None, train=False, fullgraph=False):
    """Loss and gradients of one forward/backward; the regions compiled with `backend` when given.
    The RNG tracker is passed as training passes it."""
    torch._dynamo.reset()  # fresh compile per case (and no recompile limit across cases)
    counters.clear()
    torch.manual_seed(5)
    model = GPTModel(cfg, rng_tracker=seed_everything(11), init_seed=3)
    model.train(train)
    if backend is not None:
        model.compile_regions(backend=backend, fullgraph=fullgraph)
    g = torch.Generator().manual_seed(1)
    tokens, labels = (torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(2))
    loss = masked_mean_loss(model(tokens, labels=labels), None)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def compare(result, reference, what):
    assert_rel_close(result[0], reference[0], TOL, f"{what}: loss")
    assert set(result[1]) == set(reference[1]), what
    for name, grad in reference[1].items():
        assert_rel_close(result[1][name], grad, TOL, f"{what}: grad {name}")


def _attention_forward_ops(code: str) -> set[str]:
    return {op for op in re.findall(r"aten\.(_scaled_dot_product_\w+?)\.default", code) if not op.endswith("_backward")}


@pytest.fixture(scope="module")
def reference():
    """reference(family): uncompiled, kernels off, no recompute (computed once per family)."""
    done = {}

    def get(family):
        if family not in done:
            done[family] = run(config(family, fused_kernels=False))
        return done[family]
    return get


@pytest.mark.parametrize("recompute", [None, "selective", "full"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_regions_with_kernels_and_recompute_equal_eager(family, recompute, reference):
    recorder = RecordingBackend()
    compiled = run(config(family, fused_kernels=True, recompute_granularity=recompute), recorder.backend,
                   fullgraph=True)
    compare(compiled, reference(family), f"{family} recompute={recompute}")

    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(recorder.graphs["forward"]) == 3 and len(recorder.graphs["backward"]) == 3, \
        "three compiled graphs each way: the embedding, one layer graph serving both layers, the head"
    forward_code, backward_code = recorder.code("forward"), recorder.code("backward")
    ops = set(re.findall(r"megalite_kernels\.(\w+)\.default", forward_code + backward_code))
    assert KERNEL_OPS[family] <= ops, f"kernels missing from the compiled graphs: {KERNEL_OPS[family] - ops}"
    recomputed = _attention_forward_ops(backward_code)
    assert bool(recomputed) == (recompute == "selective"), f"attention forward in the backward graph: {recomputed}"
    layer_calls = SMALL["num_layers"] * (2 if recompute == "full" else 1)
    assert recorder.forward_calls == 2 + layer_calls  # the embedding and head once, each layer (again)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_regions_without_kernels_equal_eager(family, reference):
    recorder = RecordingBackend()
    compiled = run(config(family, fused_kernels=False), recorder.backend, fullgraph=True)
    compare(compiled, reference(family), f"{family} kernels off")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(recorder.graphs["forward"]) == 3 and len(recorder.graphs["backward"]) == 3
    assert "megalite_kernels" not in recorder.code("forward") + recorder.code("backward")


def test_reference_loss_under_compile_keeps_no_fp32_logits(monkeypatch):
    """bf16, split as inductor splits forward and backward: the head saves the 16-bit logits and
    per-row statistics, no fp32 [tokens, vocabulary] tensor, and its graph is small although the
    eager torch loss here works in 16 row chunks (2 rows each), which Dynamo would unroll."""
    for fn in (cross_entropy_torch.torch_local_stats, cross_entropy_torch.torch_grad_logits):
        monkeypatch.setattr(fn, "__defaults__", (2 * 1000,))
    recorder = RecordingBackend(inductor_partition=True)
    cfg = config("gpt2", fused_kernels=False, params_dtype="bfloat16", vocab_size=1000)
    run(cfg, recorder.backend, fullgraph=True)
    head = recorder.graphs["forward"][-1]
    assert len(head.graph.nodes) < 150, f"{len(head.graph.nodes)} nodes in the head's forward graph"
    kept = [(tuple(v.shape), v.dtype) for v in recorder.forward_returns(head)]
    wide = [(math.prod(shape), dtype) for shape, dtype in kept if shape[-1] >= cfg.vocab_size]
    assert wide == [(2 * 16 * cfg.padded_vocab_size(1), torch.bfloat16)], kept


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_dropout_is_replayed_by_recompute_under_compile(recompute, reference):
    cfg = dict(attention_dropout=0.2, hidden_dropout=0.2)
    # with the kernels on both sides: the bias-dropout-add kernel draws its own mask (not F.dropout's)
    eager = run(config("gpt2", fused_kernels=True, **cfg), train=True)
    compiled = run(config("gpt2", fused_kernels=True, recompute_granularity=recompute, **cfg), "aot_eager", train=True)
    compare(compiled, eager, f"dropout, recompute={recompute}")
    # Guard against a vacuous pass: dropout really changed the gradients.
    name = "layers.0.mlp.linear_fc1.weight"
    assert rel_error(eager[1][name], reference("gpt2")[1][name]) > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_inductor_compiled_regions_with_kernels_and_recompute(family, recompute, reference):
    compiled = run(config(family, fused_kernels=True, recompute_granularity=recompute), "inductor")
    compare(compiled, reference(family), f"{family} inductor recompute={recompute}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_inductor_compiled_regions_without_kernels(family, reference):
    compiled = run(config(family, fused_kernels=False), "inductor", fullgraph=True)
    compare(compiled, reference(family), f"{family} inductor kernels off")
