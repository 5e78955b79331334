"""Checkpoints: resharding across TP/PP/DP layouts, atomic publication, refusal of damaged,
mismatched or malicious checkpoints."""

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
from megalite.checkpoint.publish import ConversionError
from megalite.model.gpt import GPTModel
from megalite.model.pipeline_chunks import build_model_chunks
from megalite.model.weights import gather_full_weights
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.checkpoint.dcp.format import CheckpointError, file_digest, tp_chunks
from megalite.checkpoint.dcp.checkpoint import TRACKER, iteration_dir, load_checkpoint, read_tracker, save_checkpoint
from tests.distributed import run_distributed
from tests.model.test_gpt_tp import make_config


def _chunks(config, state, seed):
    """This rank's model chunks (virtual pipeline stages included)."""
    return build_model_chunks(config, state, init_seed=seed)


def _full(chunks):
    out = {}
    for chunk in chunks:
        out.update(gather_full_weights(chunk))
    return out


LOAD_LAYOUTS = ((1, 1, 1), (4, 1, 1), (2, 2, 1), (1, 2, 2))  # (TP, PP, virtual stages)


def _reshard_worker(rank, world_size, root):
    """Save at TP=2 PP=2 DP=1, then load at TP=1 DP=4, TP=4 and TP=2 PP=2 in the same processes."""
    out = {}
    for family in ("gpt2", "llama"):
        config = make_config(family, num_layers=4)
        state = ParallelState.create(ParallelLayout(world_size, tensor=2, pipeline=2))
        chunks = _chunks(config, state, seed=11)
        save_checkpoint(f"{root}/{family}", 5, chunks=chunks, optimizer=None, pstate=state, common={"note": "x"})
        out[(family, "saved")] = _full(chunks)
        for tp, pp, vp in LOAD_LAYOUTS:
            state = ParallelState.create(ParallelLayout(world_size, tensor=tp, pipeline=pp, virtual_pipeline=vp))
            chunks = _chunks(config, state, seed=99)  # a different initialisation, overwritten by the load
            common = load_checkpoint(f"{root}/{family}", chunks=chunks, pstate=state)
            out[(family, tp, pp, vp)] = {"common": common, "full": _full(chunks)}
    return out


def _vocab_rows(name, t, vocab):
    return t[:vocab] if "word_embeddings" in name or "output_layer" in name else t


@pytest.fixture(scope="module")
def reshard_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    return root, run_distributed(_reshard_worker, 4, str(root))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_reshards_tp2_pp2_dp1_to_other_tp_pp_vp_dp(reshard_results, family):
    root, results = reshard_results
    reference = {**results[0][(family, "saved")], **results[2][(family, "saved")]}  # stages 0 and 1
    assert read_tracker(root / family) == 5 and (iteration_dir(root / family, 5) / "common.json").exists()
    vocab = make_config(family).vocab_size
    for tp, pp, vp in LOAD_LAYOUTS:
        got = {}
        for r in results:
            got.update(r[(family, tp, pp, vp)]["full"])
        assert set(got) == set(reference)
        for name, tensor in reference.items():
            assert torch.equal(_vocab_rows(name, got[name], vocab), _vocab_rows(name, tensor, vocab)), \
                f"{family}: {name} differs after loading at TP={tp} PP={pp} VP={vp}"
        common = results[0][(family, tp, pp, vp)]["common"]
        assert common["note"] == "x" and common["iteration"] == 5


def test_chunks_of_stride_two_and_trimmed_vocabulary():
    # fc1 of SwiGLU at TP=2: rank 0 holds gate rows 0-3 and up rows 8-11
    assert tp_chunks([16, 3], 0, 2, 2)[0] == [([0, 0], [4, 3], 0), ([8, 0], [4, 3], 4)]
    # vocabulary 10 padded to 12 at TP=2: rank 1 holds rows 6-9 only
    assert tp_chunks([12, 3], 0, 1, 2, valid_rows=10)[1] == [([6, 0], [4, 3], 0)]
    # padding so large that rank 3 holds no real row
    assert tp_chunks([512, 3], 0, 1, 4, valid_rows=100)[1:] == [[], [], []]


def _single(tmp_path, seed=1, family="llama", **overrides):
    state = ParallelState.single()
    return [GPTModel(make_config(family, **overrides), state, init_seed=seed)], state


def test_single_process_round_trip_and_tracker(tmp_path):
    chunks, state = _single(tmp_path)
    save_checkpoint(tmp_path, 3, chunks=chunks, optimizer=None, pstate=state, common={})
    save_checkpoint(tmp_path, 7, chunks=chunks, optimizer=None, pstate=state, common={})
    assert (tmp_path / TRACKER).read_text() == "7"
    fresh, _ = _single(tmp_path, seed=2)
    assert load_checkpoint(tmp_path, chunks=fresh, pstate=state)["iteration"] == 7
    for (n, a), (_, b) in zip(chunks[0].named_parameters(), fresh[0].named_parameters()):
        assert torch.equal(a, b), n
    assert not list(tmp_path.glob("*.tmp"))


