"""Train a SentencePiece BPE tokenizer from JSONL or plain-text files.

    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text \
        --vocab-size 8000 --model-prefix tok

writes tok.model and tok.vocab (under temporary names, renamed on success). The model uses
byte fallback, so any text encodes without <unk>, and ids 0-3 are <unk>, <s>, </s>, <pad>;
`SentencePieceTokenizer` uses </s> as the end-of-document token. Training is single-threaded
and reads its input in a fixed order, so the same input gives the same model.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.corpus import expand_inputs  # noqa: E402
from megalite.data.shards import read_documents  # noqa: E402

MAX_SENTENCE_BYTES = 4192


def training_sentences(paths, json_keys, text_mode, max_sentences):
    """Lines of the documents' text, the unit SentencePiece trains on, in input order."""
    count = 0
    for doc in read_documents(paths, json_keys, text_mode):
        for text in doc:
            for line in text.splitlines():
                line = line.strip()
                if not line:
                    continue
                yield line[:MAX_SENTENCE_BYTES]
                count += 1
                if max_sentences and count >= max_sentences:
                    return


def train_sentencepiece(sentences, model_prefix: str, vocab_size: int, character_coverage: float = 0.9995):
    """Train a byte-fallback BPE SentencePiece model; write model_prefix.model/.vocab."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()  # in memory, so no temporary path ends up inside the model
    try:
        _train(spm, sentences, model, vocab_size, character_coverage)
    except RuntimeError as e:  # SentencePiece reports bad settings as RuntimeError
        raise ValueError(f"SentencePiece training failed: {e}") from None
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    write_atomic(model_prefix + ".vocab", vocab.encode("utf-8"))
    write_atomic(model_prefix + ".model", model.getvalue())


def _train(spm, sentences, model, vocab_size, character_coverage):
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=character_coverage,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        num_threads=1,
        shuffle_input_sentence=False,
        max_sentence_length=MAX_SENTENCE_BYTES,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        hard_vocab_limit=False,
        minloglevel=2,
    )


def write_atomic(path: str, data: bytes):
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL (.jsonl, .json, .jsonl.gz) or text files, directories or globs")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys to read from JSONL")
    parser.add_argument("--text-mode", choices=["line", "file"], default="line",
                        help="plain-text files: one document per line (default) or per file")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--max-sentences", type=int, default=2_000_000,
                        help="train on at most this many lines (0: all)")
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    args = parser.parse_args(argv)
    if args.vocab_size < 260:
        parser.error(f"--vocab-size {args.vocab_size} is too small: byte fallback alone needs 260 ids")
    try:
        paths = expand_inputs(args.input)
        train_sentencepiece(training_sentences(paths, args.json_keys, args.text_mode, args.max_sentences),
                            args.model_prefix, args.vocab_size, args.character_coverage)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.model_prefix}.model and {args.model_prefix}.vocab", file=sys.stderr)


if __name__ == "__main__":
    main()
