"""Tokenise JSONL, Parquet or text corpora into Megatron indexed datasets (.bin/.idx).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2

writes data/corpus_text_document.bin/.idx (one dataset per --json-keys key), readable by
Megatron-LM and megalite. Input: .jsonl/.json (optionally .gz or .zst; a bare .zst is JSONL),
.parquet (the --json-keys columns, read a row group at a time), plain text (one document per
line, or per file with --text-mode file), directories and globs of any mix of them.

On a cluster, one task per partition (e.g. a Slurm array, scripts/slurm/preprocess_data.sbatch):

    python tools/preprocess_data.py ... --partitions 64 --partition-index $SLURM_ARRAY_TASK_ID
    python tools/merge_datasets.py --input data/corpus-*-of-00064_text_document \
        --output-prefix data/corpus_text_document

each task writing PREFIX-{i}-of-{n}_{key}_document.bin/.idx from its share of the files and
rows; merged in order they are byte for byte what one run over all the input writes.

Where gigatoken is installed (pip install 'megalite[gigatoken]'), SentencePiece, GPT-2 BPE and
Hugging Face tokenizers encode through it once a start-up check shows it gives their own ids
on probe texts and the input's first 64 KB (the first line printed says which path is used
and why); otherwise, and for TikTokenizer, through their own library path. The ids, and so
the output, are the same either way. Bad input stops
with file:line: reason and a non-zero exit unless --skip-bad-lines; nothing is left under the
output names unless the run succeeds (an interrupted or terminated run removes its temporary
files; the next run with the same --output-prefix removes those of a killed one).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.corpus import BadInput  # noqa: E402
from megalite.data.preprocess import PreprocessConfig, Terminated, preprocess  # noqa: E402
from megalite.data.tokenizers import TOKENIZER_TYPES  # noqa: E402


def tokenizer_options(a) -> dict:
    """build_tokenizer's options from Megatron's tokenizer flags (those a type does not use
    stay at their defaults; build_tokenizer refuses --vocab-extra-ids for other types)."""
    options = {"vocab_extra_ids": a.vocab_extra_ids}
    if a.tokenizer_type == "TikTokenizer":
        options.update(tiktoken_pattern=a.tiktoken_pattern or "v2",
                       tiktoken_num_special_tokens=a.tiktoken_num_special_tokens,
                       tiktoken_special_tokens=a.tokenizer_special_tokens)
    return options


def parse_args(argv=None) -> PreprocessConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help="files, directories or globs")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    g.add_argument("--text-mode", choices=["line", "file"], default="line",
                   help="plain-text input: one document per line (default) or per file")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip and count malformed lines instead of stopping at the first")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", help="SentencePiece .model, tokenizer.json or tiktoken file")
    g.add_argument("--vocab-file", help="GPT-2 vocab.json")
    g.add_argument("--merge-file", help="GPT-2 merges.txt")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size; TikTokenizer cap")
    g.add_argument("--vocab-extra-ids", type=int, default=0,
                   help="SentencePieceTokenizer: sentinel tokens <extra_id_i> after the vocabulary")
    g.add_argument("--tiktoken-pattern", choices=["v1", "v2"], help="TikTokenizer pattern (default v2)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: special-token ids before the ranks")
    g.add_argument("--tokenizer-special-tokens", nargs="+", help="TikTokenizer special tokens")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="processes that tokenise (this one included)")
    g.add_argument("--partitions", type=int, default=1,
                   help="cut the input into this many partitions: processed all here (the output does not "
                        "change) or, with --partition-index, one")
    g.add_argument("--partition-index", type=int,
                   help="process only this partition (0-based) and write PREFIX-{i}-of-{n}_{key}_document")
    g.add_argument("--log-interval", type=int, default=1000, help="progress line every N documents")
    a = p.parse_args(argv)
    return PreprocessConfig(
        input=a.input, output_prefix=a.output_prefix, tokenizer_type=a.tokenizer_type,
        json_keys=a.json_keys, tokenizer_model=a.tokenizer_model, vocab_file=a.vocab_file,
        merge_file=a.merge_file, vocab_size=a.vocab_size, tokenizer_options=tokenizer_options(a),
        append_eod=a.append_eod, workers=a.workers, partitions=a.partitions, partition_index=a.partition_index,
        log_interval=a.log_interval, skip_bad_lines=a.skip_bad_lines,
        text_mode=a.text_mode)


def main(argv=None) -> int:
    config = parse_args(argv)
    try:
        summary = preprocess(config)
    except (BadInput, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; no output written", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"error: {e}; no output written", file=sys.stderr)
        return 143
    print(f"{summary['docs']} documents, {summary['tokens']} tokens from {summary['files']} files; "
          f"{summary['empty']} empty documents skipped", file=sys.stderr)
    if summary["tokens_per_document"]:
        print("tokens per document: " + ", ".join(f"{k} {v}" for k, v in summary["tokens_per_document"].items()),
              file=sys.stderr)
    if summary["bad_count"]:
        kinds = "; ".join(f"{count} {kind}" for kind, count in sorted(summary["bad_by_reason"].items()))
        print(f"skipped {summary['bad_count']} bad lines ({kinds}), first: " + "; ".join(summary["bad"]),
              file=sys.stderr)
    for prefix in summary["outputs"]:
        print(f"wrote {prefix}.bin and {prefix}.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