def test_no_checkpoint_returns_none(tmp_path):
    chunks, state = _single(tmp_path)
    assert load_checkpoint(tmp_path / "nothing", chunks=chunks, pstate=state) is None


def test_interrupted_save_leaves_previous_checkpoint_loadable(tmp_path):
    chunks, state = _single(tmp_path)
    save_checkpoint(tmp_path, 3, chunks=chunks, optimizer=None, pstate=state, common={})
    # a save of iteration 4 killed midway: a partial temporary directory, tracker untouched
    partial = iteration_dir(tmp_path, 4).with_suffix(".tmp")
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert read_tracker(tmp_path) == 3
    fresh, _ = _single(tmp_path, seed=2)
    assert load_checkpoint(tmp_path, chunks=fresh, pstate=state)["iteration"] == 3
    save_checkpoint(tmp_path, 4, chunks=chunks, optimizer=None, pstate=state, common={})  # cleans it up
    assert read_tracker(tmp_path) == 4 and not partial.exists()


@pytest.mark.parametrize("damage, name", [("truncate", "__0_0.distcp"), ("flip", "__0_0.distcp"),
                                          ("delete", "__0_0.distcp"), ("flip", "rng_tp0_pp0_dp0.json")])
def test_damaged_checkpoint_refused_naming_file_then_fallback(tmp_path, damage, name):
    chunks, state = _single(tmp_path)
    save_checkpoint(tmp_path, 1, chunks=chunks, optimizer=None, pstate=state, common={})
    save_checkpoint(tmp_path, 2, chunks=chunks, optimizer=None, pstate=state, common={})
    target = iteration_dir(tmp_path, 2) / name
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:100] + bytes([data[100] ^ 0x01]) + data[101:])
    else:
        target.unlink()
    fresh, _ = _single(tmp_path, seed=2)
    with pytest.raises(CheckpointError, match=str(target)):
        load_checkpoint(tmp_path, chunks=fresh, pstate=state)
    assert load_checkpoint(tmp_path, chunks=fresh, pstate=state, fallback=True)["iteration"] == 1


def test_interrupted_overwrite_keeps_the_old_checkpoint_loadable(tmp_path, monkeypatch):
    chunks, state = _single(tmp_path)
    common = {"model_config": chunks[0].config.to_dict()}  # what the converter needs to read it
    save_checkpoint(tmp_path, 3, chunks=chunks, optimizer=None, pstate=state, common=common)
    first = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(1.0)
    real_replace = os.replace

    def killed_before_publishing(src, dst):
        if Path(src).name == "iter_0000003.tmp":
            raise KeyboardInterrupt("killed")  # the old directory is already set aside
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_before_publishing)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, chunks=chunks, optimizer=None, pstate=state, common={})
    monkeypatch.undo()
    assert read_tracker(tmp_path) == 3 and not iteration_dir(tmp_path, 3).exists()
    fresh, _ = _single(tmp_path, seed=2)
    assert load_checkpoint(tmp_path, chunks=fresh, pstate=state)["iteration"] == 3
    vocab = fresh[0].config.vocab_size  # padding rows are not saved
    assert all(torch.equal(_vocab_rows(n, p, vocab), _vocab_rows(n, first[n], vocab))
               for n, p in fresh[0].named_parameters())
    converter_view = MegaliteCheckpoint(tmp_path)  # the offline converter finds the set-aside copy too
    assert converter_view.iteration == 3 and all(
        torch.equal(converter_view.get(f"model/{n}"), _vocab_rows(n, first[n], vocab))
        for n in first if f"model/{n}" in converter_view.keys())
    save_checkpoint(tmp_path, 4, chunks=chunks, optimizer=None, pstate=state, common={})  # restores it
    save_checkpoint(tmp_path, 3, chunks=chunks, optimizer=None, pstate=state, common={})  # overwrites it
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([TRACKER, "iter_0000003", "iter_0000004"])
    load_checkpoint(tmp_path, chunks=fresh, pstate=state)
    assert all(torch.equal(_vocab_rows(n, p, vocab), _vocab_rows(n, q, vocab))
               for (n, p), q in zip(fresh[0].named_parameters(), chunks[0].parameters()))


