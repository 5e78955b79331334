"""What each documented command promises, checked on what its toy run left: `check(ws, proc)`
asserts on the workspace's files and the command's output."""

import json
import re
from pathlib import Path

import torch

from tests.docs.workspace import corpus_texts


def _same_files(a: Path, b: Path):
    for ext in (".bin", ".idx"):
        assert Path(f"{a}{ext}").read_bytes() == Path(f"{b}{ext}").read_bytes(), f"{a}{ext} differs from {b}{ext}"


def sentencepiece(vocab_size: int, name: str):
    def check(ws, proc):
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(ws.path(name)))
        assert sp.get_piece_size() == vocab_size
    return check


def tokenised_corpus(prefix: str, tokenizer: str):
    """`prefix` holds every corpus document, each the tokenizer's own ids and the end-of-document id."""
    def check(ws, proc):
        from megalite.data.indexed_dataset import IndexedDataset
        from megalite.data.tokenizers import build_tokenizer

        texts = corpus_texts(ws)
        dataset = IndexedDataset(str(ws.path(prefix)))
        tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(ws.path(tokenizer)))
        assert len(dataset) == len(texts)
        for i in (0, len(texts) // 2, len(texts) - 1):
            assert dataset[i].tolist() == tok.encode(texts[i]) + [tok.eod], i
    return check


def partitions(prefix: str, count: int):
    def check(ws, proc):
        for i in range(count):
            for ext in (".bin", ".idx"):
                assert ws.path(f"{prefix}-{i:05d}-of-{count:05d}_text_document{ext}").is_file(), (i, ext)
    return check


def merged_equals_one_run(merged: str, one: str, *, one_run_command: str | None = None):
    """The merge is byte for byte one run over the same input (the README's promise); with
    `one_run_command`, that run is made here."""
    def check(ws, proc):
        assert re.search(r"merged \d+ datasets", proc.stderr), proc.stderr
        if one_run_command:
            done = ws.shell(one_run_command)
            assert done.returncode == 0, done.stderr
        _same_files(ws.path(merged), ws.path(one))
    return check


def inspected(documents_from: str):
    def check(ws, proc):
        from megalite.data.indexed_dataset import IndexedDataset

        dataset = IndexedDataset(str(ws.path(documents_from)))
        assert re.search(rf"^documents\s+{len(dataset)}$", proc.stdout, re.M), proc.stdout[:500]
        assert [int(n) for n in re.findall(r"^--- document (\d+):", proc.stdout, re.M)] == [0, 1, 2]
        assert corpus_texts(ws)[0][:40] in proc.stdout
    return check


def trained(save: str, iteration: int, metrics: str | None = None):
    """A checkpoint at `iteration` under `save` and, in `metrics`, every iteration up to it logged."""
    def check(ws, proc):
        from megalite.checkpoint.dcp.checkpoint import read_tracker

        assert read_tracker(str(ws.path(save))) == iteration, proc.stdout[-2000:]
        if metrics:
            logged = [json.loads(line) for line in ws.path(metrics).read_text().splitlines()]
            done = {r["iteration"] for r in logged if "split" not in r and r.get("lm_loss") is not None}
            assert set(range(1, iteration + 1)) <= done, sorted(done)
    return check


def logged(metrics: str, iterations, *fields: str):
    """`metrics` logs `iterations` (training, finite loss), each with fields named `fields...`."""
    def check(ws, proc):
        records = [json.loads(line) for line in ws.path(metrics).read_text().splitlines()]
        train = {r["iteration"]: r for r in records if "split" not in r}
        assert set(iterations) <= set(train), sorted(train)
        for i in iterations:
            assert torch.isfinite(torch.tensor(train[i]["lm_loss"])), train[i]
            for f in fields:
                assert any(k.startswith(f) for k in train[i]), (f, sorted(train[i]))
    return check


def printed(*patterns: str):
    def check(ws, proc):
        for pattern in patterns:
            assert re.search(pattern, proc.stdout, re.M), f"{pattern!r} not in:\n{proc.stdout[-3000:]}"
    return check


def hf_round_trip(original: str, exported: str):
    """The exported safetensors hold the original's tensors exactly (HF -> megalite TP2 PP2 -> HF)."""
    def check(ws, proc):
        from safetensors.torch import load_file

        before, after = (load_file(ws.path(d) / "model.safetensors") for d in (original, exported))
        assert sorted(before) == sorted(after)
        for name in before:
            assert torch.equal(before[name], after[name]), name
    return check


def megatron_in_transformers(exported: str):
    """transformers, loading the converted Megatron checkpoint, computes megalite's logits of the
    Megatron weights."""
    def check(ws, proc):
        import transformers

        from megalite.model.gpt import GPTModel
        from tests.checkpoint.megatron_files import CONFIG

        tokens = torch.randint(0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
        reference = GPTModel(CONFIG, init_seed=0).eval()
        model = transformers.AutoModelForCausalLM.from_pretrained(ws.path(exported), dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(tokens).logits, reference(tokens), rtol=1e-4, atol=1e-4)
    return check


def generated(prompt: str):
    def check(ws, proc):
        assert proc.stdout.startswith(prompt), proc.stdout[:300]
        assert len(proc.stdout) > len(prompt) + 8, proc.stdout
    return check


def files(*names: str):
    def check(ws, proc):
        for name in names:
            assert ws.path(name).is_file() and ws.path(name).stat().st_size > 0, name
    return check


def same_bytes(a: str, b: str):
    def check(ws, proc):
        assert ws.path(a).read_bytes() == ws.path(b).read_bytes(), f"{a} differs from {b}"
    return check


def same_weights(a: str, b: str):
    """Two megalite checkpoints (any layouts) hold the same model tensors."""
    def check(ws, proc):
        from megalite.checkpoint.megalite_reader import MegaliteCheckpoint

        first, second = MegaliteCheckpoint(ws.path(a)), MegaliteCheckpoint(ws.path(b))
        names = [k for k in first.keys() if k.startswith("model/")]
        assert names and names == [k for k in second.keys() if k.startswith("model/")]
        for name in names:
            assert torch.equal(first.get(name), second.get(name)), name
    return check


def png(name: str):
    def check(ws, proc):
        assert ws.path(name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    return check


def all_of(*checks):
    def check(ws, proc):
        for c in checks:
            c(ws, proc)
    return check
