"""Preprocessing half of bench_data.py: megalite's preprocess against the straightforward loop
and against gigatoken's own encode_files.

    python tools/benchmarks/bench_data_preprocess.py --compare 200 [--rounds 3]

compares megalite (2 workers) with gigatoken's encode_files (2 threads) alone on a corpus of
about 200 MB (the demo corpus repeated), GPT-2 BPE, alternating which runs first.

Every timed run is a fresh process (`python bench_data_preprocess.py --run METHOD ...`), so
no run inherits another's warm caches, heap or threads; the times include interpreter start
and imports on both sides, and CPU time includes worker processes.

Wall-clock speed-ups depend on what else the machine runs. The CPU-time speed-up does not:
the loop's CPU seconds over the CPU seconds of megalite's busiest process (the main process,
or a worker's average share). With a free core per process that busiest process sets the
wall time (the main process starts first and merges the shards), so it estimates the
wall-clock speed-up on an idle machine.

The straightforward loop is what a first preprocessing script does, one document at a
time: json.loads, the tokenizer library's plain encode, append eod, write the document.
"Plain encode" is SentencePiece's own `encode` and, for GPT-2 BPE, regex pre-tokenisation
then BPE per pre-token with a per-pre-token cache (Megatron's GPT-2 algorithm). Both paths
write byte-identical datasets, which the benchmark checks.

The gigatoken peer is what Megatron-LM's tools/preprocess_data_fast.py does: gigatoken's
Tokenizer.encode_files over the JSONL file (Rust reads, parses and encodes on its thread
pool, here 2 threads on the 2 cores), then the ids with eod appended written as .bin/.idx.
Its "busiest" CPU time is its CPU time over its 2 threads. megalite runs with gigatoken
(where installed: per-worker, ids checked at start-up) and with the library path alone.
"""

import json
import os
import resource
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megalite.data.indexed_dataset import IndexedDatasetWriter, dtype_for_vocab  # noqa: E402
from megalite.data.preprocess import PreprocessConfig, output_prefix_for, preprocess  # noqa: E402
from megalite.data.tokenizers import build_tokenizer  # noqa: E402


def make_tokenizer_files(corpus: str, work: str, vocab_size: int) -> dict:
    """Train a SentencePiece BPE model (tools/train_tokenizer.py) and a GPT-2 byte-level BPE
    (the `tokenizers` library) on the corpus; return build_tokenizer arguments for each."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import train_tokenizer

    sp_prefix = os.path.join(work, "sp")
    train_tokenizer.main(["--input", corpus, "--vocab-size", str(vocab_size), "--model-prefix", sp_prefix])
    return {"SentencePiece": dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_prefix + ".model"),
            "GPT-2 BPE": train_gpt2_bpe(corpus, work, vocab_size)}


def train_gpt2_bpe(corpus: str, work: str, vocab_size: int) -> dict:
    """build_tokenizer arguments of a GPT-2 byte-level BPE trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    gpt2_dir = os.path.join(work, "gpt2")
    os.makedirs(gpt2_dir, exist_ok=True)
    vocab, merges = tok.model.save(gpt2_dir)
    return dict(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)


def cpu_times() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its finished children (worker pools)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def straightforward_loop(corpus: str, prefix: str, tokenizer, encode) -> None:
    """json.loads + encode + append eod + write, one document at a time."""
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    with IndexedDatasetWriter(prefix, dtype) as writer, open(corpus, encoding="utf-8") as f:
        for line in f:
            ids = encode(json.loads(line)["text"])
            if ids:
                ids.append(tokenizer.eod)
                writer.add_document(np.array(ids, dtype=dtype))


def run_megalite(corpus: str, prefix: str, tok_args: dict, workers: int, use_gigatoken: bool = True) -> None:
    config = PreprocessConfig(input=[corpus], output_prefix=prefix, append_eod=True, workers=workers,
                              log_interval=10**9, use_gigatoken=use_gigatoken, **tok_args)
    with open(os.devnull, "w") as quiet:
        preprocess(config, stream=quiet)