def test_different_model_shape_refused_naming_tensor_and_shapes(tmp_path):
    chunks, state = _single(tmp_path)
    save_checkpoint(tmp_path, 1, chunks=chunks, optimizer=None, pstate=state, common={})
    other, _ = _single(tmp_path, ffn_hidden_size=128)
    with pytest.raises(CheckpointError, match=r"tensor model/layers\.0\.mlp\.linear_fc1\.weight has shape "
                                              r"\[192, 64\] in the checkpoint but the model expects \[256, 64\]"):
        load_checkpoint(tmp_path, chunks=other, pstate=state)


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _call_global(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle calling global `module`.`name` (a dotted name is looked up attribute
    by attribute) on `arg`."""
    def text(s):
        return b"\x8c" + bytes([len(s.encode())]) + s.encode()

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."


def _payloads(tmp_path) -> dict:
    marker, victim = tmp_path / "pwned", tmp_path / "victim"
    return {
        "os.system via DCP's metadata module": _call_global(
            "torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}"),
        "builtins.eval via torch": _call_global(
            "torch", "builtins.eval", f"__import__('os').system('touch {marker}')"),
        "__reduce__ to os.system": pickle.dumps(_Exploit(marker)),
        "module-level function": _call_global("shutil", "rmtree", str(victim)),
        "not metadata": pickle.dumps({"state_dict_metadata": {}}),
    }


def _plant(directory: Path, payload: bytes) -> None:
    """Replace the checkpoint's metadata, digests updated: only the unpickler stands guard."""
    (directory / ".metadata").write_bytes(payload)
    common = json.loads((directory / "common.json").read_text())
    common["files"][".metadata"] = file_digest(directory / ".metadata")
    (directory / "common.json").write_text(json.dumps(common))


def test_crafted_payloads_are_live(tmp_path):
    """The payloads of the next test do run code when unpickled without the allowlist."""
    payloads = _payloads(tmp_path)
    (tmp_path / "victim").mkdir()
    pickle.loads(payloads["os.system via DCP's metadata module"])
    pickle.loads(payloads["module-level function"])
    assert (tmp_path / "pwned").exists() and not (tmp_path / "victim").exists()


@pytest.mark.parametrize("payload", ["os.system via DCP's metadata module", "builtins.eval via torch",
                                     "__reduce__ to os.system", "module-level function", "not metadata"])
def test_crafted_checkpoint_does_not_run_code(tmp_path, payload):
    chunks, state = _single(tmp_path)
    save_checkpoint(tmp_path / "ckpt", 1, chunks=chunks, optimizer=None, pstate=state, common={"model_config": {}})
    (tmp_path / "victim").mkdir()
    directory = iteration_dir(tmp_path / "ckpt", 1)
    _plant(directory, _payloads(tmp_path)[payload])
    expected = re.escape(f"{directory / '.metadata'}: not a valid checkpoint metadata file (") + (
        "it holds a dict, not DCP Metadata" if payload == "not metadata" else "refusing to load global")
    fresh, _ = _single(tmp_path, seed=2)
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(tmp_path / "ckpt", chunks=fresh, pstate=state)
    with pytest.raises(ConversionError, match=expected):
        MegaliteCheckpoint(tmp_path / "ckpt")
    assert not (tmp_path / "pwned").exists() and (tmp_path / "victim").is_dir()


def test_async_save_captures_values_at_save_time(tmp_path):
    chunks, state = _single(tmp_path)
    before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    pending = save_checkpoint(tmp_path, 1, chunks=chunks, optimizer=None, pstate=state, common={}, async_save=True)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(1.0)  # training continues while the checkpoint is written
    assert read_tracker(tmp_path) is None  # not published until finalized
    pending.finalize()
    assert read_tracker(tmp_path) == 1
    fresh, _ = _single(tmp_path, seed=2)
    load_checkpoint(tmp_path, chunks=fresh, pstate=state)
    for n, p in fresh[0].named_parameters():
        assert torch.equal(p, before[n]), n


def test_bad_tracker_file_is_named(tmp_path):
    (tmp_path / TRACKER).write_text("not-a-number")
    chunks, state = _single(tmp_path)
    with pytest.raises(CheckpointError, match=f"{tmp_path / TRACKER}: expected an iteration number"):
        load_checkpoint(tmp_path, chunks=chunks, pstate=state)
    assert Path(tmp_path / TRACKER).exists()


_SAVE_THEN_STALL = """
import sys, time
import torch.distributed.checkpoint as dcp
from megalite.model.gpt import GPTModel
from megalite.parallel.state import ParallelState
from megalite.checkpoint.dcp.checkpoint import save_checkpoint
from tests.model.test_gpt_tp import make_config

root, state = sys.argv[1], ParallelState.single()
chunks = [GPTModel(make_config("llama"), state, init_seed=1)]
save_checkpoint(root, 1, chunks=chunks, optimizer=None, pstate=state, common={})
write_data = dcp.FileSystemWriter.write_data


def write_then_stall(self, plan, planner):
    done = write_data(self, plan, planner)
    done.wait()
    print("data written", flush=True)
    time.sleep(600)  # the test kills the process here, in the middle of the save


dcp.FileSystemWriter.write_data = write_then_stall
save_checkpoint(root, 2, chunks=chunks, optimizer=None, pstate=state, common={})
"""


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    import signal
    import subprocess
    import sys

    from tests.training.launch import REPO

    proc = subprocess.Popen([sys.executable, "-c", _SAVE_THEN_STALL, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "data written"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list(iteration_dir(tmp_path, 2).with_suffix(".tmp").glob("*.distcp"))  # killed mid-save
    assert not iteration_dir(tmp_path, 2).exists()
    assert read_tracker(tmp_path) == 1
    fresh, state = _single(tmp_path, seed=2)
    assert load_checkpoint(tmp_path, chunks=fresh, pstate=state)["iteration"] == 1
