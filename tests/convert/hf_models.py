"""Tiny random transformers models (nothing downloaded) and helpers shared by the conversion
and generation tests."""

import torch

from megalite.convert.cli import main as convert_main

VOCAB, POSITIONS = 300, 64
FAMILIES = ("gpt2", "llama")  # llama: grouped-query attention (4 heads, 2 groups), untied output


def hf_model(family: str, *, num_layers: int = 4, tied: bool = False, seed: int = 0):
    """A GPT2LMHeadModel, or a LlamaForCausalLM with GQA, randomly initialised in fp32."""
    import transformers

    torch.manual_seed(seed)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=num_layers, n_embd=64, n_head=4, vocab_size=VOCAB,
                                         n_positions=POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         initializer_range=0.1, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=num_layers, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
                                          max_position_embeddings=POSITIONS, initializer_range=0.1,
                                          rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    return model.eval()


def save_hf(model, directory, **kwargs) -> str:
    model.save_pretrained(directory, **kwargs)
    return str(directory)


def convert(*argv) -> int:
    """tools/checkpoint/convert.py in this process; its exit status."""
    return convert_main([str(a) for a in argv])


def hf_to_megalite(hf_dir, out_dir, tp=1, pp=1, vp=1) -> str:
    status = convert("--loader", "hf", "--saver", "megalite", "--load-dir", hf_dir, "--save-dir", out_dir,
                     "--target-tensor-parallel-size", tp, "--target-pipeline-parallel-size", pp,
                     "--target-num-virtual-stages", vp)
    assert status == 0, f"conversion of {hf_dir} failed"
    return str(out_dir)


def megalite_to_hf(load_dir, out_dir, *extra) -> str:
    status = convert("--loader", "megalite", "--saver", "hf", "--load-dir", load_dir, "--save-dir", out_dir, *extra)
    assert status == 0, f"export of {load_dir} failed"
    return str(out_dir)


def tokens(batch=2, seq=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _byte_level_bpe():
    """A byte-level BPE of exactly VOCAB tokens (id 0 = <|endoftext|>, the EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = ["the quick brown fox jumps over the lazy dog"] * 20 + ["hello world, hello megalite"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == VOCAB
    return tok


def write_hf_tokenizer(directory) -> None:
    """The byte-level BPE as a tokenizer.json (HuggingFaceTokenizer)."""
    import json
    from pathlib import Path

    directory = Path(directory)
    _byte_level_bpe().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))


def write_gpt2_bpe_files(directory) -> None:
    """The byte-level BPE as GPT-2's vocab.json + merges.txt (GPT2BPETokenizer), nothing else."""
    _byte_level_bpe().model.save(str(directory))