def run_gigatoken_files(corpus: str, prefix: str, tok_args: dict) -> None:
    """gigatoken's encode_files over the file, then the ids (eod after each non-empty
    document, as megalite writes) as an indexed dataset."""
    import gigatoken

    from megalite.data.gigatoken_encoder import _build

    args = {k: v for k, v in tok_args.items() if k != "tokenizer_type"}
    tokenizer = build_tokenizer(tok_args["tokenizer_type"], **args)  # for eod and the vocabulary size
    gt = _build(gigatoken, tok_args["tokenizer_type"], args.get("tokenizer_model"), args.get("vocab_file"),
                args.get("merge_file"))
    layout = gt.encode_files(gigatoken.JsonlFileSource([corpus], "text")).layout
    offsets = np.asarray(layout.offsets.data)
    flat = np.asarray(layout.content.data)[offsets[0]:offsets[-1]]
    lengths = np.diff(offsets)
    lengths = lengths[lengths > 0] + 1
    ends = np.cumsum(lengths)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype)
    is_eod = np.zeros(len(out), bool)
    is_eod[ends - 1] = True
    out[is_eod] = tokenizer.eod
    out[~is_eod] = flat
    with IndexedDatasetWriter(prefix, dtype) as writer:
        writer.add_documents(out.tobytes(), lengths.tolist())


