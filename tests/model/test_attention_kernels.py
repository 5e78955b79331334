"""--attention-backend auto / fused on CUDA: the kernel order for each card, the kernel torch's
checks leave, and the start-up line when the first choice cannot take the run's attention. No
GPU: cards are described by name, capability and cuDNN version."""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend

from megalite.model import attention_backends, attention_kernels
from megalite.model.attention_kernels import (CUDNN, EFFICIENT, FLASH, MATH, Call, Card, chosen_kernel, kernel_order,
                                              run_start_up_line, start_up_line, training_call)
from tests.model.test_megatron_features import make_config

H200 = Card("NVIDIA H200", (9, 0), 91002)
H100 = Card("NVIDIA H100 80GB HBM3", (9, 0), 90100)
A100 = Card("NVIDIA A100-SXM4-80GB", (8, 0), 90100)
L40S = Card("NVIDIA L40S", (8, 9), 91002)
V100 = Card("Tesla V100-SXM2-32GB", (7, 0), 90100)
B200 = Card("NVIDIA B200", (10, 0), 92300)
DRIVER = Call(torch.bfloat16, 128, 128, 4096, 4096, 0.0, False, True)  # b 2, 16 heads / 8 groups, d 128
GPT2 = Call(torch.bfloat16, 64, 64, 1024, 1024, 0.1, False, True)
MLA = Call(torch.bfloat16, 192, 128, 4096, 4096, 0.0, False, True)


def with_(call: Call, **changes) -> Call:
    return dataclasses.replace(call, **changes)


@pytest.mark.parametrize("card, first", [(H200, CUDNN), (H100, CUDNN), (B200, CUDNN), (A100, FLASH), (L40S, FLASH),
                                         (V100, FLASH), (None, FLASH)])
def test_auto_order_without_a_measured_row(card, first):
    order = kernel_order("auto", card, DRIVER, measured={})
    assert order[0] == first and order[-1] == MATH
    assert sorted(order, key=int) == sorted((CUDNN, FLASH, EFFICIENT, MATH), key=int)  # each once
    if first == FLASH:
        assert order == (FLASH, EFFICIENT, CUDNN, MATH)  # torch's own order


def test_fused_is_cudnn_then_memory_efficient_on_every_card():
    for card in (H200, A100, V100, None):
        assert kernel_order("fused", card, DRIVER, measured={}) == (CUDNN, EFFICIENT)


def test_a_measured_row_decides_its_card_and_head_widths_only():
    measured = {"NVIDIA H200": {"qk128-v128": ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"),
                                "qk192-v128": ("EFFICIENT_ATTENTION",)}}
    assert kernel_order("auto", H200, DRIVER, measured) == (FLASH, CUDNN, EFFICIENT, MATH)
    assert kernel_order("auto", H200, MLA, measured) == (EFFICIENT, CUDNN, FLASH, MATH)  # the rest appended
    assert kernel_order("auto", H200, GPT2, measured)[0] == CUDNN  # no row for d 64: the default
    assert kernel_order("auto", H100, DRIVER, measured)[0] == CUDNN  # another card's name
    assert kernel_order("fused", H200, DRIVER, measured) == (CUDNN, EFFICIENT)  # fused is cuDNN first always


@pytest.mark.parametrize("call, card, kernel", [
    (DRIVER, H200, CUDNN), (with_(DRIVER, dropout=0.125), H200, CUDNN), (with_(DRIVER, dropout=0.1), H200, FLASH),
    (with_(DRIVER, masked=True, dropout=0.1), H200, EFFICIENT),  # flash takes no mask
    (with_(DRIVER, dtype=torch.float32), H200, EFFICIENT), (GPT2, A100, FLASH), (with_(GPT2, dropout=0.0), H200, CUDNN),
    (MLA, Card("NVIDIA H200", (9, 0), 91400), CUDNN),  # (192, 128) on sm90 from cuDNN 9.11
    (MLA, H200, EFFICIENT),  # cuDNN 9.10: q/k 192 is over 128; flash: unequal widths
    (with_(DRIVER, d_qk=256, d_v=256), H200, FLASH), (with_(DRIVER, d_qk=256, d_v=256), B200, CUDNN),
    (with_(DRIVER, dropout=0.125), Card("NVIDIA H200", (9, 0), 91200), FLASH),  # cuDNN 9.12: no dropout
    (DRIVER, dataclasses.replace(H200, deterministic=True), FLASH), (DRIVER, Card("NVIDIA H200", (9, 0), None), FLASH),
    (DRIVER, V100, MATH), (with_(DRIVER, dtype=torch.float16), V100, EFFICIENT),  # bf16 before sm80: math only
    (with_(DRIVER, dtype=torch.float16, d_qk=12, d_v=12), A100, FLASH),  # flash takes any width up to 256
    (with_(DRIVER, dtype=torch.float32, d_qk=6, d_v=6), A100, MATH),  # fp32 widths not a multiple of 4
])
def test_kernel_torch_will_run(call, card, kernel):
    assert chosen_kernel(kernel_order("auto", card, call, measured={}), card, call)[0] == kernel


def test_l40s_has_no_flash_backward_for_head_width_256_with_dropout():
    wide = with_(DRIVER, d_qk=256, d_v=256, dropout=0.0625)
    assert chosen_kernel((FLASH, EFFICIENT), L40S, wide)[0] == EFFICIENT
    assert chosen_kernel((FLASH, EFFICIENT), L40S, with_(wide, grad=False))[0] == FLASH


