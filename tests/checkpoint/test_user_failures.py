"""Checkpoint failures as a user meets them, each through the real command line: one line on
stderr naming the file, exit status 2, nothing run and nothing left behind.
  - a malicious record inside a .distcp shard (its metadata and checksums made to match) under
    `pretrain_gpt --load`, tools/generate.py and tools/checkpoint/convert.py;
  - torch's long refusal message kept to its meaning, never cut mid-sentence;
  - a Megatron-LM (or Hugging Face) directory given where a megalite checkpoint is expected,
    and convert.py's --loader given another kind of directory.
(A full disk during a save: test_save_failures.py.)"""

import io
import json
import os
import pickle
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite.checkpoint.dcp.checkpoint import iteration_dir
from megalite.checkpoint.dcp.format import file_digest, read_metadata_file
from megalite.checkpoint.dcp.storage import first_sentence, load_failure
from megalite.convert.cli import main as convert_main
from megalite.inference.cli import main as generate_main
from tests.checkpoint.megatron_files import write_megatron_torch
from tests.checkpoint.test_dcp_checkpoint import _Exploit  # a pickle that runs `touch MARKER`
from tests.distributed import free_port
from tests.training.launch import BASE, REPO
from tests.forked_program import run_program

TENSOR = "model/layers.0.input_layernorm.weight"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint of iteration 3 written by `python -m megalite.pretrain_gpt`."""
    ckpt = tmp_path_factory.mktemp("trained") / "ckpt"
    proc = run_program([sys.executable, "-m", "megalite.pretrain_gpt", *BASE, "--train-iters", "3", "--save",
                           str(ckpt), "--eval-iters", "0"], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**ENV, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(free_port())})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ckpt


def replace_record(ckpt: Path, key: str, record: bytes) -> Path:
    """Make `record` tensor `key`'s storage record in the latest checkpoint under `ckpt`:
    appended to its .distcp file, with .metadata and common.json's digests updated so that
    only the record's own content stands out. The .distcp file."""
    directory = iteration_dir(ckpt, int((ckpt / "latest_checkpointed_iteration.txt").read_text()))
    metadata = read_metadata_file(directory / ".metadata")
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == key)
    shard = directory / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(record)
    with open(shard, "ab") as f:
        f.write(record)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    common = json.loads((directory / "common.json").read_text())
    for name in (".metadata", info.relative_path):
        common["files"][name] = file_digest(directory / name)
    (directory / "common.json").write_text(json.dumps(common))
    return shard


def malicious_record(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"weight": _Exploit(marker)}, buffer)
    return buffer.getvalue()


def test_the_malicious_record_runs_code_without_weights_only(tmp_path):
    """The record the next test plants is live: torch.load without weights_only runs it."""
    torch.load(io.BytesIO(malicious_record(tmp_path / "pwned")), weights_only=False)
    assert (tmp_path / "pwned").exists()


def _tool(tool: str, ckpt: Path, out: Path) -> list[str]:
    if tool == "pretrain_gpt":
        return ["-m", "megalite.pretrain_gpt", *BASE, "--train-iters", "6", "--eval-iters", "0", "--load", str(ckpt),
                "--save", str(out)]
    if tool == "generate":
        return ["tools/generate.py", "--load", str(ckpt), "--prompt", "1 2 3", "--output-file", str(out)]
    return ["tools/checkpoint/convert.py", "--loader", "megalite", "--saver", "hf", "--load-dir", str(ckpt),
            "--save-dir", str(out)]


