"""--cuda-graph-impl local (megalite/training/cuda_graphs.py) without a GPU: everything but the
capture itself. torch.cuda.make_graphed_callables is replaced by a stand-in that checks what it
is given as the real one would use it (one module per layer holding exactly that layer's
parameters, static sample inputs of the recorded shapes, only the hidden states requiring
grad, forward and backward run once on them by autograd.grad as its warm-up does, nothing
accumulated into .grad) and returns callables that count their calls and run the layer eagerly.
So the tests see: the warm-up steps run eagerly and capture nothing; the capture happens once,
at the start of the first step after them, with every layer in order; from then on every
training forward goes through the graphed calls (evaluation, no-grad forwards and inputs of
another shape do not); and the losses of a training run are those of the same run without
graphs. What only a GPU shows -- that the capture succeeds and the replay computes the same
numbers -- is the GPU check's (see the report of the change that added this file)."""

import pytest
import torch

from megalite.config.megatron import training as megatron_training
from megalite.config.arguments import parse_args
from megalite.model.gpt import GPTModel, masked_mean_loss
from megalite.parallel.state import ParallelState
from megalite.training import setup_run
from megalite.training.cuda_graphs import LayerGraphs, layer_graphs_for
from megalite.training.loop import Trainer
from tests.model.test_gpt_tp import make_config
from tests.training.launch import BASE


class StandIn:
    """torch.cuda.make_graphed_callables' stand-in (see the module docstring)."""

    def __init__(self):
        self.captures = []  # (modules, sample args) per call
        self.calls = 0

    def __call__(self, callables, sample_args):
        assert isinstance(callables, tuple) and isinstance(sample_args, tuple) and len(callables) == len(sample_args)
        self.captures.append((callables, sample_args))
        for module, args in zip(callables, sample_args):
            assert all(isinstance(a, torch.Tensor) for a in args)
            assert [a.requires_grad for a in args] == [True] + [False] * (len(args) - 1)
            params = list(module.parameters())
            assert params and all(p.requires_grad for p in params)
            before = [None if p.grad is None else p.grad.clone() for p in params]
            out = module(*args)  # the warm-up make_graphed_callables runs before capturing
            grads = torch.autograd.grad(out.sum(), (args[0], *params), allow_unused=False)
            assert grads[0].shape == args[0].shape
            assert all((b is None and p.grad is None) or torch.equal(b, p.grad) for b, p in zip(before, params))

        def graphed(module):
            def call(*args):
                self.calls += 1
                return module(*args)
            return call
        return tuple(graphed(m) for m in callables)


def batch(cfg, b=2, s=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (b, s), generator=g) for _ in range(2)]


def step(model, tokens, labels, mask=None):
    loss = masked_mean_loss(model(tokens, labels=labels, attention_mask=mask), None)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("family, with_mask", [("gpt2", False), ("llama", False), ("llama", True)])
def test_warm_up_steps_run_eagerly_then_every_layer_is_captured_once(family, with_mask):
    cfg = make_config(family, num_layers=3)
    stand_in = StandIn()
    model = GPTModel(cfg, init_seed=3)
    eager = GPTModel(cfg, init_seed=3)
    graphs = LayerGraphs(model, warmup_steps=2, make_graphed_callables=stand_in)
    tokens, labels = batch(cfg)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool).triu(1) if with_mask else None
    for i in range(4):
        graphs.before_step()
        assert len(stand_in.captures) == (i >= 2), f"step {i}"
        for _ in range(2):  # two micro-batches per step
            loss, reference = step(model, tokens, labels, mask), step(eager, tokens, labels, mask)
            assert torch.equal(loss, reference)
        assert stand_in.calls == (4 * cfg.num_layers if i == 3 else 2 * cfg.num_layers if i == 2 else 0)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    modules, samples = stand_in.captures[0]
    assert [m.layer for m in modules] == list(model.layers.values())
    rotary = 2 if cfg.position_embedding_type == "rope" else 0
    for args in samples:
        assert tuple(args[0].shape) == (16, 2, cfg.hidden_size) and len(args) == 1 + rotary + with_mask
    assert len({a.data_ptr() for args in samples for a in args}) == sum(map(len, samples)), "shared sample tensors"


