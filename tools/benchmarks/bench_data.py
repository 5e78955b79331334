"""Data benchmark: preprocessing throughput and GPT index building, each against a peer.

    python tools/benchmarks/bench_data.py            # full: ~12 MB corpus, 1e9-token index
    python tools/benchmarks/bench_data.py --small    # ~3 MB corpus, 1e8-token index

1. Preprocessing (SentencePiece and GPT-2 BPE, vocab 8000, demo corpus from
   tools/make_demo_corpus.py): megalite's preprocess with 1 and 2 workers (and 2 without
   gigatoken) against the straightforward loop (json.loads + encode + append, one document
   at a time) and against gigatoken's own encode_files with its ids written to a .bin (what
   Megatron-LM's tools/preprocess_data_fast.py does) in the same run, each run a fresh
   process (start-up included); all write byte-identical datasets.
   Targets: >= 3x the loop with 2 workers; no slower than gigatoken's encode_files. Reported as wall-clock and as CPU-time speed-up
   (the loop's CPU seconds over megalite's busiest process's; independent of machine load).
2. Index building for a synthetic dataset (1e9 tokens in 1e7 documents, seq 2048, one epoch):
   megalite's build_gpt_datasets (document, sample and shuffle indices, cache written)
   against the same arrays built by Megatron-Core's GPTDataset steps with its shipped
   compiled helper (megatron.core.datasets.helpers_cpp.build_sample_idx), cache written
   too, each in a fresh process for peak memory; plus the sample-index step alone on
   identical inputs.
   Targets: < 10 s, < 2 GB peak, no slower than Megatron-Core.
Timings are the best of --repeats runs (wall clock); the machine's load average is printed,
as other work on the machine slows both sides.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def preprocessing_section(work, corpus_mb, repeats, vocab_size):
    from bench_data_preprocess import bench_preprocessing, make_tokenizer_files

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import make_demo_corpus

    corpus = os.path.join(work, "corpus.jsonl")
    make_demo_corpus.main(["--output", corpus, "--max-mb", str(corpus_mb)])
    tok_files = make_tokenizer_files(corpus, work, vocab_size)
    rows = bench_preprocessing(corpus, work, tok_files, repeats, log)
    print(f"\nPreprocessing: {rows[0]['corpus_mb']:.1f} MB demo corpus, best of {repeats}")
    print(f"{'tokenizer':14s} {'method':40s} {'seconds':>8s} {'cpu s':>7s} {'busiest':>8s} {'tokens/s':>10s} "
          f"{'MB/s':>6s} {'vs loop':>7s} {'cpu vs loop':>11s}")
    for r in rows:
        print(f"{r['tokenizer']:14s} {r['method']:40s} {r['seconds']:8.2f} {r['cpu_seconds']:7.2f} "
              f"{r['busiest_cpu_seconds']:8.2f} {r['tokens_per_s']:10.0f} {r['mb_per_s']:6.2f} {r['speedup']:6.2f}x "
              f"{r['cpu_speedup']:10.2f}x")
    print("seconds: wall clock; cpu s: all processes; busiest: CPU seconds of the busiest process; vs loop: "
          "wall-clock speed-up; cpu vs loop: the loop's CPU seconds / busiest (the idle-machine estimate)")
    by = {(r["tokenizer"], r["method"]): r["seconds"] for r in rows}
    for name in dict.fromkeys(r["tokenizer"] for r in rows):
        peer = by.get((name, "gigatoken encode_files (2 threads) + .bin"))
        if peer is not None:
            differing = next(r["differing"] for r in rows if r["tokenizer"] == name and r["method"].startswith("giga"))
            print(f"{name}: megalite 2 workers takes {by[(name, 'megalite preprocess, 2 workers')] / peer:.2f}x "
                  f"the wall time of gigatoken encode_files; documents whose ids differ from the tokenizer's: "
                  f"megalite none, gigatoken encode_files {differing}")
    print(f"peak RSS of tools/preprocess_data.py --workers 2 (main process or a worker): "
          f"{rows[-1]['cli_peak_rss_mb']:.0f} MB")
    return rows


def run_child(kind, prefix, num_samples, seq_length, cache=None):
    cmd = [sys.executable, os.path.join(HERE, "bench_data_index.py"), "--child", kind, "--prefix", prefix,
           "--num-samples", str(num_samples), "--seq-length", str(seq_length)]
    if cache:
        cmd += ["--cache", cache]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def index_section(work, num_tokens, num_docs, seq_length, repeats):
    from bench_data_index import write_synthetic_dataset

    prefix = os.path.join(work, "synthetic")
    t0 = time.perf_counter()
    write_synthetic_dataset(prefix, num_docs, num_tokens)
    log(f"wrote synthetic .idx ({num_docs} documents, {num_tokens} tokens) in {time.perf_counter() - t0:.1f} s")
    num_samples = (num_tokens - 1) // seq_length  # one epoch
    best = {}
    for rep in range(repeats):
        for kind in ("ours", "megatron"):
            cache = os.path.join(work, f"cache{rep}")
            shutil.rmtree(cache, ignore_errors=True)
            r = run_child(kind, prefix, num_samples, seq_length, cache)
            log(f"  index build {kind:9s} {r['seconds']:.2f} s, peak RSS {r['peak_rss_mb']:.0f} MB")
            if kind not in best or r["seconds"] < best[kind]["seconds"]:
                best[kind] = r
    assert best["ours"]["digest"] == best["megatron"]["digest"], "megalite and Megatron-Core built different arrays"
    step = run_child("step", prefix, num_samples, seq_length)
    ours, theirs = best["ours"], best["megatron"]
    print(f"\nIndex building: {num_tokens:.0e} tokens, {num_docs:.0e} documents, seq {seq_length}, "
          f"{ours['samples']} samples (one epoch); identical arrays; best of {repeats}")
    print(f"  megalite build_gpt_datasets (incl. cache write)  {ours['seconds']:6.2f} s   peak RSS "
          f"{ours['peak_rss_mb']:6.0f} MB (process start {ours['rss_before_mb']:.0f} MB)")
    print(f"  Megatron-Core GPTDataset steps + helpers_cpp    {theirs['seconds']:6.2f} s   peak RSS "
          f"{theirs['peak_rss_mb']:6.0f} MB (process start {theirs['rss_before_mb']:.0f} MB, torch imported)")
    print(f"  ratio Megatron-Core / megalite: {theirs['seconds'] / ours['seconds']:.2f}x")
    print(f"  sample-index step alone, same (sizes, document index): megalite {step['megalite']:.3f} s, "
          f"helpers_cpp.build_sample_idx {step['megatron_helper']:.3f} s")
    return dict(ours=ours, megatron=theirs, step=step)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="~3 MB corpus and a 1e8-token, 1e6-document index")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--corpus-mb", type=float, help="demo corpus size (default 12, or 3 with --small)")
    p.add_argument("--skip-preprocess", action="store_true")
    p.add_argument("--skip-index", action="store_true")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--json", help="also write the results to this JSON file")
    a = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_data_") as work:
        if not a.skip_preprocess:
            results["preprocessing"] = preprocessing_section(
                work, a.corpus_mb or (3 if a.small else 12), a.repeats, a.vocab_size)
        if not a.skip_index:
            tokens, docs = (10**8, 10**6) if a.small else (10**9, 10**7)
            results["index"] = index_section(work, tokens, docs, 2048, a.repeats)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