def test_megatrons_default_dropout_names_the_flag_and_the_kernel_it_falls_to():
    line = start_up_line("auto", H200, with_(DRIVER, dropout=0.1))
    assert line == ("--attention-backend auto --attention-dropout 0.1 on NVIDIA H200: CUDNN_ATTENTION cannot take "
                    "this attention (dropout 0.1 is not a multiple of 1/16, the only dropout cuDNN attention takes); "
                    "it runs FLASH_ATTENTION (--attention-dropout 0.0625 or 0.125 would keep CUDNN_ATTENTION)")
    fused = start_up_line("fused", H200, with_(DRIVER, dropout=0.1))
    assert fused.startswith("--attention-backend fused --attention-dropout 0.1 on NVIDIA H200: CUDNN_ATTENTION")
    assert "it runs EFFICIENT_ATTENTION" in fused


@pytest.mark.parametrize("backend, card, call", [
    ("auto", H200, DRIVER), ("auto", H200, with_(DRIVER, dropout=0.125)), ("fused", H200, DRIVER),
    ("auto", A100, GPT2),  # flash first there: dropout is no matter
    ("flash", H200, with_(DRIVER, dropout=0.1)), ("unfused", H200, with_(DRIVER, dropout=0.1)),  # no dispatch to explain
    ("auto", None, with_(DRIVER, dropout=0.1)),  # no card (fake CUDA)
])
def test_no_line_when_the_first_kernel_serves(backend, card, call):
    assert start_up_line(backend, card, call) is None


def test_other_refusals_name_their_flag():
    det = start_up_line("auto", dataclasses.replace(H200, deterministic=True), DRIVER)
    assert det.startswith("--attention-backend auto --deterministic-mode on NVIDIA H200: CUDNN_ATTENTION")
    assert "it runs FLASH_ATTENTION" in det
    masked = start_up_line("auto", A100, with_(GPT2, masked=True))
    assert masked.startswith("--attention-backend auto --reset-attention-mask on NVIDIA A100-SXM4-80GB: FLASH_ATTENTION")
    fp32 = start_up_line("auto", H200, with_(DRIVER, dtype=torch.float32))
    assert fp32 == ("--attention-backend auto without --bf16 / --fp16 on NVIDIA H200: CUDNN_ATTENTION cannot take "
                    "this attention (float32, cuDNN attention takes fp16 / bf16 only); it runs EFFICIENT_ATTENTION")
    wide = start_up_line("auto", H100, with_(DRIVER, d_qk=256, d_v=256))
    assert "--kv-channels" in wide and "up to 128" in wide and wide.endswith("it runs FLASH_ATTENTION")


def test_the_run_line_reads_the_config_and_skips_what_sdpa_does_not_serve(monkeypatch):
    monkeypatch.setattr(attention_kernels, "card_of", lambda index: H200)
    config = make_config("llama", attention_dropout=0.1, attention_backend="auto")
    run = dict(seq_length=4096, dtype=torch.bfloat16, masked=False, deterministic=False, context_parallel=1)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    line = run_start_up_line(config, cuda, **run)
    assert line.startswith("--attention-backend auto --attention-dropout 0.1 on NVIDIA H200")
    assert run_start_up_line(config, cpu, **run) is None
    assert run_start_up_line(config, cuda, **{**run, "context_parallel": 2}) is None
    assert run_start_up_line(config.replace(use_flash_attn=True), cuda, **run) is None
    assert run_start_up_line(config.replace(attention_dropout=0.0), cuda, **run) is None
    assert "--deterministic-mode" in run_start_up_line(config.replace(attention_dropout=0.0), cuda,
                                                       **{**run, "deterministic": True})
    call = training_call(config, 4096, torch.bfloat16, False)
    assert (call.d_qk, call.d_v, call.dropout, call.grad) == (config.kv_channels, config.kv_channels, 0.1, True)


def test_mla_training_call_has_its_unequal_widths():
    from megalite.model.mla_config import MLAConfig

    mla = MLAConfig(kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
    config = make_config("llama").replace(mla=mla)
    call = training_call(config, 1024, torch.bfloat16, False)
    assert (call.d_qk, call.d_v) == (192, 128)


@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_core_attention_runs_sdpa_under_the_cards_order(backend, monkeypatch):
    """Fake CUDA tensors through core_attention: SDPA is called under sdpa_kernel(order,
    set_priority=True) with the order for the card, and the priority is restored afterwards."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls, kernel = [], attention_backends.sdpa_kernel
    monkeypatch.setattr(attention_backends, "card_of", lambda index: H200)
    monkeypatch.setattr(attention_backends, "sdpa_kernel",
                        lambda ks, set_priority=False: calls.append((ks, set_priority)) or kernel(ks, set_priority))
    before = torch._C._get_sdp_priority_order()
    with FakeTensorMode():
        q, k, v = (torch.empty(2, heads, 64, 128, device="cuda", dtype=torch.bfloat16) for heads in (4, 2, 2))
        out = attention_backends.core_attention(q, k, v, None, backend=backend, dropout=0.1, scale=0.25)
    assert out.shape == q.shape and torch._C._get_sdp_priority_order() == before
    expected = list(kernel_order(backend, H200, with_(DRIVER, seq_q=64, seq_k=64, dropout=0.1, grad=False)))
    assert calls == [(expected, True)]
    assert expected[0] == CUDNN or attention_kernels.MEASURED  # cuDNN first for an H200 without a measured row


def test_how_served_fused_on_cuda_names_the_order():
    line = attention_backends.how_served("fused", "cuda")
    assert "CUDNN_ATTENTION, else its EFFICIENT_ATTENTION" in line
    assert SDPBackend.FLASH_ATTENTION.name in attention_backends.how_served("fused", "cpu")
