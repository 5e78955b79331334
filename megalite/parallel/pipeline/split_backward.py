"""A backward pass split into an input-gradient half (B) and a deferred weight-gradient half
(W), as zero-bubble schedules (ZB-H1) need, built on autograd alone.

During the forward of a micro-batch, `SplitBackward.record` notes the output of every module
that owns parameters (linear layers, norms, embeddings). B then asks autograd for the
gradient of the chunk's input *and* of each recorded output, with the graph retained: autograd
computes only what those need, i.e. the input-gradient chain, never a weight gradient (a
matmul's weight gradient is skipped when the weight is not asked for). W later runs, per
module, torch.autograd.backward from its output with the saved output gradient, restricted to
that module's parameters: exactly the weight-gradient matmuls, accumulated into .grad
through the ordinary AccumulateGrad path (so gradient hooks, e.g. data-parallel bucketing,
fire as in a plain backward). Together B and W do the work of one full backward.

Parameters whose gradient does not come through their module's output are handled too: a
parameter a module returns (a bias whose addition is deferred, skip_bias_add) gets its
gradient in B and is accumulated in W by a backward from the parameter itself. A parameter
passed to a module's forward that the module does not own (an output layer tied to the input
embedding) reaches that module as an alias (a view of it): the parameter is also used
upstream, where a backward from this module's output would take that share a second time, so
W takes the alias's gradient alone and hands it to the parameter through the view (that share
is never accumulated inside the GEMM: the alias has no main_grad). A module's own parameter
passed in (the untied output layer's weight) is not aliased: its W is any other weight's. Assumed, and true of megalite's GPT: a parameter
is otherwise used only inside the forward of the module that owns it, and each module runs
once per micro-batch.

Memory trade-off: between B and W a micro-batch keeps its whole retained autograd graph
(everything the forward saved, including what only the input gradient needed), plus the
gradient of every recorded output (about 11*s*b*h values per GPT-2 layer, and s*b*V/t for
the output layer of the last stage). Megatron's zero-bubble implementation stores only the
inputs and output gradients of the linear layers; ours trades that memory for needing no
change to the layers. ZB-H1 holds a micro-batch from F to W for at most p micro-batches, the
same count as 1F1B's first stage, so the extra is per held micro-batch, not more of them.
With sequence parallelism a row-parallel layer's output comes out of a reduce-scatter, so
its W runs that reduce-scatter's backward (an all-gather over TP) a second time; every TP rank
runs the same W's in the same order, so the collectives match.
Activation recompute of whole layers is not split (W would recompute the layers once per
module); the executor then runs the full backward in B and makes W a no-op.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def _tensors(value) -> list:
    """Tensors in a (nested) tuple/list/dict of module inputs or outputs."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _unique(tensors) -> list:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _alias_parameters(value, aliases: list, own: set):
    """`value` (module inputs) with every parameter that requires a gradient, other than the
    module's own (ids in `own`), replaced by a view of it; the (alias, parameter) pairs are
    appended to `aliases`."""
    if isinstance(value, nn.Parameter) and value.requires_grad and id(value) not in own:
        alias = value.view_as(value)
        aliases.append((alias, value))
        return alias
    if type(value) in (tuple, list):
        return type(value)(_alias_parameters(v, aliases, own) for v in value)
    if type(value) is dict:
        return {k: _alias_parameters(v, aliases, own) for k, v in value.items()}
    return value


@dataclass
class _Entry:
    params: list            # parameters whose gradient flows through `outputs`
    outputs: list           # the module's output tensors
    aliases: list = field(default_factory=list)  # (alias, parameter) of parameters passed in
    grads: list = field(default_factory=list)


@dataclass
class MicrobatchRecord:
    """What one micro-batch's forward recorded, and what B saved for W."""

    entries: list = field(default_factory=list)
    leaves: list = field(default_factory=list)       # parameters a module returned as outputs
    leaf_grads: list = field(default_factory=list)