@pytest.mark.parametrize("tool", ["pretrain_gpt", "generate", "convert"])
def test_a_malicious_record_is_refused_in_one_line_naming_the_shard(tmp_path, trained, tool):
    ckpt = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(trained), str(ckpt)], check=True)
    marker = tmp_path / "pwned"
    shard = replace_record(ckpt, TENSOR, malicious_record(marker))
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    env = {**ENV, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = run_program([sys.executable, *_tool(tool, ckpt, tmp_path / "out")], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    record = rf"the record of tensor {TENSOR}" + (r" \(bytes \d+-\d+\)" if tool != "convert" else "")
    expected = (rf"{tool}: error: {re.escape(str(shard))}: {record} "
                r"refused as unsafe, not a tensor record \(it names the global posix\.system, which could run "
                r"code\); nothing in it was run")
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), proc.stderr[-3000:]
    assert not marker.exists()
    assert not (tmp_path / "out").exists()  # no checkpoint saved, no text written, no conversion
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("record, reason", [
    (b"PK\x03\x04" + bytes(100), "unreadable (PytorchStreamReader failed reading zip archive: failed finding central "
                                 "directory)"),
    (b"not a torch.save record", "refused, not a tensor record (Unsupported operand 110); nothing in it was run")])
def test_a_damaged_record_is_named_with_the_whole_reason(tmp_path, trained, capsys, record, reason):
    ckpt = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(trained), str(ckpt)], check=True)
    shard = replace_record(ckpt, TENSOR, record)
    assert convert_main(["--loader", "megalite", "--saver", "hf", "--load-dir", str(ckpt),
                         "--save-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"convert: error: {shard}: the record of tensor {TENSOR} {reason}"]
    assert generate_main(["--load", str(ckpt), "--prompt", "1 2"]) == 2
    assert re.fullmatch(rf"generate: error: {re.escape(str(shard))}: the record of tensor {TENSOR} \(bytes \d+-\d+\) "
                        + re.escape(reason), capsys.readouterr().err.strip())
    assert not (tmp_path / "out").exists()


def test_reasons_keep_whole_sentences():
    """torch's weights_only refusal is three paragraphs of advice; what matters is the global it
    names, or the unpickler's own sentence. Nothing is cut at a character count."""
    advice = ("Weights only load failed. In PyTorch 2.6, we changed the default value of the `weights_only` "
              "argument in `torch.load` from `False` to `True`. Re-running `torch.load` with `weights_only` set to "
              "`False` will likely succeed, but it can result in arbitrary code execution.\n\n")
    assert load_failure(pickle.UnpicklingError(advice + "Trying to load unsupported GLOBAL posix.system whose module "
                                               "posix is blocked.\n\nCheck the documentation")) == \
        "it names the global posix.system, which could run code"
    assert load_failure(pickle.UnpicklingError(advice + "Please file an issue: WeightsUnpickler error: \n\nUnsupported "
                                               "operand 149\n\nCheck the documentation")) == "Unsupported operand 149"
    long_line = "x" * 500 + " is the reason, version 2.6 says. And more."
    assert first_sentence(long_line) == "x" * 500 + " is the reason, version 2.6 says"
    assert first_sentence("\n  RuntimeError text without a full stop\nsecond line") == "RuntimeError text without a full stop"


def _megatron_torch_dist(root: Path) -> Path:
    """The layout that marks a Megatron-LM torch_dist checkpoint (its files are not read)."""
    (root / "iter_0000005").mkdir(parents=True)
    (root / "iter_0000005" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    return root


def test_generate_given_a_megatron_checkpoint_prints_the_conversion_to_run(tmp_path, capsys):
    """The printed command is run as written (from the repository root), then generation works."""
    megatron = tmp_path / "megatron"
    write_megatron_torch(megatron, 3)
    generate = ["--prompt", "1 2 3", "--max-new-tokens", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    assert generate_main([*generate, "--load", str(megatron)]) == 2
    command = (f"python tools/checkpoint/convert.py --loader megatron --saver megalite --load-dir {megatron} "
               f"--save-dir {megatron}-megalite")
    assert capsys.readouterr().err.splitlines() == [f"generate: error: {megatron}: a Megatron-LM torch checkpoint, "
                                                    f"not megalite's format; convert it first: {command}"]
    converted = run_program([sys.executable, *shlex.split(command)[1:]], capture_output=True, text=True, cwd=REPO,
                               env=ENV, timeout=300)
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert generate_main([*generate, "--load", f"{megatron}-megalite"]) == 0


def test_generate_given_a_torch_dist_checkpoint(tmp_path, capsys):
    megatron = _megatron_torch_dist(tmp_path / "megatron")
    assert generate_main(["--load", str(megatron), "--prompt", "1 2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"generate: error: {megatron}: a Megatron-LM torch_dist checkpoint, not megalite's format; convert it first: "
        f"python tools/checkpoint/convert.py --loader megatron --saver megalite --load-dir {megatron} "
        f"--save-dir {megatron}-megalite"]


def test_convert_says_what_the_load_dir_is(tmp_path, trained, capsys):
    torch_format = tmp_path / "torch"
    write_megatron_torch(torch_format, 3)
    torch_dist = _megatron_torch_dist(tmp_path / "torch_dist")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    for loader, load_dir, kind, right in (("megalite", torch_format, "Megatron-LM torch", "megatron"),
                                          ("hf", torch_dist, "Megatron-LM torch_dist", "megatron"),
                                          ("hf", trained, "megalite", "megalite"),
                                          ("megatron", trained, "megalite", "megalite"),
                                          ("megalite", hf, "Hugging Face", "hf")):
        out = tmp_path / f"out-{loader}"
        saver = "hf" if loader == "megalite" else "megalite"
        assert convert_main(["--loader", loader, "--saver", saver, "--load-dir", str(load_dir),
                             "--save-dir", str(out)]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"convert: error: --loader {loader}: {load_dir} is a {kind} checkpoint (use --loader {right})"]
        assert not out.exists()
