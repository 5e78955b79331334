"""Tokenise raw corpora into Megatron indexed datasets, in parallel and in bounded memory.

The input is cut into shards: byte ranges of plain files (aligned to lines by the reader),
runs of Parquet row groups, whole gzip or zstd files, or groups of whole files in
one-document-per-file mode. With --partition-index, only one partition's share of the
input is processed (one task of a cluster job; tools/merge_datasets.py joins the parts). --workers
processes (the main one and forked workers, see shard_pool.py) tokenise shards into their
own small indexed datasets; the main process appends them, in input order, to the output
under a temporary name and deletes them. The output is therefore the same for any number
of workers, memory stays bounded by the shard batch size, and the final names appear only
when everything succeeded.
"""

import contextlib
import functools
import glob
import os
import re
import shutil
import signal
import threading
from dataclasses import dataclass, field

import numpy as np

from megalite.data.corpus import BadInput, expand_inputs
from megalite.data.indexed_dataset import IndexedDatasetWriter, dtype_for_vocab
from megalite.data.preprocess_report import Progress, length_percentiles, reason_kind
from megalite.data.shard_pool import context, ordered_results
from megalite.data.shards import Shard, absolute_line, partition_pieces, plan_shards, read_shard


@dataclass
class PreprocessConfig:
    """What preprocess_data.py's flags describe (Megatron's names)."""

    input: list[str]
    output_prefix: str
    tokenizer_type: str
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    tokenizer_options: dict = field(default_factory=dict)  # build_tokenizer's vocab_extra_ids, tiktoken_*
    append_eod: bool = False
    workers: int = 1
    partitions: int = 1
    partition_index: int | None = None  # process only this partition of `partitions`
    log_interval: int = 1000
    skip_bad_lines: bool = False
    text_mode: str = "line"  # plain text: one document per "line" or per "file"
    batch_bytes: int = 1 << 20  # text handed to the tokenizer at once
    max_shard_bytes: int = 64 << 20
    use_gigatoken: bool = True  # where installed and its ids check out (tests and benchmarks turn it off)


@dataclass
class ShardResult:
    index: int
    docs: int = 0
    empty: int = 0
    tokens: int = 0
    bytes: int = 0
    bad: list = field(default_factory=list)  # (path, first_line_offset, line, reason), first few
    bad_count: int = 0
    bad_by_reason: dict = field(default_factory=dict)
    error: tuple | None = None  # (path, first_line_offset, line, reason)


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def partition_prefix(output_prefix: str, index: int, partitions: int) -> str:
    """PREFIX-{index}-of-{partitions}, zero-padded so that the parts sort in order."""
    return f"{output_prefix}-{index:05d}-of-{partitions:05d}"