class SplitBackward:
    """Records module outputs of one model chunk and runs its backward as B then W."""

    def __init__(self, model: nn.Module):
        # Every module: one holding no parameter may be passed one (a tied output layer).
        self.modules = list(model.modules())

    @contextmanager
    def record(self):
        """Run a forward inside this context to get its MicrobatchRecord."""
        record = MicrobatchRecord()
        passed = {}  # module -> (alias, parameter) pairs of its running call

        def pre_hook(module, args, kwargs):
            aliases, own = [], {id(p) for p in module.parameters(recurse=False)}
            args, kwargs = _alias_parameters(args, aliases, own), _alias_parameters(kwargs, aliases, own)
            passed[module] = aliases
            return (args, kwargs) if aliases else None

        def hook(module, args, kwargs, output):
            aliases = passed.pop(module)
            outputs = _tensors(output)
            skipped = {id(t) for t in outputs if isinstance(t, nn.Parameter)}  # returned
            skipped |= {id(p) for _, p in aliases}  # passed in (a tied one)
            params = [p for p in module.parameters(recurse=False)
                      if p.requires_grad and id(p) not in skipped]
            record.leaves += [t for t in outputs if isinstance(t, nn.Parameter) and t.requires_grad]
            outputs = [t for t in outputs if not isinstance(t, nn.Parameter) and t.requires_grad]
            if (params or aliases) and outputs:
                record.entries.append(_Entry(params, outputs, aliases))

        handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in self.modules]
        handles += [m.register_forward_hook(hook, with_kwargs=True) for m in self.modules]
        try:
            yield record
        finally:
            for handle in handles:
                handle.remove()
        record.leaves = _unique(record.leaves)

    @staticmethod
    def input_backward(record: MicrobatchRecord, output: torch.Tensor, output_grad,
                       input_tensor: torch.Tensor | None) -> torch.Tensor | None:
        """B: the gradient of `input_tensor` (None on the first stage, which has no input),
        saving in `record` the output gradients W needs. Computes no weight gradient."""
        outputs = [t for entry in record.entries for t in entry.outputs]
        targets = ([input_tensor] if input_tensor is not None else []) + record.leaves + outputs
        if not targets:
            return None
        grads = list(torch.autograd.grad(output, targets, grad_outputs=output_grad,
                                         retain_graph=True, allow_unused=True))
        input_grad = grads.pop(0) if input_tensor is not None else None
        record.leaf_grads = grads[:len(record.leaves)]
        grads = grads[len(record.leaves):]
        for entry in record.entries:
            entry.grads, grads = grads[:len(entry.outputs)], grads[len(entry.outputs):]
        return input_grad

    @staticmethod
    def weight_backward(record: MicrobatchRecord) -> None:
        """W: accumulate every parameter's gradient from what B saved, then free the graph."""
        for entry in record.entries:
            pairs = [(t, g) for t, g in zip(entry.outputs, entry.grads) if g is not None]
            if not pairs:
                continue
            outputs, grads = [t for t, _ in pairs], [g for _, g in pairs]
            if entry.params:
                torch.autograd.backward(outputs, grads, inputs=entry.params, retain_graph=True)
            if entry.aliases:
                aliases = [alias for alias, _ in entry.aliases]
                alias_grads = torch.autograd.grad(outputs, aliases, grads, retain_graph=True,
                                                  allow_unused=True)
                used = [(a, g) for a, g in zip(aliases, alias_grads) if g is not None]
                if used:  # through the view into the parameter's .grad (and its hooks)
                    torch.autograd.backward([a for a, _ in used], [g for _, g in used],
                                            retain_graph=True)
        leaves = [(p, g) for p, g in zip(record.leaves, record.leaf_grads) if g is not None]
        if leaves:
            torch.autograd.backward([p for p, _ in leaves], [g for _, g in leaves])
        record.entries.clear()
        record.leaves.clear()
        record.leaf_grads.clear()