def test_evaluation_no_grad_and_other_shapes_stay_eager():
    cfg = make_config("gpt2")
    stand_in = StandIn()
    model = GPTModel(cfg, init_seed=3)
    graphs = LayerGraphs(model, warmup_steps=1, make_graphed_callables=stand_in)
    tokens, labels = batch(cfg)
    graphs.before_step()
    step(model, tokens, labels)
    graphs.before_step()
    with torch.no_grad():
        model(tokens, labels=labels)
    model.eval()
    step(model, tokens, labels)
    model.train()
    step(model, *batch(cfg, b=1))
    assert len(stand_in.captures) == 1 and stand_in.calls == 0
    step(model, tokens, labels)
    assert stand_in.calls == cfg.num_layers


def test_only_local_builds_graphs_and_warm_up_is_needed():
    models = [GPTModel(make_config("gpt2"), init_seed=3)]
    assert layer_graphs_for(models, "none", 3) == []
    assert [g.model for g in layer_graphs_for(models, "local", 3)] == models
    with pytest.raises(ValueError, match="--cuda-graph-warmup-steps 0"):
        LayerGraphs(models[0], 0)


def _train(monkeypatch, extra: list[str], iters: int = 4) -> tuple[list[float], object]:
    """A training run in this process on the CPU (one rank), its per-iteration losses. Dropout
    off: a capture's warm-up draws random numbers, which would shift later dropout masks."""
    monkeypatch.setattr(setup_run, "init_distributed", lambda parallel: (ParallelState.single(), torch.device("cpu")))
    args = parse_args(BASE + ["--train-iters", str(iters), "--eval-iters", "0", "--attention-dropout", "0",
                              "--hidden-dropout", "0"] + extra)
    run = setup_run.build_run(args)
    trainer = Trainer(run)
    iterator = setup_run.data_iterator(run, trainer.train_ds, 0)
    losses = [trainer.train_step(iterator)[0] for _ in range(iters)]
    trainer.close()
    return losses, run


def test_training_with_graphs_captures_after_the_warm_up_steps_and_matches(monkeypatch):
    """The driver's path: the flags, the typed config, build_run and the loop's before_step."""
    reference, _ = _train(monkeypatch, [])
    stand_in = StandIn()
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", stand_in)
    monkeypatch.setattr(megatron_training, "on_cpu", lambda args: False)
    losses, run = _train(monkeypatch, ["--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "2"])
    assert len(run.cuda_graphs) == 1 and len(stand_in.captures) == 1
    assert len(stand_in.captures[0][0]) == 4  # every layer of the chunk, in one capture
    # 4 micro-batches per step (global batch 8, micro-batch 2), 4 layers, 2 steps after the warm-up
    assert stand_in.calls == 2 * 4 * 4
    assert losses == reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the capture itself needs a GPU")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_capture_and_replay_on_a_gpu(family, compiled, monkeypatch):
    """The real torch.cuda.make_graphed_callables: after one eager step the layers are captured
    and replayed (CUDAGraph.replay counted), and losses and gradients stay those of the eager
    model (fp32; the same kernels run, so 1e-5 relative; inductor's fusions with --torch-compile
    on reorder some sums, so 1e-4 there)."""
    from megalite.training.cuda_graphs import _GraphedLayer
    from tests.numerics import assert_rel_close

    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: (replays.append(graph), replay(graph))[1])
    cfg = make_config(family, num_layers=3)
    device = torch.device("cuda")
    model, eager = (GPTModel(cfg, init_seed=3, device=device) for _ in range(2))
    if compiled:
        model.compile_regions()
    graphs = LayerGraphs(model, warmup_steps=1)
    tokens, labels = (t.to(device) for t in batch(cfg))
    tol = 1e-4 if compiled else 1e-5
    for i in range(3):
        graphs.before_step()
        for _ in range(2):
            # Gradients compared per micro-batch: a graphed backward hands back its static buffers,
            # which .grad would alias across replays; the driver's DDP moves each into main_grad
            # at once (its post-accumulate hook), which these bare models have not.
            model.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
            assert_rel_close(step(model, tokens, labels), step(eager, tokens, labels), tol, f"step {i} loss")
            for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
                assert_rel_close(p.grad, q.grad, tol, f"step {i} grad {name}")
    assert graphs.captured and all(isinstance(g, _GraphedLayer) for g in model.graphed_layers.values())
    assert len(replays) == 2 * 2 * 2 * cfg.num_layers  # forward and backward, 2 steps of 2 micro-batches
