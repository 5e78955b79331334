"""--recompute-granularity selective --recompute-modules: each module megalite recomputes gives
the same loss and gradients as keeping its activations, and the activation it stands for is
really not kept after the forward (its storage is freed before backward)."""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import megalite.model.moe as moe_module
from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.model.moe_config import MoEConfig
from megalite.parallel.state import ParallelState

SEQ, BATCH = 8, 2


def config(modules, **moe):
    return GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=64, ffn_hidden_size=32,
                     activation="swiglu", add_bias_linear=False, normalization="RMSNorm",
                     position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
                     recompute_granularity="selective" if modules is not None else None,
                     recompute_modules=modules or (),
                     moe=MoEConfig(num_experts=4, ffn_hidden_size=24, router_topk=2, layer_freq=[0, 1],
                                   shared_expert_intermediate_size=20, aux_loss_coeff=0.01, **moe))


def loss_and_grads(cfg, watch=None):
    """(loss, {name: grad}, storages the watch hook saw, whether each was freed before backward)."""
    model = GPTModel(cfg, ParallelState.single(), init_seed=7).train()
    tokens = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    seen = []
    handles = watch(model, seen) if watch else []
    loss = model(tokens, labels=tokens.roll(-1, 1)).mean()
    for handle in handles:
        handle.remove()
    freed = [ref.expired() for ref in seen]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, freed


def module_outputs(*names):
    """A watch: the storages of the outputs of the submodules with these attribute names."""
    def watch(model, seen):
        def hook(module, inputs, output):
            seen.append(StorageWeakRef(output.untyped_storage()))
        return [m.register_forward_hook(hook) for n, m in model.named_modules() if n.split(".")[-1] in names]
    return watch




@pytest.mark.parametrize("modules", [("mlp",), ("moe",), ("shared_experts",), ("layernorm",), ("moe_act",),
                                     ("core_attn", "layernorm", "mlp", "moe_act", "shared_experts"),
                                     ("moe", "shared_experts", "layernorm")])
def test_same_loss_and_gradients(modules):
    want_loss, want, _ = loss_and_grads(config(None))
    got_loss, got, _ = loss_and_grads(config(modules))
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


def freed_fraction(modules, watch):
    _, _, freed = loss_and_grads(config(modules), watch)
    assert freed
    return sum(freed) / len(freed)


def test_layernorm_outputs_are_not_kept():
    watch = module_outputs("input_layernorm", "pre_mlp_layernorm")
    assert freed_fraction(None, watch) == 0  # without recompute, the attention and MLP keep them
    assert freed_fraction(("layernorm",), watch) == 1


def test_dense_mlp_and_shared_expert_activations_are_not_kept():
    watch = module_outputs("linear_fc1")  # layer 0's dense MLP and layer 1's shared expert
    assert freed_fraction(None, watch) == 0
    assert freed_fraction(("mlp",), watch) == 0.5
    assert freed_fraction(("shared_experts",), watch) == 0.5
    assert freed_fraction(("mlp", "shared_experts"), watch) == 1
    assert freed_fraction(("moe",), watch) == 0.5  # the whole MoE layer, its shared expert with it


def watch_expert_activation(monkeypatch):
    """A watch on the experts' activation output (the input of their second grouped matmul)."""
    real = moe_module.grouped_mm

    def watch(model, seen):
        calls = [0]

        def recording(rows, weights, counts, grouped):
            calls[0] += 1
            if calls[0] % 2 == 0:
                seen.append(StorageWeakRef(rows.untyped_storage()))
            return real(rows, weights, counts, grouped)
        monkeypatch.setattr(moe_module, "grouped_mm", recording)
        return []
    return watch


@pytest.mark.parametrize("grouped", [False, True])
def test_expert_activation_is_not_kept(monkeypatch, grouped):
    watch = watch_expert_activation(monkeypatch)
    assert freed_fraction(None, watch) == 0
    assert freed_fraction(("moe_act",), watch) == 1
    want_loss, want, _ = loss_and_grads(config(None, grouped_gemm=grouped))
    got_loss, got, _ = loss_and_grads(config(("moe_act",), grouped_gemm=grouped))
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


def mla_model_config(modules):
    from tests.parallel.mla_harness import mla_config

    return mla_config(mtp_num_layers=None, recompute_granularity="selective" if modules is not None else None,
                      recompute_modules=modules or ())


def up_proj_outputs(monkeypatch):
    """A watch on q, k and v as MLA's up projections and RoPE return them (the forward's only)."""
    from megalite.model.mla import MLASelfAttention

    real = MLASelfAttention._up_proj_and_rope

    def watch(model, seen):
        def recording(self, *inputs):
            out = real(self, *inputs)
            if torch.is_grad_enabled():  # not the backward's rebuild
                seen.extend(StorageWeakRef(t.untyped_storage()) for t in out)
            return out
        monkeypatch.setattr(MLASelfAttention, "_up_proj_and_rope", recording)
        return []
    return watch


@pytest.mark.parametrize("modules", [("mla_up_proj",), ("mla_up_proj", "core_attn", "layernorm")])
def test_mla_up_proj_recompute_is_bit_identical_and_drops_the_keys_and_values(monkeypatch, modules):
    """--recompute-modules mla_up_proj (Megatron's qkv_up_proj_and_rope_apply in a checkpoint that
    discards its output): losses and gradients bit for bit those of keeping q, k and v; alone, the
    values the attention saves are not kept after the forward."""
    watch = up_proj_outputs(monkeypatch)
    want_loss, want, kept = loss_and_grads(mla_model_config(None), watch)
    got_loss, got, freed = loss_and_grads(mla_model_config(modules), watch)
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # [q, k, v] of each layer: the math kernel that serves MLA's unequal head widths on CPU saves
    # its own scaled copies of q and k, and v as it is
    assert kept == [True, True, False] * 4, kept
    if modules == ("mla_up_proj",):
        assert freed == [True] * 12, freed


def test_dry_run_formula_is_not_given_for_other_modules():
    """The dry run's Korthikanti activation formula models selective recompute of core attention
    alone: with other --recompute-modules it gives none rather than a wrong number."""
    from megalite.config.arguments import model_config_from_args
    from megalite.dryrun.formulas import korthikanti_activation_bytes
    from tests.config.test_arguments import parsed

    def formula(modules):
        args = parsed("--bf16 --recompute-granularity selective" + (f" --recompute-modules {modules}" if modules else ""),
                      1)
        return korthikanti_activation_bytes(args, model_config_from_args(args, 100), 1, 1, 0, [range(4)])

    assert formula(None) == formula("core_attn") > 0
    assert formula("core_attn mlp") is None
