"""Concatenate Megatron indexed datasets (.bin/.idx) into one, in order.

    python tools/merge_datasets.py --input 'data/corpus-*-of-00064_text_document' \
        --output-prefix data/corpus_text_document

--input takes dataset prefixes (a name ending in .bin or .idx counts as its prefix, so a
shell glob over both files works), a directory whose datasets are merged in sorted order (as
Megatron-LM's tool does), or a glob over prefixes, which the tool expands itself: no file is
named like a prefix, so a shell passes such a pattern on unexpanded (zsh, or bash with
failglob, refuse it: quote it). A glob's datasets are merged in partition order (numbers
compared as numbers); when they are the parts PREFIX-{i}-of-{n}_{key}_document of a
partitioned tools/preprocess_data.py run, all n must be there, and merged they are byte for
byte what one run over all the input writes. Datasets of different dtypes (or text and
multimodal indices) are refused, naming them; nothing appears under the output names unless
the merge succeeds.
"""

import argparse
import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.indexed_dataset import IndexedDataset, merge_datasets  # noqa: E402

PARTITION = re.compile(r"^(?P<stem>.*)-(?P<index>\d+)-of-(?P<count>\d+)(?P<key>_[^/]*)?$")


def partition_order(prefix: str) -> list:
    """Sort key: digit runs compared as numbers, so part 10 follows part 9 however it is padded."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", prefix)]


def missing_partitions(pattern: str, prefixes: list[str]) -> None:
    """ValueError when `prefixes` are parts PREFIX-{i}-of-{n}_{key} of partitioned runs and a
    part of one of those runs is not among them (an array task that has not finished, say)."""
    runs: dict = {}
    for prefix in prefixes:
        m = PARTITION.match(prefix)
        if m is None:
            return
        run = (m["stem"], int(m["count"]), m["key"] or "")
        runs.setdefault(run, set()).add(int(m["index"]))
    for (stem, count, key), found in runs.items():
        absent = sorted(set(range(count)) - found)
        if absent:
            shown = ", ".join(map(str, absent[:8])) + (f" and {len(absent) - 8} more" if len(absent) > 8 else "")
            raise ValueError(f"--input {pattern}: {len(absent)} of the {count} partitions of {stem}{key} "
                             f"are missing (index {shown}); merged, the dataset would not be the whole corpus")


def expand_glob(pattern: str) -> list[str]:
    """The dataset prefixes whose .bin or .idx files `pattern` (a glob over prefixes) matches,
    in partition order."""
    found = {name[:-4] for ext in (".bin", ".idx") for name in glob.glob(pattern + ext)}
    if not found:
        raise ValueError(f"--input {pattern}: matches no dataset ({pattern}.bin / .idx)")
    prefixes = sorted(found, key=partition_order)
    missing_partitions(pattern, prefixes)
    return prefixes


def dataset_prefixes(inputs: list[str]) -> list[str]:
    """The prefixes `inputs` name, in order, each once; a directory gives its datasets sorted,
    a glob its matches in partition order."""
    prefixes: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            names = sorted({os.path.splitext(n)[0] for n in os.listdir(item) if n.endswith((".bin", ".idx"))})
            if not names:
                raise ValueError(f"--input {item}: directory holds no .bin/.idx datasets")
            found = [os.path.join(item, n) for n in names]
        else:
            prefix = item[:-4] if item.endswith((".bin", ".idx")) else item
            literal = any(os.path.exists(prefix + ext) for ext in (".bin", ".idx"))
            found = expand_glob(prefix) if re.search(r"[*?[]", prefix) and not literal else [prefix]
        prefixes.extend(p for p in found if p not in prefixes)
    return prefixes


def check_mergeable(prefixes: list[str]) -> None:
    """ValueError naming the first dataset whose dtype (or index kind) differs from the first's."""
    first = IndexedDataset(prefixes[0])
    first_kind = "multimodal" if first.sequence_modes is not None else "text"
    for prefix in prefixes[1:]:
        other = IndexedDataset(prefix)
        if other.dtype != first.dtype:
            raise ValueError(f"cannot merge datasets of different dtypes: {prefixes[0]} holds {first.dtype}, "
                             f"{prefix} holds {other.dtype}")
        kind = "multimodal" if other.sequence_modes is not None else "text"
        if kind != first_kind:
            raise ValueError(f"cannot merge a {first_kind} index ({prefixes[0]}) with a {kind} one ({prefix})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="dataset prefixes (or .bin/.idx names), globs over prefixes, or a directory")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx")
    a = p.parse_args(argv)
    try:
        prefixes = dataset_prefixes(a.input)
        out = os.path.abspath(a.output_prefix)
        if not os.path.isdir(os.path.dirname(out)):
            raise ValueError(f"--output-prefix {a.output_prefix}: directory {os.path.dirname(out)} does not exist")
        if out in {os.path.abspath(x) for x in prefixes}:
            raise ValueError(f"--output-prefix {a.output_prefix} is also an input")
        check_mergeable(prefixes)
        merge_datasets(a.output_prefix, prefixes)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    merged = IndexedDataset(a.output_prefix)
    print(f"merged {len(prefixes)} datasets: {len(merged)} documents, {merged.num_tokens} tokens "
          f"({merged.dtype}) into {a.output_prefix}.bin/.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
