"""Megatron's SentencePiece tokenizer types, --vocab-extra-ids and the TikTokenizer flags.

GPTSentencePieceTokenizer and SentencePieceTokenizer against Megatron-Core's own SentencePiece
tokenizer (eod, bos, pad, vocabulary, ids) where megatron-core is installed; Llama2Tokenizer
against Megatron's definition (every text starts with <s>: _Llama2Tokenizer.tokenize(bos=True)).
"""

import pytest
import sentencepiece as spm

from megalite.data.tokenizers import TIKTOKEN_PATTERNS, build_tokenizer
from megalite.config.arguments import parse_args
from megalite.config.megatron.model import tokenizer_options

TEXTS = ["def fibonacci(n):\n    return n", "import os, sys", ""]


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer"])
def test_sentencepiece_types_match_megatron_core(sp_model, kind):
    tokenizers = pytest.importorskip("megatron.core.tokenizers")
    reference = tokenizers.MegatronTokenizer.from_pretrained(tokenizer_path=sp_model,
                                                             metadata_path={"library": "sentencepiece"})
    ours = build_tokenizer(kind, tokenizer_model=sp_model)
    assert (ours.eod, ours.bos, ours.pad, ours.vocab_size) == (reference.eod, reference.bos, reference.pad,
                                                                reference.vocab_size)
    for text in TEXTS:
        assert ours.encode(text) == reference.tokenize(text)


def test_llama2_tokenizer_starts_every_text_with_bos(sp_model):
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    ours = build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    assert (ours.eod, ours.bos, ours.pad) == (sp.eos_id(), sp.bos_id(), sp.pad_id())
    as_bytes = ours.encode_batch_bytes(TEXTS)
    for text, raw in zip(TEXTS, as_bytes):
        assert ours.encode(text) == [sp.bos_id()] + sp.encode(text)
        assert raw == bytes(__import__("array").array("i", ours.encode(text)))
    assert ours.decode(ours.encode(TEXTS[0])) == TEXTS[0]


def test_vocab_extra_ids_extend_the_sentencepiece_vocabulary(sp_model):
    plain = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    extra = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model, vocab_extra_ids=3)
    assert extra.vocab_size == plain.vocab_size + 3
    ids = plain.encode("import os") + [plain.vocab_size + 2] + plain.encode(" x")
    assert extra.decode(ids) == "import os<extra_id_2> x"
    with pytest.raises(ValueError, match="--vocab-extra-ids applies only to --tokenizer-type SentencePieceTokenizer"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model, vocab_extra_ids=3)


def _train_args(extra: str):
    return parse_args(("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                       "--micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data " + extra).split())


def test_training_flags_reach_the_tokenizer(sp_model, tiktoken_file):
    args = _train_args(f"--tokenizer-type TikTokenizer --tokenizer-model {tiktoken_file} --tiktoken-pattern v1 "
                       "--tiktoken-num-special-tokens 500 --tokenizer-special-tokens <unk> <s> </s> <pad>")
    tok = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model, **tokenizer_options(args))
    default = build_tokenizer("TikTokenizer", tokenizer_model=tiktoken_file)
    assert tok.num_special == 500 and tok.special_tokens[3] == "<pad>" and tok.eod == 2
    assert tok.enc._pat_str == TIKTOKEN_PATTERNS["v1"] and default.enc._pat_str == TIKTOKEN_PATTERNS["v2"]
    args = _train_args(f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {sp_model} --vocab-extra-ids 4")
    tok = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model, **tokenizer_options(args))
    assert tok.vocab_size == spm.SentencePieceProcessor(model_file=sp_model).get_piece_size() + 4


def test_preprocess_data_takes_the_megatron_tokenizer_types(sp_model, tmp_path):
    """tools/preprocess_data.py with Llama2Tokenizer: every document starts with <s>, as
    Megatron's preprocessing writes it; --vocab-extra-ids reaches its SentencePieceTokenizer."""
    import json

    import numpy as np

    from megalite.data.indexed_dataset import IndexedDataset
    from tests.data.conftest import load_tool

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:2]))
    tool = load_tool("preprocess_data")
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    out = str(tmp_path / "llama2")
    assert tool.main(["--input", str(corpus), "--output-prefix", out, "--tokenizer-type", "Llama2Tokenizer",
                      "--tokenizer-model", sp_model, "--append-eod", "--workers", "1"]) == 0
    docs = IndexedDataset(out + "_text_document")
    for i, text in enumerate(TEXTS[:2]):
        assert np.asarray(docs[i]).tolist() == [sp.bos_id()] + sp.encode(text) + [sp.eos_id()]
    config = tool.parse_args(["--input", str(corpus), "--output-prefix", out, "--tokenizer-type",
                              "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--vocab-extra-ids", "5"])
    assert config.tokenizer_options == {"vocab_extra_ids": 5}
    config = tool.parse_args(["--input", str(corpus), "--output-prefix", out, "--tokenizer-type", "TikTokenizer",
                              "--tokenizer-model", "t.tiktoken", "--tiktoken-pattern", "v1",
                              "--tiktoken-num-special-tokens", "300"])
    assert config.tokenizer_options == {"vocab_extra_ids": 0, "tiktoken_pattern": "v1",
                                        "tiktoken_num_special_tokens": 300, "tiktoken_special_tokens": None}


def test_generate_takes_the_tokenizer_options_from_flags_or_the_training_run():
    from types import SimpleNamespace

    from megalite.inference.cli import _tokenizer_options

    trained = {"vocab_extra_ids": 3, "tiktoken_pattern": "v1", "tiktoken_num_special_tokens": 200}
    unset = SimpleNamespace(vocab_extra_ids=None, tiktoken_pattern=None, tiktoken_num_special_tokens=None)
    assert _tokenizer_options(unset, "SentencePieceTokenizer", trained) == {"vocab_extra_ids": 3}
    given = SimpleNamespace(vocab_extra_ids=0, tiktoken_pattern="v2", tiktoken_num_special_tokens=None)
    assert _tokenizer_options(given, "TikTokenizer", trained) == {
        "vocab_extra_ids": 0, "tiktoken_pattern": "v2", "tiktoken_num_special_tokens": 200,
        "tiktoken_special_tokens": None}


def test_hugging_face_tokenizer_matches_megatron_core(tmp_path):
    tokenizers = pytest.importorskip("megatron.core.tokenizers")
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([f"def f{i}(x): return {i}" for i in range(200)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<s>", "<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<s>",
        "pad_token": "<pad>"}))
    reference = tokenizers.MegatronTokenizer.from_pretrained(tokenizer_path=str(tmp_path),
                                                             metadata_path={"library": "huggingface"})
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert (ours.eod, ours.bos, ours.pad, ours.vocab_size) == (reference.eod, reference.bos, reference.pad,
                                                                reference.vocab_size) == (0, 1, 2, 300)
    for text in TEXTS:
        assert ours.encode(text) == reference.tokenize(text)
