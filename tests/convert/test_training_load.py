"""The training driver loads a converted checkpoint with the printed flags, with --finetune and
to continue (--no-load-optim --no-load-rng): one step at learning rate 0 saves exactly the
converted weights again. The checkpoint was converted at TP=2 PP=2 and is loaded at TP=1."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from megalite.convert import TargetLayout
from megalite.convert.hints import model_flags, training_flags
from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
from megalite.model.config import GPTConfig
from megalite.config.arguments import model_config_from_args, parse_args
from tests.convert.hf_models import FAMILIES, hf_model, hf_to_megalite, save_hf, write_hf_tokenizer
from tests.forked_program import run_program

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_printed_flags_rebuild_the_model_config(family, dtype):
    config = GPTConfig.from_dict({**hf_model_config(family), "params_dtype": dtype})
    args = parse_args(training_flags(config, TargetLayout(2, 2, 1), {"type": None}, "/ckpt"))
    assert model_config_from_args(args, config.vocab_size).to_dict() == config.to_dict()
    assert "--bf16" in model_flags(config) if dtype == "bfloat16" else "--bf16" not in model_flags(config)


def hf_model_config(family) -> dict:
    from megalite.checkpoint.hf.mapping import config_from_hf

    return config_from_hf(hf_model(family, num_layers=2).config).to_dict()


def test_pretrain_gpt_loads_it(tmp_path):
    hf_dir = save_hf(hf_model("llama", seed=5), tmp_path / "hf")
    write_hf_tokenizer(hf_dir)
    ckpt = Path(hf_to_megalite(hf_dir, tmp_path / "ckpt", tp=2, pp=2))
    common = json.loads((ckpt / "iter_0000000" / "common.json").read_text())
    config = GPTConfig.from_dict(common["model_config"])
    assert common["args"]["num_layers"] == 4 and common["args"]["tensor_model_parallel_size"] == 2
    flags = training_flags(config, TargetLayout(1, 1, 1), common["tokenizer"], ckpt)
    run = ["--mock-data", "--train-iters", "1", "--micro-batch-size", "2", "--global-batch-size", "2",
           "--lr", "0.0", "--eval-iters", "0", "--num-workers", "0", "--distributed-backend", "gloo"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0", "MASTER_PORT": str(_port())}
    converted = MegaliteCheckpoint(ckpt)
    for mode in (["--finetune"], ["--no-load-optim", "--no-load-rng"]):
        out = tmp_path / f"after{len(mode)}"
        proc = run_program([sys.executable, "-m", "megalite.pretrain_gpt", *flags, *run, *mode, "--save", str(out)],
                              capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        saved = MegaliteCheckpoint(out)
        assert saved.iteration == 1
        model_keys = [k for k in converted.keys() if k.startswith("model/")]
        assert model_keys and set(model_keys) <= set(saved.keys())
        for key in model_keys:
            assert torch.equal(saved.get(key), converted.get(key)), f"{mode}: {key} was not loaded"


def _port() -> int:
    from tests.distributed import free_port

    return free_port()
