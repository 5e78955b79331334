"""convert.py and mixtures of experts (issue 24, item 4): the printed "to train from it" command
carries the MoE flags (every MoEConfig field round-trips through them) and the target
expert-parallel sizes (--target-expert-parallel-size, as Megatron's saver names it, and
--target-expert-tensor-parallel-size); each expert's chunks are written by a rank holding it at
that layout; bad sizes are refused in one line; and the printed command, run as printed, trains
from the converted Mixtral at TP=2 EP=2 ETP=1 and saves exactly the converted weights again."""

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from megalite.checkpoint.hf.mapping import config_from_hf
from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
from megalite.checkpoint.dcp.target_layout import TargetLayout, TensorPlacement
from megalite.config.arguments import model_config_from_args, parse_args, validate_args
from megalite.convert.hints import MOE_OPTIONS, training_flags
from megalite.model.moe_config import MoEConfig
from megalite.parallel.expert.groups import ExpertLayout
from tests.convert.hf_models import VOCAB, convert, hf_model, save_hf, write_hf_tokenizer
from tests.convert.hf_moe_models import MOE_FAMILIES, hf_moe_model
from tests.distributed import free_port

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]


def _round_trip(config, layout=TargetLayout()):
    flags = training_flags(config, layout, {"type": "NullTokenizer"}, "/ckpt")
    args = parse_args(flags)
    return model_config_from_args(args, config.vocab_size), flags


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_printed_flags_rebuild_the_moe_model(family):
    config = config_from_hf(hf_moe_model(family).config)
    rebuilt, _ = _round_trip(config)
    assert rebuilt.moe is not None and rebuilt.to_dict() == config.to_dict()


def test_every_moe_field_reaches_the_printed_flags():
    """Every MoEConfig field at a value other than its default comes back from the flags (a
    field the hint forgot would come back at its default), and the flags validate."""
    base = config_from_hf(hf_moe_model("qwen2_moe").config)
    moe = MoEConfig(num_experts=8, ffn_hidden_size=24, layer_freq=[0, 1, 0, 1], router_topk=4,
                    score_function="sigmoid", pre_softmax=True, topk_scaling_factor=2.5, router_dtype="fp32",
                    num_groups=4, group_topk=2, load_balancing_type="seq_aux_loss", aux_loss_coeff=0.01,
                    z_loss_coeff=0.001, enable_expert_bias=True, bias_update_rate=0.01, capacity_factor=1.5,
                    pad_to_capacity=True, token_drop_policy="position", shared_expert_intermediate_size=16,
                    shared_expert_gate=True, grouped_gemm=True, token_dispatcher_type="alltoall")
    default = MoEConfig(num_experts=1, ffn_hidden_size=1)
    assert set(MOE_OPTIONS) == {f.name for f in dataclasses.fields(MoEConfig)}
    assert all(getattr(moe, f.name) != getattr(default, f.name) for f in dataclasses.fields(MoEConfig))
    config = base.replace(moe=moe)
    layout = TargetLayout(tp=2, ep=2, etp=1)
    rebuilt, flags = _round_trip(config, layout)
    assert rebuilt.moe.to_dict() == moe.to_dict() and rebuilt.to_dict() == config.to_dict()
    args = validate_args(parse_args(flags + ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "0.1", "--mock-data"]),
                         layout.world_size)
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (2, 1)


@pytest.mark.parametrize("tp, ep, etp, dp", [(1, 1, None, 1), (2, 2, 1, 1), (1, 2, None, 2), (2, 2, None, 2),
                                             (2, 4, 1, 2), (4, 2, 1, 1)])
