"""Megatron's implementation, fusion and model-variant flags on the command line: each
either changes what is built (the GPTConfig field, the kernel a model op dispatches to) or
prints its one start-up line; contradictions stop with one line naming the flag. (The FP8
family: tests/config/test_fp8_flags.py.)"""

import pytest
import torch

from megalite import kernels
from megalite.model import gpt as gpt_module
from megalite.model.gpt import GPTModel
from megalite.config.arguments import model_config_from_args, validate_args
from megalite.config.megatron.model import start_up_notes
from tests.config.test_arguments import parsed, refused

ROPE = "--position-embedding-type rope "


@pytest.mark.parametrize("extra, field, value", [
    ("--apply-layernorm-1p", "apply_layernorm_1p", True),
    ("--qk-layernorm", "qk_layernorm", True),
    ("--squared-relu", "activation", "squared_relu"),
    (ROPE + "--rotary-interleaved", "rotary_interleaved", True),
    ("--use-rotary-position-embeddings", "position_embedding_type", "rope"),
    (ROPE + "--rotary-seq-len-interpolation-factor 4", "rotary_seq_len_interpolation_factor", 4.0),
    (ROPE + "--use-rope-scaling", "use_rope_scaling", True),
    (ROPE + "--use-rope-scaling --rope-scaling-factor 16", "rope_scaling_factor", 16.0),
    ("--position-embedding-type none", "position_embedding_type", "none"),
    ("--attention-backend flash", "attention_backend", "flash"),
    ("--attention-backend fused", "attention_backend", "fused"),
    ("--attention-backend unfused", "attention_backend", "unfused"),
    ("--attention-backend local", "attention_backend", "local"),
])
def test_model_flags_reach_the_model_config(extra, field, value):
    config = model_config_from_args(parsed(extra, 1), 100)
    assert getattr(config, field) == value
    assert getattr(model_config_from_args(parsed("", 1), 100), field) != value


@pytest.mark.parametrize("extra, words", [
    ("--squared-relu --swiglu", ["--squared-relu", "--swiglu"]),
    ("--rotary-interleaved", ["--rotary-interleaved", "--position-embedding-type rope"]),
    ("--use-rope-scaling", ["--use-rope-scaling", "rope"]),
    ("--no-position-embedding", ["--no-position-embedding", "--position-embedding-type"]),
    ("--use-rotary-position-embeddings --position-embedding-type none",
     ["--use-rotary-position-embeddings", "none"]),
    ("--vocab-extra-ids 4", ["--vocab-extra-ids 4", "SentencePieceTokenizer", "NullTokenizer"]),
    ("--attention-backend flash --reset-attention-mask", ["--attention-backend flash", "--reset-attention-mask"]),
    (ROPE + "--rotary-seq-len-interpolation-factor 0", ["--rotary-seq-len-interpolation-factor"]),
])
def test_contradictions_are_refused(extra, words):
    message = refused(extra)
    assert all(w in message for w in words), message


def _dispatch(extra: str, monkeypatch) -> dict:
    """The impl each fused op is called with in one forward/backward of the model these flags build."""
    seen = {}
    with monkeypatch.context() as patch:
        return _dispatch_with(extra, patch, seen)


def _dispatch_with(extra, monkeypatch, seen):
    def spy(module, name, key):
        original = getattr(module, name)

        def wrapper(*args, impl, **kwargs):
            seen.setdefault(key, set()).add(impl)
            return original(*args, impl=impl, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    spy(kernels, "swiglu", "swiglu")
    spy(kernels, "bias_gelu", "bias_gelu")
    spy(kernels, "apply_rotary", "rotary")
    spy(kernels, "bias_dropout_add", "bias_dropout_add")
    spy(gpt_module, "vocab_parallel_cross_entropy", "cross_entropy")
    config = model_config_from_args(parsed(extra, 1), 100).replace(hidden_dropout=0.0, attention_dropout=0.0)
    tokens = torch.randint(0, 100, (2, 32))
    GPTModel(config)(tokens, labels=tokens).mean().backward()
    return seen


@pytest.mark.parametrize("family", ["--swiglu " + ROPE, ""])
def test_fusion_flags_switch_each_kernel_to_its_torch_reference(family, monkeypatch):
    default = _dispatch(family, monkeypatch)
    # Megatron's default: cross-entropy unfused unless --cross-entropy-loss-fusion.
    assert default.pop("cross_entropy") == {"torch"} and all(v == {"auto"} for v in default.values()), default
    fused_ce = _dispatch(family + "--cross-entropy-loss-fusion", monkeypatch)
    assert fused_ce["cross_entropy"] == {"auto"}
    assert _dispatch(family + "--bias-dropout-fusion", monkeypatch) == dict(default, cross_entropy={"torch"})
    off = _dispatch(family + "--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-rope-fusion --no-bias-dropout-fusion "
                    "--cross-entropy-loss-fusion", monkeypatch)
    expected_off = {"swiglu", "rotary", "bias_dropout_add"} if family else {"bias_gelu", "bias_dropout_add"}
    assert set(default) == expected_off and all(off[op] == {"torch"} for op in expected_off), off
    for flag, op in (("--no-bias-gelu-fusion", "bias_gelu"), ("--no-bias-swiglu-fusion", "swiglu"),
                     ("--no-rope-fusion", "rotary"), ("--no-bias-dropout-fusion", "bias_dropout_add")):
        if op in expected_off:  # each flag switches its own op and no other
            one = _dispatch(family + flag, monkeypatch)
            assert one[op] == {"torch"} and all(one[o] == {"auto"} for o in expected_off - {op}), (flag, one)


NOTES = {
    "--use-mcore-models": "--use-mcore-models",
    "--transformer-impl transformer_engine": "Transformer Engine not used",
    "--attention-backend fused": "restricted to FLASH_ATTENTION (CPU has no cuDNN",
    "--attention-backend flash": "restricted to FLASH_ATTENTION",
    "--attention-backend unfused": "megalite's explicit attention",
    "--no-masked-softmax-fusion": "no masked-softmax kernel",
    "--no-persist-layer-norm": "no persistent variant",
    "--apply-query-key-layer-scaling": "identity",
    "--no-use-tokenizer-model-from-checkpoint-args": "this command line's",
    "--cross-entropy-loss-fusion --cross-entropy-fusion-impl te": "own fused cross-entropy",
    ROPE + "--no-position-embedding": "no learned position table",
    "--tiktoken-pattern v2": "not used by --tokenizer-type NullTokenizer",
}


@pytest.mark.parametrize("extra, words", NOTES.items())
def test_flags_served_another_way_say_how_in_one_line(extra, words):
    notes = start_up_notes(parsed(extra, 1), "cpu")
    assert len(notes) == 1 and words in notes[0] and "\n" not in notes[0], notes


def test_gpt2_bpe_files_without_a_tokenizer_type_mean_gpt2_bpe():
    args = parsed("--vocab-file v.json --merge-file m.txt", None)
    args.tokenizer_type = args.vocab_size = None
    args.mock_data = True
    validate_args(args, 1)
    assert args.tokenizer_type == "GPT2BPETokenizer"
    assert start_up_notes(args, "cpu") == ["--tokenizer-type not given: GPT2BPETokenizer, from --vocab-file and "
                                           "--merge-file"]


def test_defaults_print_no_notes():
    assert start_up_notes(parsed("", 1), "cpu") == []
    assert start_up_notes(parsed("--transformer-impl local --attention-backend auto", 1), "cuda") == []
