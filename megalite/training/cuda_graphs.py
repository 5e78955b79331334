"""--cuda-graph-impl local: every transformer layer's forward and backward captured as CUDA graphs
(torch.cuda.make_graphed_callables) and replayed from then on, so that a layer's kernels launch
without Python, operator dispatch or Triton's launcher on the host.

The first --cuda-graph-warmup-steps training steps run eagerly (torch.compile, Triton's
autotuning and the allocator settle there); they also record what the first layer is called
with: the hidden states' shape and dtype, the rotary tables and the attention mask. At the
start of the next step the chunk's layers are captured in one call -- one memory pool, the
forward graphs in layer order and the backward graphs in reverse, the order a step runs them
-- from static inputs of those shapes. From then on the model's training forward calls the
graphed layers (GPTModel.graphed_layers); evaluation and no-grad forwards keep the eager
layers, and so does a call whose inputs differ from the captured ones in shape or dtype.

A graphed backward hands each parameter's gradient back in the graph's static buffer, which
the next replay overwrites: megalite's DDP wrapper, which every run without FSDP2 has, adds it
to main_grad and drops .grad at once (its post-accumulate-grad hook), so nothing holds it
across replays.

What the validation (config/megatron/training.py) refuses is what a capture cannot
hold: RNG state swaps (the tensor-parallel dropout stream, recompute), several micro-batches
in flight (pipeline parallelism), data-dependent shapes (MoE), hooks around layers (FSDP2,
overlapped parameter gathers).
"""

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


class _LayerCall(nn.Module):
    """A transformer layer as make_graphed_callables takes it: a module holding the layer's
    parameters, called with tensors only (hidden states, then cos and sin, then the mask)."""

    def __init__(self, layer: nn.Module, has_rotary: bool, has_mask: bool):
        super().__init__()
        self.layer, self.has_rotary, self.has_mask = layer, has_rotary, has_mask

    def forward(self, x, *extras):
        rotary = tuple(extras[:2]) if self.has_rotary else None
        return self.layer(x, rotary, extras[-1] if self.has_mask else None)


def _tensors(x, rotary, attention_mask) -> tuple:
    return (x, *(rotary or ()), *(() if attention_mask is None else (attention_mask,)))


def _signature(tensors) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


class _GraphedLayer:
    """The graphed call of one layer, or the eager layer for inputs it was not captured for."""

    def __init__(self, graphed, layer, signature):
        self.graphed, self.layer, self.signature = graphed, layer, signature

    def __call__(self, x, rotary, attention_mask):
        tensors = _tensors(x, rotary, attention_mask)
        if _signature(tensors) != self.signature:
            return self.layer(x, rotary, attention_mask)
        return self.graphed(*tensors)


class LayerGraphs:
    """The CUDA graphs of one model chunk's transformer layers (see the module docstring).

    `make_graphed_callables` defaults to torch.cuda.make_graphed_callables (tests pass a stand-in)."""

    def __init__(self, model, warmup_steps: int, make_graphed_callables=None):
        if warmup_steps < 1:
            raise ValueError(f"--cuda-graph-warmup-steps {warmup_steps}: at least 1 eager step is needed")
        self.model, self.warmup_steps = model, warmup_steps
        self.make_graphed_callables = make_graphed_callables
        self.steps_started = 0
        self.captured = False
        self.recorded = None  # (hidden states' shape, dtype, device; rotary; attention mask) of a training call
        number, layer = next(iter(model.layers.items()))

        def record(x, rotary, attention_mask):
            self.recorded = (x.shape, x.dtype, x.device, rotary, attention_mask)
            return layer(x, rotary, attention_mask)
        model.graphed_layers = {number: record}

    def before_step(self) -> None:
        """Called at the start of every training step: captures once the warm-up steps are done."""
        if not self.captured and self.steps_started == self.warmup_steps:
            self.capture()
        self.steps_started += 1

    def capture(self) -> None:
        if self.recorded is None:
            raise RuntimeError("CUDA graph capture: no eager training step has run the layers to take shapes from")
        shape, dtype, device, rotary, mask = self.recorded
        layers = list(self.model.layers.items())
        calls, samples = [], []
        for _, layer in layers:
            calls.append(_LayerCall(layer, rotary is not None, mask is not None))
            x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
            samples.append(tuple(t.detach().clone() if t is not x else t for t in _tensors(x, rotary, mask)))
        make = self.make_graphed_callables or torch.cuda.make_graphed_callables
        graphed = make(tuple(calls), tuple(samples))
        signature = _signature(samples[0])
        self.model.graphed_layers = {number: _GraphedLayer(g, layer, signature)
                                     for (number, layer), g in zip(layers, graphed)}
        self.captured, self.recorded = True, None
        log.info("captured CUDA graphs of %d transformer layers after %d eager steps", len(layers),
                 self.warmup_steps)


def layer_graphs_for(models, impl: str, warmup_steps: int, make_graphed_callables=None) -> list[LayerGraphs]:
    """The LayerGraphs of each model chunk under --cuda-graph-impl local; none otherwise."""
    if impl != "local":
        return []
    return [LayerGraphs(m, warmup_steps, make_graphed_callables) for m in models if len(m.layers)]