def run_method(method: str, corpus: str, prefix: str, tok_args: dict) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds incl. workers, CPU seconds of the busiest process) of one
    method in a fresh process."""
    import subprocess

    cpu0, t0 = sum(cpu_times()), time.perf_counter()
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--run", method, "--corpus", corpus,
                          "--prefix", prefix, "--tokenizer", json.dumps(tok_args)], check=True, capture_output=True,
                         text=True)
    seconds, cpu = time.perf_counter() - t0, sum(cpu_times()) - cpu0
    own = json.loads(out.stdout.strip().splitlines()[-1])
    workers = int(method[-1]) if method.startswith("megalite") else 1
    busiest = max(own["main"], own["workers"] / (workers - 1)) if workers > 1 else own["main"]
    if method == "gigatoken-files":
        busiest = own["main"] / GIGATOKEN_THREADS
    return seconds, cpu, busiest


GIGATOKEN_THREADS = 2
METHODS = {
    "loop-library": "straightforward loop (library encode)",
    "loop-megalite": "straightforward loop (megalite encode)",
    "megalite-library-2": "megalite preprocess, 2 workers, no gigatoken",
    "megalite-1": "megalite preprocess, 1 worker",
    "megalite-2": "megalite preprocess, 2 workers",
    "gigatoken-files": "gigatoken encode_files (2 threads) + .bin",
}


def available_methods() -> dict:
    """METHODS, less those that need gigatoken when it is not installed."""
    from megalite.data.gigatoken_encoder import gigatoken_module

    if gigatoken_module() is not None:
        return dict(METHODS)
    return {k: v for k, v in METHODS.items() if k not in ("gigatoken-files", "megalite-library-2")}


def cli_peak_rss_mb(corpus: str, work: str, tok_files: dict) -> float:
    """Peak RSS of tools/preprocess_data.py --workers 2 (the process or any worker), each
    tokenizer once. Call before this process has other children: RUSAGE_CHILDREN keeps the
    maximum over every child and grandchild waited for."""
    import subprocess

    for tok_args in tok_files.values():
        flags = [x for k, v in tok_args.items() for x in ("--" + k.replace("_", "-"), v)]
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", corpus,
                        "--output-prefix", os.path.join(work, "cli"), "--append-eod", "--workers", "2", *flags],
                       check=True, capture_output=True)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def bench_preprocessing(corpus: str, work: str, tok_files: dict, repeats: int, log) -> list[dict]:
    """Rows of (tokenizer, method, seconds, cpu seconds, tokens/s, MB/s, speed-up vs loop)."""
    size = os.path.getsize(corpus)
    peak_rss = cli_peak_rss_mb(corpus, work, tok_files)
    rows = []
    for name, tok_args in tok_files.items():
        methods = available_methods()
        best = {m: (float("inf"), float("inf"), float("inf")) for m in methods.values()}
        outputs = {}
        for rep in range(repeats):
            for key, method in methods.items():
                prefix = os.path.join(work, f"out_{key}_{rep}")
                seconds, cpu, busiest = run_method(key, corpus, prefix, tok_args)
                outputs[method] = output_prefix_for(prefix, "text") if key.startswith("megalite") else prefix
                best[method] = tuple(min(a, b) for a, b in zip(best[method], (seconds, cpu, busiest)))
                log(f"  {name:13s} {method:40s} {seconds:7.2f} s (cpu {cpu:.2f} s, busiest process {busiest:.2f} s)")
        reference = outputs["straightforward loop (library encode)"]
        differing = {}
        for method, final in outputs.items():
            if method == METHODS["gigatoken-files"]:  # counted, not asserted: see differing_documents
                differing[method] = differing_documents(reference, final)
                log(f"  {name}: {method} differs from the tokenizer's own ids in {differing[method]}")
                continue
            for ext in (".bin", ".idx"):
                with open(reference + ext, "rb") as a, open(final + ext, "rb") as b:
                    assert a.read() == b.read(), f"{method} wrote a different dataset than the loop"
        tokens = int(np.fromfile(reference + ".idx", np.int32, count=_count(reference), offset=34).sum())
        base, _, base_cpu = best["straightforward loop (library encode)"]
        for method, (seconds, cpu, busiest) in best.items():
            rows.append(dict(tokenizer=name, method=method, seconds=seconds, cpu_seconds=cpu, busiest_cpu_seconds=busiest,
                             cli_peak_rss_mb=peak_rss, tokens_per_s=tokens / seconds, mb_per_s=size / seconds / 1e6,
                             speedup=base / seconds, cpu_speedup=base_cpu / busiest, tokens=tokens,
                             corpus_mb=size / 1e6, differing=differing.get(method, "none")))
    return rows


def differing_documents(reference: str, other: str) -> str:
    """'none' or 'N of M documents (first: document i)': gigatoken reads SentencePiece's
    control tokens (<s>, </s>) in text as those tokens, SentencePiece (and Megatron, and
    megalite) as text, so a document holding '<s>' gets other ids from encode_files."""
    from megalite.data.indexed_dataset import IndexedDataset

    a, b = IndexedDataset(reference), IndexedDataset(other)
    if len(a) != len(b):
        return f"the number of documents ({len(b)} vs {len(a)})"
    bad = [i for i in range(len(a)) if not np.array_equal(a[i], b[i])]
    return f"{len(bad)} of {len(a)} documents (first: document {bad[0]})" if bad else "none"


def _loop(corpus, prefix, tok_args, reference: bool):
    args = {k: v for k, v in tok_args.items() if k != "tokenizer_type"}
    tokenizer = build_tokenizer(tok_args["tokenizer_type"], **args)
    straightforward_loop(corpus, prefix, tokenizer, tokenizer.encode_reference if reference else tokenizer.encode)


def _count(prefix: str) -> int:
    with open(prefix + ".idx", "rb") as f:
        header = f.read(34)
    return int(np.frombuffer(header[18:26], np.uint64)[0])


def repeated_corpus(demo: str, output: str, megabytes: float) -> int:
    """Write `demo` whole, as many times as it takes to reach `megabytes` (the demo corpus
    stops at about 12 MB, where the standard library runs out); return the repeats. The
    repeats make tokenizers' caches hit more often than a real corpus of that size does,
    on both sides of a comparison."""
    with open(demo, "rb") as f:
        data = f.read()
    repeats = max(1, -(-int(megabytes * 1e6) // len(data)))
    with open(output, "wb") as f:
        for _ in range(repeats):
            f.write(data)
    return repeats


def compare_with_gigatoken(work: str, megabytes: float, rounds: int, vocab_size: int) -> list[tuple]:
    """megalite preprocess (2 workers) against gigatoken encode_files (2 threads) on the demo
    corpus repeated to `megabytes`, GPT-2 BPE trained on the demo corpus: `rounds` rounds,
    each both methods in fresh processes, the first one alternating; prints each run with
    the load average before it, then the best of each and their ratio. Returns the runs."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import make_demo_corpus

    demo, corpus = os.path.join(work, "demo.jsonl"), os.path.join(work, "corpus.jsonl")
    make_demo_corpus.main(["--output", demo, "--max-mb", str(megabytes)])
    repeats = repeated_corpus(demo, corpus, megabytes)
    tok_args = train_gpt2_bpe(demo, work, vocab_size)
    size = os.path.getsize(corpus)
    print(f"{size / 1e6:.1f} MB: the {os.path.getsize(demo) / 1e6:.1f} MB demo corpus x {repeats}; GPT-2 BPE, "
          f"vocab {vocab_size}; {os.cpu_count()} CPUs", flush=True)
    runs, pair = [], ["megalite-2", "gigatoken-files"]
    for r in range(rounds):
        for method in pair if r % 2 == 0 else pair[::-1]:
            load = os.getloadavg()[0]
            seconds, cpu, busiest = run_method(method, corpus, os.path.join(work, method), tok_args)
            runs.append((method, load, seconds, cpu, busiest))
            print(f"round {r + 1} {method:16s} load {load:5.2f} {seconds:7.2f} s {size / seconds / 1e6:7.1f} MB/s "
                  f"(cpu {cpu:.2f} s, busiest process {busiest:.2f} s)", flush=True)
    ours = output_prefix_for(os.path.join(work, "megalite-2"), "text")
    for ext in (".bin", ".idx"):
        with open(ours + ext, "rb") as a, open(os.path.join(work, "gigatoken-files") + ext, "rb") as b:
            assert a.read() == b.read(), f"megalite and gigatoken wrote different {ext} files"
    best = {m: min(run[2] for run in runs if run[0] == m) for m in pair}
    busiest = {m: min(run[4] for run in runs if run[0] == m) for m in pair}
    print(f"best of {rounds}: megalite {size / best[pair[0]] / 1e6:.1f} MB/s, gigatoken "
          f"{size / best[pair[1]] / 1e6:.1f} MB/s; megalite takes {best[pair[0]] / best[pair[1]]:.2f}x gigatoken's "
          f"wall time ({busiest[pair[0]] / busiest[pair[1]]:.2f}x its busiest-process CPU time); outputs identical")
    return runs


