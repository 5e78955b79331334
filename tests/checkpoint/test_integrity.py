"""--verify-integrity: Megatron-Core's integrity manifest (megatron/core/dist_checkpointing/
validation.py: save_integrity_manifest writes integrity.json = {"algorithm": "sha256",
"files": {name: SHA-256}} over the checkpoint directory's files; verify_integrity_manifest
refuses a missing manifest or any file that is missing or differs). megalite writes it into
every checkpoint it saves with the flag, before publishing, and checks the checkpoint --load
points at (megalite's or Megatron's) before reading it."""

import hashlib
import json
from types import SimpleNamespace

import pytest

from megalite.checkpoint.dcp.checkpoint import iteration_dir, save_checkpoint
from megalite.checkpoint.dcp.format import CheckpointError
from megalite.checkpoint.dcp.integrity import MANIFEST, save_integrity_manifest, verify_integrity_manifest
from megalite.checkpoint.run_load import load_for_run
from megalite.model.gpt import GPTModel
from megalite.parallel.state import ParallelState
from tests.model.test_gpt_tp import make_config


def test_manifest_is_megatrons_format_and_catches_a_changed_file(tmp_path):
    (tmp_path / "a.distcp").write_bytes(b"tensor bytes")
    (tmp_path / "common.pt").write_bytes(b"common")
    (tmp_path / "sub").mkdir()  # Megatron hashes only the files directly in the directory
    save_integrity_manifest(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest == {"algorithm": "sha256", "files": {
        "a.distcp": hashlib.sha256(b"tensor bytes").hexdigest(), "common.pt": hashlib.sha256(b"common").hexdigest()}}
    assert verify_integrity_manifest(tmp_path) == 2
    (tmp_path / "a.distcp").write_bytes(b"tensor bytez")
    with pytest.raises(CheckpointError, match=rf"^--verify-integrity: {tmp_path}/a.distcp does not match its SHA-256 "
                                              rf"in integrity.json$"):
        verify_integrity_manifest(tmp_path)
    (tmp_path / "a.distcp").unlink()
    with pytest.raises(CheckpointError, match="a.distcp is missing"):
        verify_integrity_manifest(tmp_path)
    (tmp_path / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="integrity.json not found"):
        verify_integrity_manifest(tmp_path)


def _ckpt(root, verify):
    return SimpleNamespace(load=str(root), pretrained_checkpoint=None, ckpt_step=None, verify_integrity=verify,
                           non_persistent_save_interval=None, ckpt_format="torch_dist", auto_detect_ckpt_format=False,
                           finetune=False, no_load_rng=False, ckpt_fallback_to_previous=False)


def test_saved_checkpoints_carry_the_manifest_and_a_load_checks_it(tmp_path, capsys):
    model = GPTModel(make_config("llama"))
    pstate = ParallelState.single()
    save_checkpoint(tmp_path, 3, chunks=[model], optimizer=None, pstate=pstate, common={}, verify_integrity=True)
    folder = iteration_dir(tmp_path, 3)
    listed = set(json.loads((folder / MANIFEST).read_text())["files"])
    assert listed == {p.name for p in folder.iterdir() if p.name != MANIFEST} and "common.json" in listed
    assert load_for_run(_ckpt(tmp_path, True), [model], pstate, None)["iteration"] == 3
    assert "--verify-integrity: " in capsys.readouterr().out
    data = next(folder.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-1] + bytes([data.read_bytes()[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=f"{data.name} does not match its SHA-256"):
        load_for_run(_ckpt(tmp_path, True), [model], pstate, None)
    save_checkpoint(tmp_path / "plain", 1, chunks=[model], optimizer=None, pstate=pstate, common={})
    assert not (iteration_dir(tmp_path / "plain", 1) / MANIFEST).exists()
    with pytest.raises(CheckpointError, match="saved without --verify-integrity"):
        load_for_run(_ckpt(tmp_path / "plain", True), [model], pstate, None)
