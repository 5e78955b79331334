"""--fim-data and the FIM family against Megatron-LM's GPTFIMDataset (megatron/training/datasets/
fim_dataset.py: _query_document_sample_shuffle_indices cuts the sample at the FIM EOD token and
pads/truncates with the FIM pad token; _fim_split_and_permute_sequence; _permute draws
binomial(1, fim_rate), then randint(0, len(text) + 1, size=2) for the two character
boundaries, then binomial(1, fim_spm_rate), and writes PSM <pre> prefix <suf> suffix <mid>
middle or SPM <pre> <suf> suffix <mid> prefix middle). megatron.training cannot be imported
here (megatron-core alone is installed), so the expected samples are built by hand from that
source: a character-level Hugging Face tokenizer makes every text's ids its characters, and a
twin RandomState replays Megatron's draws in Megatron's order."""

import pickle

import numpy as np
import pytest

from megalite.config.arguments import parse_args, validate_args
from megalite.config.run_config import run_config
from megalite.data.builder import build_gpt_datasets
from megalite.data.fim import FimText, FimTransform, fim_config_from_options, fim_sample, split_and_permute
from megalite.data.indexed_dataset import IndexedDatasetWriter
from megalite.data.tokenizers import HuggingFaceTokenizer, build_tokenizer

SENTINELS = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>", "pad": "<fim_pad>",
             "eod": "<|endoftext|>"}
LETTERS = "abcdefghijklmnopqrstuvwxyz "


@pytest.fixture(scope="module")
def char_tokenizer_file(tmp_path_factory):
    """Ids 0-26: one per character of LETTERS; then the five FIM tokens, special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(LETTERS)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SENTINELS.values()])
    path = tmp_path_factory.mktemp("chars") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def char_tokenizer(char_tokenizer_file):
    return HuggingFaceTokenizer(char_tokenizer_file)


def _config(tokenizer, rate=1.0, spm=0.0, **extra):
    return fim_config_from_options(FimText(tokenizer), rate=rate, spm_rate=spm, tokens=SENTINELS, **extra)[0]


def ids(text):
    return [LETTERS.index(c) for c in text]


def test_sentinels_are_looked_up_by_name(char_tokenizer):
    config = _config(char_tokenizer)
    assert (config.prefix, config.middle, config.suffix, config.pad, config.eod) == (27, 28, 29, 30, 31)


@pytest.mark.parametrize("spm", [0.0, 1.0])
def test_a_sample_as_megatrons_source_builds_it(char_tokenizer, spm):
    config = _config(char_tokenizer, spm=spm)
    pre, mid, suf, pad, eod = config.prefix, config.middle, config.suffix, config.pad, config.eod
    texts = ("hello world", "fim")
    sample = np.array(ids(texts[0]) + [eod] + ids(texts[1]), dtype=np.int64)
    twin = np.random.RandomState(11)
    expected = []
    for n, text in enumerate(texts):
        assert twin.binomial(1, 1.0) == 1
        low, high = sorted(twin.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = ids(text[:low]), ids(text[low:high]), ids(text[high:])
        if twin.binomial(1, spm):  # SPM
            expected += [pre, suf] + suffix + [mid] + prefix + middle
        else:  # PSM
            expected += [pre] + prefix + [suf] + suffix + [mid] + middle
        if n == 0:
            expected.append(eod)
    expected = expected[:len(sample)]  # three sentinels per segment make it longer: cut
    got = fim_sample(sample, config, FimText(char_tokenizer), np.random.RandomState(11))
    assert got.tolist() == expected


def test_length_is_kept_with_the_pad_token_and_empty_segments_drop_their_eod(char_tokenizer):
    config = _config(char_tokenizer, rate=0.0)
    eod = config.eod
    sample = np.array(ids("ab") + [eod, eod] + ids("c"), dtype=np.int64)
    # Megatron keeps an EOD only after a non-empty segment, then pads to the sample's length.
    assert fim_sample(sample, config, FimText(char_tokenizer), np.random.RandomState(0)).tolist() == \
        ids("ab") + [eod] + ids("c") + [config.pad]


def test_rates_split_and_no_prefix(char_tokenizer):
    text, rng = FimText(char_tokenizer), np.random.RandomState(3)
    config = _config(char_tokenizer, rate=0.5, spm=0.25)
    spm = psm = plain = 0
    for _ in range(2000):
        out = fim_sample(np.array(ids("the quick brown fox"), dtype=np.int64), config, text, rng)
        first = out[:2].tolist()
        if first == [config.prefix, config.suffix]:
            spm += 1
        elif first[0] == config.prefix:
            psm += 1
        else:
            plain += 1
            assert out.tolist() == ids("the quick brown fox")
    # A PSM segment whose prefix is empty reads as SPM: P(min boundary = 0) = 1 - (19/20)^2 for 19 characters.
    assert abs(plain / 2000 - 0.5) < 0.05 and abs(spm / (spm + psm) - (0.25 + 0.75 * (1 - (19 / 20) ** 2))) < 0.04
    kept = _config(char_tokenizer, no_prefix="the")
    sample = np.array(ids("the fox"), dtype=np.int64)
    assert fim_sample(sample, kept, text, rng).tolist() == sample.tolist()
    split = _config(char_tokenizer, split_sample="<fim_pad>", fragment_rate=1.0)
    out = split_and_permute(np.array(ids("ab") + [split.pad] + ids("cd"), dtype=np.int64), split, text, rng).tolist()
    assert out.count(split.prefix) == 2 and out.count(split.pad) == 1  # each fragment FIM'd, the split token kept


def test_gpt2_lacks_the_sentinels_so_they_are_its_unknown_token(gpt2_files):
    """Megatron's GPT2BPETokenizer is Hugging Face's GPT-2, whose unknown token is <|endoftext|>:
    Megatron's functional test gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset runs so."""
    vocab, merges, _ = gpt2_files
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    config, notes = fim_config_from_options(FimText(tokenizer), rate=0.5, spm_rate=0.5, tokens=SENTINELS)
    assert (config.prefix, config.middle, config.suffix, config.pad, config.eod) == (tokenizer.eod,) * 5
    assert notes[0] == ("--fim-prefix-token '<fim_prefix>': not in the tokenizer's vocabulary; it is the unknown "
                        f"token {tokenizer.eod}, as Megatron's tokenizer maps it")
    transform = FimTransform(config, FimText(tokenizer), 5)
    assert (pickle.loads(pickle.dumps(transform))(np.arange(9), 3) == transform(np.arange(9), 3)).all()
    with pytest.raises(ValueError, match="--fim-data works with --tokenizer-type GPT2BPETokenizer or "
                                         "HuggingFaceTokenizer"):
        FimText(build_tokenizer("NullTokenizer", vocab_size=10))


