"""Reading Megatron checkpoints never runs code from them, and refuses what it cannot load
with one line naming the file, class or tensor."""

import argparse
import os
import pickle
from pathlib import Path

import pytest
import torch

from megalite.convert.cli import main
from megalite.checkpoint.megatron.safe_pickle import MegatronObject, safe_torch_load
from megalite.checkpoint.megatron.reader import MegatronCheckpoint, megatron_format
from megalite.checkpoint.publish import ConversionError
from megalite.checkpoint.dcp.format import CheckpointError
from tests.checkpoint.megatron_files import megatron_args, write_megatron_torch


class RunsCode:
    """A pickle whose loading would create a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_model_optim_rng_is_refused_naming_file_and_class(tmp_path, capsys):
    marker = tmp_path / "code_ran"
    write_megatron_torch(tmp_path / "ckpt", args=RunsCode(marker))
    path = tmp_path / "ckpt" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    with pytest.raises(CheckpointError) as refused:
        MegatronCheckpoint(tmp_path / "ckpt")
    message = str(refused.value)
    assert str(path) in message and "system" in message and "\n" not in message
    assert main(["--loader", "megatron", "--saver", "hf", "--load-dir", str(tmp_path / "ckpt"),
                 "--save-dir", str(tmp_path / "hf")]) == 2
    assert str(path) in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_a_megatron_named_class_is_only_recorded(tmp_path):
    """Classes under megatron.* (the enums Megatron stores in args) become inert records:
    nothing of Megatron is imported or run, even for a name that does not exist."""
    class Impostor:
        def __reduce__(self):
            return (Impostor, (7,))
    Impostor.__module__, Impostor.__qualname__ = "megatron.core.evil", "run"
    import sys
    import types
    sys.modules["megatron.core.evil"] = types.SimpleNamespace(run=Impostor)
    try:
        torch.save({"args": argparse.Namespace(backend=Impostor())}, tmp_path / "x.pt")
    finally:
        del sys.modules["megatron.core.evil"]
    loaded = safe_torch_load(tmp_path / "x.pt")
    assert isinstance(loaded["args"].backend, MegatronObject)
    assert loaded["args"].backend.megatron_class == "megatron.core.evil.run" and loaded["args"].backend.args == (7,)


def test_malicious_torch_dist_metadata_is_refused(tmp_path):
    folder = tmp_path / "ckpt" / "iter_0000001"
    folder.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    marker = tmp_path / "code_ran"
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    assert megatron_format(tmp_path / "ckpt") == "torch_dist"
    with pytest.raises(CheckpointError, match=r"\.metadata: not a valid checkpoint metadata file.*system"):
        MegatronCheckpoint(tmp_path / "ckpt")
    assert not marker.exists()


def test_unsupported_model_feature_is_refused_by_name_and_path_once(tmp_path, capsys):
    write_megatron_torch(tmp_path / "ckpt", args=megatron_args(apply_residual_connection_post_layernorm=True))
    path = str(tmp_path / "ckpt" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    with pytest.raises(ConversionError, match="apply_residual_connection_post_layernorm=True") as refused:
        MegatronCheckpoint(tmp_path / "ckpt")
    assert str(refused.value).count(path) == 1
    assert main(["--loader", "megatron", "--saver", "megalite", "--load-dir", str(tmp_path / "ckpt"),
                 "--save-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count(path) == 1 and "apply_residual_connection_post_layernorm" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_megatron_legacy_model_is_named(tmp_path):
    folder = tmp_path / "ckpt" / "iter_0000003" / "mp_rank_00"
    folder.mkdir(parents=True)
    legacy = {"language_model": {"embedding": {"word_embeddings": {"weight": torch.zeros(64, 16)}}}}
    torch.save({"args": megatron_args(), "iteration": 3, "model": legacy}, folder / "model_optim_rng.pt")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(CheckpointError, match=r"model_optim_rng\.pt: no embedding\.word_embeddings\.weight "
                                              r"\(Megatron's legacy GPT model"):
        MegatronCheckpoint(tmp_path / "ckpt")


def test_tensor_without_a_place_is_refused_by_the_converter(tmp_path):
    write_megatron_torch(tmp_path / "ckpt", extra={"decoder.layers.1.self_attention.q_layernorm.weight": torch.ones(8)})
    with pytest.raises(ConversionError, match=r"decoder\.layers\.1\.self_attention\.q_layernorm\.weight"):
        MegatronCheckpoint(tmp_path / "ckpt").check_all_used()


def test_missing_rank_file_is_named(tmp_path):
    write_megatron_torch(tmp_path / "ckpt")
    folder = tmp_path / "ckpt" / "iter_0000003"
    (folder / "mp_rank_00").rename(folder / "mp_rank_00_000")
    (folder / "mp_rank_01_001").mkdir()
    with pytest.raises(CheckpointError, match=r"mp_rank_00_001/model_optim_rng\.pt: missing"):
        MegatronCheckpoint(tmp_path / "ckpt")
