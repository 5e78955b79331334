"""--fim-data: fill-in-the-middle samples, as Megatron-LM's GPTFIMDataset makes them
(megatron/training/datasets/fim_dataset.py).

A sample's seq_length + 1 tokens are cut at every FIM end-of-document token (--fim-eod-token);
each non-empty segment becomes, with probability --fim-rate, a FIM segment: its text (the
tokenizer's special tokens dropped) is cut at two character positions drawn uniformly from
[0, len(text)] into prefix, middle and suffix, each encoded again, and written as

    PSM  <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle
    SPM  <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle     (probability --fim-spm-rate)

The segments are joined by the end-of-document token again and the sample is cut or padded
(with --fim-pad-token) back to its length. With --fim-split-sample TOKEN, a segment containing
that token is, with probability --fim-rate, split at it and each fragment permuted with
probability --fim-fragment-rate; --fim-no-prefix TEXT leaves segments starting with TEXT as
they are. The sentinels are looked up in the tokenizer's vocabulary by name, as Megatron's
Hugging Face tokenizers do: a name the vocabulary lacks becomes the unknown token (GPT-2's is
<|endoftext|>), and the start-up line says so.

Megatron draws every decision from one numpy RandomState(seed) per dataset, in the order
samples are read; megalite from RandomState([seed, sample index]), the same distribution but
independent of DataLoader workers and of where a resumed run starts.
"""

from dataclasses import dataclass

import numpy as np

SENTINELS = ("prefix", "middle", "suffix", "pad", "eod")


@dataclass(frozen=True)
class FimConfig:
    rate: float
    spm_rate: float
    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split_sample: int | None = None
    fragment_rate: float | None = None
    no_prefix: str | None = None


class FimText:
    """Text <-> ids for FIM through a megalite tokenizer: GPT2BPETokenizer and
    HuggingFaceTokenizer (Megatron's FIM detokenizes through a Hugging Face tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        if hasattr(tokenizer, "bpe"):  # GPT2BPETokenizer: Hugging Face's GPT-2 (unknown = <|endoftext|>)
            self.vocab, self.unknown = dict(tokenizer.bpe.encoder), tokenizer.eod
            self.special = {tokenizer.eod}
        elif hasattr(tokenizer, "tok"):  # HuggingFaceTokenizer
            self.vocab = tokenizer.tok.get_vocab(with_added_tokens=True)
            self.special = {i for i, t in tokenizer.tok.get_added_tokens_decoder().items() if t.special}
            model = getattr(tokenizer.tok.model, "unk_token", None)
            self.unknown = self.vocab.get(model) if model else None
        else:
            raise ValueError(f"--fim-data works with --tokenizer-type GPT2BPETokenizer or HuggingFaceTokenizer "
                             f"(Megatron's FIM dataset detokenizes through a Hugging Face tokenizer), not "
                             f"{type(tokenizer).__name__}")

    def token_id(self, flag: str, token: str) -> tuple[int, str | None]:
        """(id, a start-up line when the vocabulary lacks `token`)."""
        if token in self.vocab:
            return self.vocab[token], None
        if self.unknown is None:
            raise ValueError(f"{flag} {token!r} is not in the tokenizer's vocabulary, which has no unknown token")
        return self.unknown, (f"{flag} {token!r}: not in the tokenizer's vocabulary; it is the unknown token "
                              f"{self.unknown}, as Megatron's tokenizer maps it")

    def to_text(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids if int(i) not in self.special])

    def to_ids(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text) if text else [], dtype=np.int64)


def fim_config_from_options(text: FimText, *, rate, spm_rate, tokens: dict, split_sample=None,
                            fragment_rate=None, no_prefix=None) -> tuple[FimConfig, list[str]]:
    """The FimConfig of --fim-* values (`tokens`: sentinel name -> token text) and its notes."""
    ids, notes = {}, []
    for name in SENTINELS:
        ids[name], note = text.token_id(f"--fim-{name}-token", tokens[name])
        notes += [note] if note else []
    split = None
    if split_sample is not None:
        split, note = text.token_id("--fim-split-sample", split_sample)
        notes += [note] if note else []
    return FimConfig(rate=rate, spm_rate=spm_rate, split_sample=split, fragment_rate=fragment_rate,
                     no_prefix=no_prefix, **ids), notes


def permute(segment: np.ndarray, rate: float, config: FimConfig, text: FimText, rng) -> np.ndarray:
    """Megatron's _permute (truncate_or_pad=False): one segment, FIM with probability `rate`."""
    if not rng.binomial(1, rate):
        return segment
    contents = text.to_text(segment)
    if config.no_prefix is not None and contents.startswith(config.no_prefix):
        return segment
    low, high = sorted(rng.randint(low=0, high=len(contents) + 1, size=2))
    prefix, middle, suffix = (text.to_ids(part) for part in
                              (contents[:low], contents[low:high], contents[high:]))
    if rng.binomial(1, config.spm_rate):
        parts = [[config.prefix, config.suffix], suffix, [config.middle], prefix, middle]
    else:
        parts = [[config.prefix], prefix, [config.suffix], suffix, [config.middle], middle]
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def split_and_permute(segment: np.ndarray, config: FimConfig, text: FimText, rng) -> np.ndarray:
    """Megatron's _fim_split_and_permute_sequence."""
    if config.split_sample is None:
        return permute(segment, config.rate, config, text, rng)
    breaks = np.flatnonzero(segment == config.split_sample)
    if breaks.size == 0:
        return permute(segment, config.rate, config, text, rng)
    if not rng.binomial(1, config.rate):
        return segment
    pieces, start = [], 0
    for loc in breaks:
        if loc - start > 0:
            pieces += [permute(segment[start:loc], config.fragment_rate, config, text, rng), [config.split_sample]]
        start = loc + 1
    pieces.append(permute(segment[start:], config.fragment_rate, config, text, rng))
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])


def fim_sample(sample: np.ndarray, config: FimConfig, text: FimText, rng) -> np.ndarray:
    """A sample's tokens after FIM, the same length (GPTFIMDataset's
    _query_document_sample_shuffle_indices)."""
    length = sample.shape[0]
    breaks = np.flatnonzero(sample == config.eod)
    if breaks.size:
        pieces, start = [], 0
        for loc in breaks:
            if loc - start > 0:  # only non-empty segments are permuted
                pieces += [split_and_permute(sample[start:loc], config, text, rng), [config.eod]]
            start = loc + 1
        pieces.append(split_and_permute(sample[start:], config, text, rng))
        out = np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])
    else:
        out = split_and_permute(sample, config, text, rng)
    if out.shape[0] > length:
        out = out[:length]
    elif out.shape[0] < length:
        out = np.concatenate([out, np.full(length - out.shape[0], config.pad, dtype=np.int64)])
    return out.astype(np.int64)


class FimTransform:
    """GPTDataset's sample_transform for --fim-data: sample `index` drawn from
    RandomState([seed, index])."""

    def __init__(self, config: FimConfig, text: FimText, seed: int):
        self.config, self.text, self.seed = config, text, seed

    def __call__(self, tokens: np.ndarray, index: int) -> np.ndarray:
        rng = np.random.RandomState([self.seed, int(index)])
        return fim_sample(tokens, self.config, self.text, rng)