def test_the_flag_reaches_the_datasets(tmp_path, char_tokenizer_file):
    prefix = str(tmp_path / "docs")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for _ in range(40):
            writer.add_document(np.append(rng.integers(0, 27, int(rng.integers(5, 30))), 31))
    argv = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            f"--train-iters 4 --lr 1e-3 --data-path {prefix} --split 1,0,0 --tokenizer-type HuggingFaceTokenizer "
            f"--tokenizer-model {char_tokenizer_file} --fim-data --fim-rate 1 --fim-spm-rate 0.5")
    cfg = run_config(parse_args(argv.split()), 1)
    assert isinstance(cfg.data.fim, FimTransform) and any(n.startswith("--fim-data: 1 of segments") for n in cfg.notes)
    common = dict(data_path=[prefix], split="1,0,0", seq_length=32, seed=1234, num_samples=(8, 0, 0),
                  eod_token=31, vocab_size=32, cache_path=str(tmp_path / "cache"))
    fim, plain = build_gpt_datasets(**common, sample_transform=cfg.data.fim)[0], build_gpt_datasets(**common)[0]
    for i in range(8):
        item, base = fim[i], plain[i]
        assert 27 in item["tokens"].tolist() + item["labels"].tolist()  # <fim_prefix>: every segment FIM'd
        assert item["tokens"].shape == base["tokens"].shape
        assert (item["labels"][:-1] == item["tokens"][1:]).all()
        assert (fim[i]["tokens"] == item["tokens"]).all()  # the same sample every time it is read
    worker_copy = pickle.loads(pickle.dumps(fim))  # what a DataLoader worker gets
    assert all((worker_copy[i]["tokens"] == fim[i]["tokens"]).all() for i in range(8))
    for old, new, message in ((f"--data-path {prefix} --split 1,0,0", "--mock-data",
                               "--fim-data and --mock-data contradict each other"),
                              ("--fim-rate 1", "--fim-rate 0", "--fim-data needs a non-zero --fim-rate"),
                              ("--fim-data", "--fim-data --fim-split-sample x",
                               "--fim-split-sample needs --fim-fragment-rate")):
        with pytest.raises(ValueError, match=message):
            validate_args(parse_args(argv.replace(old, new).split()), 1)
