"""--fine-grained-activation-offloading (megalite/model/offload.py): with each --offload-modules
name the losses and gradients are bit for bit those without offloading, what the module saves
for backward is copied out (counted through the hooks) and its device storage is freed before
backward, and nothing under --min-offloaded-tensor-size moves."""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import megalite.model.moe as moe_module
from megalite.model.attention import SelfAttention
from megalite.model.offload import OFFLOAD_MODULES
from tests.model.test_recompute_modules import BATCH, SEQ, config, loss_and_grads, mla_model_config

ROWS = BATCH * SEQ * 2  # tokens routed to experts (top-2)


def offloading(cfg, modules, min_size=0):
    return cfg.replace(offload_modules=modules, min_offloaded_tensor_size=min_size)


def run(cfg, watch=None):
    """loss_and_grads, with the model's offloader's counts."""
    offloaders = []

    def watching(model, seen):
        offloaders.append(model.offloader)
        return watch(model, seen) if watch else []
    loss, grads, freed = loss_and_grads(cfg, watching)
    return loss, grads, freed, offloaders[0]


def assert_identical(got, want):
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(config(None))


@pytest.mark.parametrize("modules", [(name,) for name in OFFLOAD_MODULES if name != "attn_proj"]
                         + [("core_attn", "attn_proj"), OFFLOAD_MODULES])
def test_bit_identical_and_only_the_named_modules_offload(reference, modules):
    loss, grads, _, offloader = run(offloading(config(None), modules))
    assert_identical((loss, grads), reference)
    assert set(offloader.offloaded_bytes) == set(modules)
    assert all(n > 0 for n in offloader.offloaded_bytes.values())


def test_each_group_prefetches_the_one_before_it():
    """12 groups a forward (5 in the dense layer, 7 in the MoE layer): the last is reloaded when
    backward first needs it, each other one by the hook on the input gradient of the group after it."""
    _, _, _, offloader = run(offloading(config(None), OFFLOAD_MODULES))
    assert offloader.reloads == {"prefetched": 11, "on_demand": 1}


def test_with_megatrons_functional_config_recompute():
    """The offloading functional configs' --recompute-modules (layernorm, mla_up_proj, mlp, moe_act)
    on an MLA MoE model with multi-token prediction, every module offloaded: still bit for bit."""
    recompute = ("layernorm", "mla_up_proj", "mlp", "moe_act")
    want = loss_and_grads(mla_model_config(recompute))
    loss, grads, _, offloader = run(offloading(mla_model_config(recompute), OFFLOAD_MODULES))
    assert_identical((loss, grads), want)
    # layernorm recompute discards the norms' outputs that qkv_linear's down projections save:
    # recompute wins, but the latents the up projections are rebuilt from are offloaded
    assert set(offloader.offloaded_bytes) == set(OFFLOAD_MODULES)


def test_moe_act_bytes_through_the_hooks():
    """The experts' SwiGLU (torch's: silu(gate) * up) saves the gate and up halves of its input
    (strided views of the first grouped matmul's output [rows, 2 ffn], fp32: that storage is
    copied once) and silu(gate) [rows, ffn]: exactly those bytes leave, in one MoE layer."""
    _, _, _, offloader = run(offloading(config(None), ("moe_act",)))
    assert offloader.offloaded_bytes == {"moe_act": (2 + 1) * ROWS * 24 * 4}
    assert offloader.offloaded_tensors == {"moe_act": 2}
    _, _, _, offloader = run(offloading(config(None), ("moe_act",), min_size=ROWS * 2 * 24 + 1))
    assert offloader.offloaded_bytes == {}


def module_inputs(*names):
    """A watch: the storages of the first inputs of the submodules with these attribute names."""
    def watch(model, seen):
        def hook(module, inputs):
            seen.append(StorageWeakRef(inputs[0].untyped_storage()))
        return [m.register_forward_pre_hook(hook) for n, m in model.named_modules() if n.split(".")[-1] in names]
    return watch


def grouped_mm_operand(monkeypatch, which):
    """A watch on the first grouped matmul's input rows (which=0) or output (which=1)."""
    real = moe_module.grouped_mm

    def watch(model, seen):
        calls = [0]

        def recording(rows, weights, counts, grouped):
            calls[0] += 1
            out = real(rows, weights, counts, grouped)
            if calls[0] % 2 == 1:
                seen.append(StorageWeakRef((rows, out)[which].untyped_storage()))
            return out
        monkeypatch.setattr(moe_module, "grouped_mm", recording)
        return []
    return watch


def core_attention_query(monkeypatch):
    real = SelfAttention.core_attention

    def watch(model, seen):
        def recording(self, q, *rest):
            seen.append(StorageWeakRef(q.untyped_storage()))
            return real(self, q, *rest)
        monkeypatch.setattr(SelfAttention, "core_attention", recording)
        return []
    return watch


WATCHES = {
    "attn_norm": lambda mp: module_inputs("input_layernorm"),
    "mlp_norm": lambda mp: module_inputs("pre_mlp_layernorm"),
    "qkv_linear": lambda mp: module_inputs("linear_qkv"),
    "core_attn": core_attention_query,
    "attn_proj": lambda mp: module_inputs("linear_proj"),
    "expert_fc1": lambda mp: grouped_mm_operand(mp, 0),
    "moe_act": lambda mp: grouped_mm_operand(mp, 1),
}


@pytest.mark.parametrize("name", OFFLOAD_MODULES)
def test_saved_tensors_leave_the_device_before_backward(monkeypatch, name):
    """The tensor the module alone saves is freed after the forward when offloaded, kept without
    (on CPU an offload is a copy; the original storage dies), and kept under the size floor."""
    watch = WATCHES[name](monkeypatch)
    modules = ("core_attn", "attn_proj") if name == "attn_proj" else (name,)
    *_, kept, _ = run(config(None), watch)
    *_, freed, _ = run(offloading(config(None), modules), watch)
    *_, floored, _ = run(offloading(config(None), modules, min_size=10 ** 9), watch)
    assert kept and not any(kept) and not any(floored)
    assert all(freed), freed


def test_zero_bubble_split_backward():
    """ZB-H1's split backward (B, then the weight-gradient half W from the retained graph, which
    unpacks the saved tensors a second time) on a middle pipeline stage: bit for bit the split
    backward without offloading."""
    from megalite.model.gpt import GPTModel
    from megalite.parallel.data.ddp import DistributedDataParallel, main_grad_of
    from megalite.parallel.pipeline.split_backward import SplitBackward
    from megalite.parallel.state import ParallelState

    def split_backward(cfg):
        model = GPTModel(cfg, ParallelState.single(), layer_numbers=[0, 1], pre_process=False, post_process=False,
                         init_seed=3).train()
        wrapped, split = DistributedDataParallel(model, ParallelState.single()), SplitBackward(model)
        g = torch.Generator().manual_seed(5)
        hidden = torch.randn(SEQ, BATCH, 16, generator=g).requires_grad_()
        with split.record() as record:
            out = wrapped(hidden_states=hidden)
        input_grad = split.input_backward(record, out, torch.randn(out.shape, generator=g), hidden)
        split.weight_backward(record)
        return input_grad, {n: main_grad_of(p).clone() for n, p in model.named_parameters()}, model.offloader

    want_input, want, _ = split_backward(config(None))
    got_input, got, offloader = split_backward(offloading(config(None), OFFLOAD_MODULES))
    assert torch.equal(got_input, want_input)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
    assert set(offloader.offloaded_bytes) == set(OFFLOAD_MODULES)