class ShardWorker:
    """Tokenises shards; one per process (built once, as the tokenizer is, and inherited by
    forked workers)."""

    def __init__(self, config: PreprocessConfig, tmp_dir: str, progress=None, report=None, gigatoken=False):
        from megalite.data.tokenizers import build_tokenizer

        self.config = config
        self.tmp_dir = tmp_dir
        self.progress = progress  # shared [docs, bytes, tokens] counters
        self.report = report  # called with the counters after each batch, in this process only
        self.owner = os.getpid()
        self.tokenizer = build_tokenizer(
            config.tokenizer_type, tokenizer_model=config.tokenizer_model, vocab_file=config.vocab_file,
            merge_file=config.merge_file, vocab_size=config.vocab_size, **config.tokenizer_options)
        self.dtype = np.dtype(dtype_for_vocab(self.tokenizer.vocab_size))
        self.eod_bytes = np.array([self.tokenizer.eod], np.int32).tobytes()
        self.encoder = self.tokenizer  # what encode_batch_bytes goes through
        self.gigatoken = False
        if gigatoken:  # a spawned worker: the caller checked gigatoken's ids already
            encoder, why = self._gigatoken_encoder([])
            if encoder is None:
                raise RuntimeError(f"a preprocessing worker could not use gigatoken as the main process did: {why}")
            self.encoder, self.gigatoken = encoder, True

    def _gigatoken_encoder(self, sample):
        from megalite.data.gigatoken_encoder import gigatoken_encoder

        cfg = self.config
        return gigatoken_encoder(self.tokenizer, cfg.tokenizer_type, tokenizer_model=cfg.tokenizer_model,
                                 vocab_file=cfg.vocab_file, merge_file=cfg.merge_file, sample=sample)

    def choose_encoder(self, sample: list[str]) -> str | None:
        """Encode through gigatoken if allowed, installed and giving the tokenizer's ids on
        the probe texts and `sample`; return a line saying which path is used and why (None
        for the NullTokenizer, which has one path)."""
        if self.config.tokenizer_type == "NullTokenizer":
            return None
        why = "gigatoken is turned off"
        if self.config.use_gigatoken:
            encoder, why = self._gigatoken_encoder(sample)
            if encoder is not None:
                self.encoder, self.gigatoken = encoder, True
                return f"tokenising with {why}"
        return f"tokenising with {self.config.tokenizer_type}'s own library path ({why})"

    def shard_prefix(self, index: int, key: str) -> str:
        return os.path.join(self.tmp_dir, f"shard{index:06d}_{key}")

    def run(self, shard: Shard) -> ShardResult:
        cfg = self.config
        result = ShardResult(shard.index)
        writers = [IndexedDatasetWriter(self.shard_prefix(shard.index, k), self.dtype) for k in cfg.json_keys]
        batch: list[tuple] = []  # (texts, where) per document
        batch_size = 0
        try:
            for item in read_shard(shard, cfg.json_keys, cfg.text_mode):
                if isinstance(item, BadInput):
                    self._bad(result, (item.path, item.first_line_offset, item.line, item.reason), item.fatal)
                else:
                    texts, nbytes, where = item
                    batch.append((texts, where))
                    batch_size += nbytes
                    if batch_size >= cfg.batch_bytes:
                        self._flush(batch, batch_size, writers, result)
                        batch, batch_size = [], 0
                if result.error is not None:
                    break
            if result.error is None:
                self._flush(batch, batch_size, writers, result)
            for w in writers:
                if result.error is None:
                    w.finalize()
                else:
                    w.abort()
        except BaseException:
            for w in writers:
                w.abort()
            raise
        return result

    def _bad(self, result: ShardResult, where: tuple, fatal: bool = False) -> None:
        """Record a bad document: the shard's error, or one more skipped line."""
        if fatal or not self.config.skip_bad_lines:
            result.error = where
            return
        result.bad_count += 1
        kind = reason_kind(where[3])
        result.bad_by_reason[kind] = result.bad_by_reason.get(kind, 0) + 1
        if len(result.bad) < 5:
            result.bad.append(where)

    def _encode(self, batch, result) -> list[list[bytes | None]] | None:
        """Token bytes per key per document. If the tokenizer refuses the batch (the
        NullTokenizer does, on a non-integer), documents go one at a time so that the bad
        one is reported by file and line; skipped ones are None (counted as bad lines, not
        as empty documents)."""
        keys = range(len(self.config.json_keys))
        try:
            return [self.encoder.encode_batch_bytes([texts[k] for texts, _ in batch]) for k in keys]
        except (ValueError, TypeError):
            pass
        per_doc = []
        for texts, (path, first_line_offset, line) in batch:
            try:
                per_doc.append([self.encoder.encode_batch_bytes([texts[k]])[0] for k in keys])
            except (ValueError, TypeError) as e:
                self._bad(result, (path, first_line_offset, line, f"tokenizer refused the text: {e}"))
                if result.error is not None:
                    return None
                per_doc.append([None for _ in keys])
        return [list(column) for column in zip(*per_doc)]

    def _flush(self, batch, nbytes, writers, result):
        if not batch:
            return
        tokens_before = result.tokens
        encoded_keys = self._encode(batch, result)
        if encoded_keys is None:
            return
        for k, (writer, encoded) in enumerate(zip(writers, encoded_keys)):
            kept = [b for b in encoded if b]
            result.empty += encoded.count(b"")
            if k == 0:
                result.docs += len(kept)
            if not kept:
                continue
            if self.config.append_eod:  # one join puts eod after every document
                ids = np.frombuffer(self.eod_bytes.join(kept + [b""]), np.int32)
                lengths = [len(b) // 4 + 1 for b in kept]
            else:
                ids = np.frombuffer(b"".join(kept), np.int32)
                lengths = [len(b) // 4 for b in kept]
            result.tokens += len(ids)
            writer.add_documents(ids.astype(self.dtype, copy=False), lengths)
        result.bytes += nbytes
        if self.progress is not None:
            with self.progress.get_lock():
                self.progress[0] += len(batch)
                self.progress[1] += nbytes
                self.progress[2] += result.tokens - tokens_before
            if self.report is not None and os.getpid() == self.owner:
                self.report(*self.progress[:])


def preprocess(config: PreprocessConfig, stream=None) -> dict:
    """Run preprocessing; return a summary dict. Raises BadInput (first bad line in input
    order) unless skip_bad_lines, ValueError for bad flags, Terminated on SIGTERM; no final
    output exists then, nor any temporary file (after a SIGKILL, the next run with the same
    --output-prefix removes the leftovers)."""
    if config.text_mode not in ("line", "file"):
        raise ValueError(f"--text-mode must be 'line' or 'file', got {config.text_mode!r}")
    if config.workers < 1 or config.partitions < 1:
        raise ValueError("--workers and --partitions must be at least 1")
    base = config.output_prefix
    if config.partition_index is not None:  # its own names, temporary ones too: tasks share a file system
        if not 0 <= config.partition_index < config.partitions:
            raise ValueError(f"--partition-index {config.partition_index} is not in [0, --partitions "
                             f"{config.partitions})")
        base = partition_prefix(base, config.partition_index, config.partitions)
    outputs = [output_prefix_for(base, k) for k in config.json_keys]
    paths = expand_inputs(config.input)
    prefix = os.path.abspath(base)
    if not os.path.isdir(os.path.dirname(prefix)):
        raise ValueError(f"--output-prefix {config.output_prefix}: directory {os.path.dirname(prefix)} "
                         "does not exist")
    progress = Progress(config.log_interval, stream)
    for leftover in remove_leftovers(prefix, [os.path.abspath(out) for out in outputs]):
        print(f"removed {leftover}, left by a preprocessing run that was killed", file=progress.stream)
    row_group_sizes = {}
    pieces = partition_pieces(paths, config.text_mode, config.partitions, config.partition_index, row_group_sizes)
    shards = plan_shards(pieces, config.text_mode, config.workers,
                         1 if config.partition_index is not None else config.partitions,
                         config.max_shard_bytes, row_group_sizes)
    tmp_dir = f"{prefix}.tmp-{os.getpid()}-shards"
    summary = dict(docs=0, empty=0, tokens=0, bytes=0, bad_count=0, bad=[], bad_by_reason={},
                   files=len({piece[0] for piece in pieces}))
    writers = []
    with terminate_raises():
        os.makedirs(tmp_dir)
        try:
            counters = context().Array("q", 3)  # documents, bytes, tokens done, over all processes
            # built here first, so that tokenizer errors surface before any worker starts
            worker = ShardWorker(config, tmp_dir, counters, progress.update)
            if (line := worker.choose_encoder(input_sample(shards, config))) is not None:
                print(line, file=progress.stream, flush=True)
            writers = [IndexedDatasetWriter(out, worker.dtype) for out in outputs]
            # closed (its workers stopped) before tmp_dir is removed, however the loop ends
            with contextlib.closing(ordered_results(
                    worker, shards, config.workers,
                    functools.partial(ShardWorker, config, tmp_dir, counters, gigatoken=worker.gigatoken),
                    lambda: progress.update(*counters[:]))) as results:
                for result in results:
                    if result.error is not None:
                        raise _located(result.error)
                    for key, writer in zip(config.json_keys, writers):
                        shard_prefix = worker.shard_prefix(result.index, key)
                        writer.add_dataset(shard_prefix)
                        for ext in (".bin", ".idx"):
                            os.remove(shard_prefix + ext)
                    for key in ("docs", "empty", "tokens", "bytes", "bad_count"):
                        summary[key] += getattr(result, key)
                    summary["bad"].extend(str(_located(b)) for b in result.bad)
                    for kind, count in result.bad_by_reason.items():
                        summary["bad_by_reason"][kind] = summary["bad_by_reason"].get(kind, 0) + count
            for writer in writers:
                writer.finalize()
        except BaseException:
            for writer in writers:
                writer.abort()
            raise
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    summary["bad"] = summary["bad"][:5]
    summary["outputs"] = outputs
    summary["tokens_per_document"] = length_percentiles(outputs[0]) if outputs else {}
    print(progress.line(summary["docs"], summary["bytes"], summary["tokens"], final=True),
          file=progress.stream, flush=True)
    return summary


def input_sample(shards: list[Shard], config: PreprocessConfig) -> list[str]:
    """The first documents of the input (about 64 KB), for checking gigatoken's ids."""
    from megalite.data.gigatoken_encoder import sample_documents

    if not shards or not config.use_gigatoken or config.tokenizer_type == "NullTokenizer":
        return []
    items = read_shard(shards[0], config.json_keys, config.text_mode)
    with contextlib.closing(items):
        return sample_documents(item[0] for item in items if not isinstance(item, BadInput))


class Terminated(BaseException):
    """SIGTERM arrived (a BaseException, like KeyboardInterrupt, so that cleanup runs)."""


@contextlib.contextmanager
def terminate_raises():
    """Within: SIGTERM raises Terminated (in the main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(f"stopped by {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def remove_leftovers(prefix: str, outputs: list[str]) -> list[str]:
    """Delete the temporary files and shard directories that earlier runs with this output
    prefix (writing `outputs`) left when killed (their process no longer exists); return
    their paths."""
    patterns = [f"{glob.escape(prefix)}.tmp-*-shards"]
    for out in outputs:
        out = glob.escape(out)
        patterns += [f"{out}.bin.tmp-*", f"{out}.idx.tmp-*"]
    removed = []
    for path in sorted(p for pattern in patterns for p in glob.glob(pattern)):
        match = re.search(r"\.tmp-(\d+)(-shards)?$", path)
        if match is None or _process_exists(int(match.group(1))):
            continue
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        removed.append(path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _located(where) -> BadInput:
    """A worker's (path, first_line_offset, line-in-shard, reason) as a BadInput with the
    line number counted from the start of the file."""
    path, first_line_offset, line, reason = where
    return BadInput(path, absolute_line(path, first_line_offset, line), reason)