def test_each_expert_is_written_by_a_rank_holding_it(tp, ep, etp, dp):
    config = config_from_hf(hf_moe_model("mixtral", num_layers=2, num_key_value_heads=4).config)
    layout = TargetLayout(tp=tp, ep=ep, etp=etp)
    assert layout.dp == dp and layout.world_size == tp * dp
    placement = TensorPlacement(config, layout)
    experts = ExpertLayout(layout.parallel_layout(), ep, config.moe.num_experts, etp)
    per_rank = config.moe.num_experts // ep
    for e in range(config.moe.num_experts):
        for which, dim, rows in (("linear_fc1", 0, 2 * config.moe.ffn_hidden_size),
                                 ("linear_fc2", 1, config.moe.ffn_hidden_size)):
            shape = [rows, config.hidden_size] if which == "linear_fc1" else [config.hidden_size, rows]
            chunks = placement.chunks(f"model/layers.1.mlp.local_experts.{e}.{which}.weight", shape)
            writers = {rank for rank, _, _ in chunks}
            assert {experts.coords(r)[1] for r in writers} == {e // per_rank}  # the EP rank holding expert e
            assert sorted(experts.coords(r)[0] for r in writers) == list(range(layout.expert_tp))
            assert sum(sizes[dim] for _, _, sizes in chunks) == shape[dim]
    assert layout.as_dict()["dp"] == dp and ("ep" in layout.as_dict()) == (ep > 1)


def test_bad_expert_sizes_are_refused_in_one_line(tmp_path, capsys):
    moe_dir = save_hf(hf_moe_model("mixtral", num_layers=2), tmp_path / "moe")
    dense_dir = save_hf(hf_model("llama", num_layers=2), tmp_path / "dense")
    cases = ((moe_dir, "megalite", ["--target-expert-parallel-size", 3],
              "--target-expert-parallel-size 3 does not divide the model's num_experts (4)"),
             (moe_dir, "megalite", ["--target-expert-tensor-parallel-size", 3],
              "--target-expert-tensor-parallel-size 3 does not divide the model's moe_ffn_hidden_size (40)"),
             (moe_dir, "megalite", ["--target-expert-parallel-size", 0],
              "--target-expert-parallel-size must be a positive integer"),
             (dense_dir, "megalite", ["--target-expert-parallel-size", 2],
              "--target-expert-parallel-size 2: the model has no experts"),
             (moe_dir, "hf", ["--target-expert-tensor-parallel-size", 2],
              "--target-* sizes apply to --saver megalite only"))
    assert convert("--loader", "hf", "--saver", "megalite", "--load-dir", moe_dir, "--save-dir", tmp_path / "ok") == 0
    capsys.readouterr()
    for load_dir, saver, extra, expect in cases:
        loader = "megalite" if saver == "hf" else "hf"
        load_dir = tmp_path / "ok" if saver == "hf" else load_dir
        assert convert("--loader", loader, "--saver", saver, "--load-dir", load_dir, "--save-dir", tmp_path / "out",
                       *extra) == 2
        err = capsys.readouterr().err
        assert expect in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists()


def test_megalite_to_megalite_keeps_the_source_expert_sizes(tmp_path, capsys):
    hf_dir = save_hf(hf_moe_model("mixtral", num_layers=2), tmp_path / "hf")
    assert convert("--loader", "hf", "--saver", "megalite", "--load-dir", hf_dir, "--save-dir", tmp_path / "a",
                   "--target-tensor-parallel-size", 2, "--target-expert-parallel-size", 2,
                   "--target-expert-tensor-parallel-size", 1) == 0
    assert convert("--loader", "megalite", "--saver", "megalite", "--load-dir", tmp_path / "a", "--save-dir",
                   tmp_path / "b") == 0
    assert convert("--loader", "megalite", "--saver", "megalite", "--load-dir", tmp_path / "a", "--save-dir",
                   tmp_path / "c", "--target-tensor-parallel-size", 1) == 0
    out = capsys.readouterr().out
    assert "EP=2 ETP=1" in out and "TP=1 PP=1 EP=2 ETP=1" in out
    for name, layout, etp in (("b", {"tp": 2, "pp": 1, "dp": 1, "vp": 1, "ep": 2, "etp": 1}, 1),
                              ("c", {"tp": 1, "pp": 1, "dp": 2, "vp": 1, "ep": 2}, None)):
        common = MegaliteCheckpoint(tmp_path / name).common
        assert common["layout"] == layout
        assert (common["args"]["expert_model_parallel_size"], common["args"]["expert_tensor_parallel_size"]) == (2, etp)
    a, c = MegaliteCheckpoint(tmp_path / "a"), MegaliteCheckpoint(tmp_path / "c")
    assert sorted(a.keys()) == sorted(c.keys())
    assert all(torch.equal(a.get(k), c.get(k)) for k in a.keys())


def _printed_command(stdout: str) -> str:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  torchrun "))
    end = next(i for i in range(start, len(lines)) if not lines[i].split("#")[0].rstrip().endswith("\\"))
    return " ".join(line.split("#")[0].rstrip().removesuffix("\\").strip() for line in lines[start:end + 1])


def test_the_printed_command_trains_from_the_moe_checkpoint(tmp_path, capsys):
    """As printed, plus what the hint leaves to the user (data, batch, lr): two processes at TP=2
    EP=2 ETP=1 load the converted Mixtral; two steps at lr 0 save the converted weights."""
    hf_dir = save_hf(hf_moe_model("mixtral", num_layers=2, vocab_size=VOCAB), tmp_path / "hf")
    write_hf_tokenizer(hf_dir)
    ckpt = tmp_path / "ckpt"
    capsys.readouterr()
    assert convert("--loader", "hf", "--saver", "megalite", "--load-dir", hf_dir, "--save-dir", ckpt,
                   "--target-tensor-parallel-size", 2, "--target-expert-parallel-size", 2,
                   "--target-expert-tensor-parallel-size", 1) == 0
    printed = _printed_command(capsys.readouterr().out)
    assert printed.startswith("torchrun --nproc-per-node 2 -m megalite.pretrain_gpt ")
    for flag in ("--num-experts 4", "--moe-ffn-hidden-size 40", "--expert-model-parallel-size 2",
                 "--expert-tensor-parallel-size 1", "--finetune"):
        assert flag in printed
    out = tmp_path / "after"
    command = (f"{printed} --mock-data --micro-batch-size 1 --global-batch-size 2 --lr 0.0 --train-iters 2 "
               f"--eval-iters 0 --num-workers 0 --distributed-backend gloo --save {out}")
    command = command.replace("torchrun ", f"torchrun --master-port {free_port()} ", 1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    saved, converted = MegaliteCheckpoint(out), MegaliteCheckpoint(ckpt)
    args = json.loads((out / "iter_0000002" / "common.json").read_text())["args"]
    assert (args["num_experts"], args["expert_model_parallel_size"], args["expert_tensor_parallel_size"]) == (4, 2, 1)
    model_keys = [k for k in converted.keys() if k.startswith("model/")]
    assert any(".local_experts.3." in k for k in model_keys) and set(model_keys) <= set(saved.keys())
    for key in model_keys:
        assert torch.equal(saved.get(key), converted.get(key)), f"{key} was not loaded"
