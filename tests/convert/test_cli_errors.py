"""Bad converter input: one line on stderr naming the file, tensor, flag or config field, exit
status 2, and nothing under --save-dir."""

import json
import sys
from pathlib import Path

import pytest

from megalite.checkpoint.hf.safetensors_io import read_header
from tests.convert.hf_models import convert, hf_model, hf_to_megalite, save_hf
from tests.forked_program import run_program

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return Path(save_hf(hf_model("llama", num_layers=2), tmp_path_factory.mktemp("hf") / "llama"))


def _copy_without(src: Path, dst: Path, drop_tensor=None, config_changes=None) -> Path:
    import torch
    from safetensors.torch import save_file

    from megalite.checkpoint.hf.safetensors_io import read_tensor

    dst.mkdir()
    header, start = read_header(src / "model.safetensors")
    tensors = {n: read_tensor(src / "model.safetensors", n, e, start) for n, e in header.items() if n != drop_tensor}
    save_file({n: t.clone() for n, t in tensors.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    for key, value in (config_changes or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    assert torch  # imported for safetensors' torch backend
    return dst


def _refused(capsys, tmp_path, *argv, expect: str):
    out_dir = tmp_path / "out"
    status = convert(*argv, "--save-dir", out_dir)
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("convert: error: "), err
    assert expect in err, err
    assert not out_dir.exists() and not list(tmp_path.glob(".out.tmp*")), "output left behind"
    return err


def test_missing_directory_and_config(capsys, tmp_path):
    _refused(capsys, tmp_path, "--loader", "hf", "--saver", "megalite", "--load-dir", tmp_path / "nope",
             expect=f"{tmp_path / 'nope'}: no such directory")
    (tmp_path / "empty").mkdir()
    _refused(capsys, tmp_path, "--loader", "hf", "--saver", "megalite", "--load-dir", tmp_path / "empty",
             expect=f"{tmp_path / 'empty' / 'config.json'}: missing")
    _refused(capsys, tmp_path, "--loader", "megalite", "--saver", "hf", "--load-dir", tmp_path / "empty",
             expect="latest_checkpointed_iteration.txt: missing")


def test_missing_tensor_is_named(capsys, tmp_path, llama_dir):
    broken = _copy_without(llama_dir, tmp_path / "broken", drop_tensor="model.layers.1.mlp.up_proj.weight")
    _refused(capsys, tmp_path, "--loader", "hf", "--saver", "megalite", "--load-dir", broken,
             expect="no tensor model.layers.1.mlp.up_proj.weight")


@pytest.mark.parametrize("change, expect", [
    ({"model_type": "mistral"}, "model_type='mistral'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}}, "rope_parameters="),
    ({"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling="),
])
def test_unsupported_architecture_names_the_field(capsys, tmp_path, llama_dir, change, expect):
    changed = _copy_without(llama_dir, tmp_path / "changed", config_changes=change)
    _refused(capsys, tmp_path, "--loader", "hf", "--saver", "megalite", "--load-dir", changed, expect=expect)


def test_missing_config_field_is_named(capsys, tmp_path, llama_dir):
    changed = _copy_without(llama_dir, tmp_path / "changed", config_changes={"intermediate_size": None})
    _refused(capsys, tmp_path, "--loader", "hf", "--saver", "megalite", "--load-dir", changed,
             expect="config.json: no intermediate_size")


def _save_megalite(directory: Path, family: str, add_parameter: str | None = None, **config_changes) -> Path:
    """A megalite checkpoint of a small model; `add_parameter` 'module.path.name' registers one
    more parameter (a tensor no Hugging Face model has a place for)."""
    import torch

    from megalite.model.gpt import GPTModel
    from megalite.checkpoint.dcp.checkpoint import save_checkpoint
    from tests.model.test_gpt_tp import make_config

    config = make_config(family, **config_changes)
    model = GPTModel(config)
    if add_parameter:
        owner, _, name = add_parameter.rpartition(".")
        model.get_submodule(owner).register_parameter(name, torch.nn.Parameter(torch.ones(config.kv_channels)))
    save_checkpoint(directory, 3, chunks=[model], optimizer=None, pstate=model.pstate,
                    common={"model_config": config.to_dict()})
    return directory


@pytest.mark.parametrize("family, changes, expect", [
    ("gpt2", {"normalization": "RMSNorm"}, "normalization/activation=('RMSNorm', 'openai_gelu')"),
    # q/k/v biases without the others: LlamaConfig's attention_bias would add an o_proj bias too.
    ("llama", {"add_qkv_bias": True}, "add_qkv_bias=True"),
    ("gpt2", {"kv_channels": 16}, "kv_channels=16"),  # GPT2Config has no head width of its own
], ids=["gpt2-rmsnorm", "llama-qkv-bias-only", "gpt2-head-width"])
def test_megalite_model_without_a_hugging_face_family_is_refused(capsys, tmp_path, family, changes, expect):
    ckpt = _save_megalite(tmp_path / "ml", family, **changes)
    _refused(capsys, tmp_path, "--loader", "megalite", "--saver", "hf", "--load-dir", ckpt, expect=expect)


def test_model_tensor_the_export_leaves_out_is_named(capsys, tmp_path):
    ckpt = _save_megalite(tmp_path / "ml", "llama", add_parameter="layers.1.self_attention.q_norm_weight")
    _refused(capsys, tmp_path, "--loader", "megalite", "--saver", "hf", "--load-dir", ckpt,
             expect="model tensor layers.1.self_attention.q_norm_weight has no place in the Hugging Face llama model")


def test_bad_layouts_and_flags(capsys, tmp_path, llama_dir):
    base = ("--loader", "hf", "--saver", "megalite", "--load-dir", llama_dir)
    _refused(capsys, tmp_path, *base, "--target-tensor-parallel-size", 4,
             expect="--target-tensor-parallel-size 4 does not divide the model's num_query_groups (2)")
    _refused(capsys, tmp_path, *base, "--target-pipeline-parallel-size", 3, expect="num_layers (2)")
    _refused(capsys, tmp_path, "--loader", "hf", "--saver", "hf", "--load-dir", llama_dir, expect="nothing to convert")
    _refused(capsys, tmp_path, "--loader", "hf", "--saver", "megalite", expect="--load-dir")


def test_existing_output_and_corrupted_checkpoint(capsys, tmp_path, llama_dir):
    ckpt = Path(hf_to_megalite(llama_dir, tmp_path / "ml", tp=2))
    capsys.readouterr()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    status = convert("--loader", "megalite", "--saver", "hf", "--load-dir", ckpt, "--save-dir", tmp_path / "out")
    assert status == 2 and "already exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    (tmp_path / "out" / "keep.txt").unlink()
    (tmp_path / "out").rmdir()
    victim = next((ckpt / "iter_0000000").glob("__1_0.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    _refused(capsys, tmp_path, "--loader", "megalite", "--saver", "hf", "--load-dir", ckpt,
             expect=f"{victim}: corrupted")


def test_tool_exit_status_and_single_line(tmp_path):
    """The script itself (a fresh process): exit 2, one line, no traceback."""
    proc = run_program([sys.executable, str(REPO / "tools/checkpoint/convert.py"), "--loader", "hf", "--saver",
                           "megalite", "--load-dir", str(tmp_path / "missing"), "--save-dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"convert: error: --load-dir {tmp_path / 'missing'}: no such directory"]
    assert not (tmp_path / "o").exists()