def main():
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description="one timed preprocessing run (used by bench_data.py), or --compare")
    p.add_argument("--run", choices=sorted(METHODS))
    p.add_argument("--corpus")
    p.add_argument("--prefix")
    p.add_argument("--tokenizer", help="build_tokenizer arguments as JSON")
    p.add_argument("--compare", type=float, metavar="MB",
                   help="compare megalite (2 workers) with gigatoken encode_files on a corpus of MB megabytes")
    p.add_argument("--rounds", type=int, default=3, help="--compare: rounds (the first method alternates)")
    p.add_argument("--vocab-size", type=int, default=8000, help="--compare: GPT-2 BPE vocabulary")
    a = p.parse_args()
    if a.compare is not None:
        if available_methods().keys() != METHODS.keys():
            p.error("--compare needs gigatoken (pip install 'megalite[gigatoken]')")
        with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as work:
            compare_with_gigatoken(work, a.compare, a.rounds, a.vocab_size)
        return
    missing = [flag for flag in ("run", "corpus", "prefix", "tokenizer") if getattr(a, flag) is None]
    if missing:
        p.error("--run needs --corpus, --prefix and --tokenizer; missing: " + ", ".join("--" + m for m in missing))
    tok_args = json.loads(a.tokenizer)
    if a.run.startswith("loop"):
        _loop(a.corpus, a.prefix, tok_args, reference=a.run == "loop-library")
    elif a.run == "gigatoken-files":
        os.environ["RAYON_NUM_THREADS"] = str(GIGATOKEN_THREADS)  # before gigatoken builds its pool
        run_gigatoken_files(a.corpus, a.prefix, tok_args)
    else:
        run_megalite(a.corpus, a.prefix, tok_args, int(a.run[-1]), use_gigatoken="library" not in a.run)
    main_cpu, workers_cpu = cpu_times()
    print(json.dumps({"main": main_cpu, "workers": workers_cpu}))


if __name__ == "__main__":
    main()
