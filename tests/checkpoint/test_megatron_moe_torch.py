"""Megatron `torch`-format MoE checkpoints (mp_rank_TT[_EEE] folders) at EP > 1 and ETP != TP,
with SequentialMLP, TEGroupedMLP and legacy GroupedMLP experts, local or Transformer Engine
layer names, shared experts with their gate, the router's expert bias, --moe-layer-freq [0,1]
and an MoE MTP layer: every megalite tensor read equals the model's that the files were cut
from. The files are built by megatron_moe_files.py from the state dicts Megatron-Core would save
(Megatron-Core's torch_dist MoE checkpoints are checked against its logits in
test_megatron_core_moe.py; its GroupedMLP needs the grouped_gemm package and a GPU, TEGroupedMLP
Transformer Engine, neither here)."""

import pytest
import torch

from megalite.checkpoint.dcp.format import CheckpointError
from megalite.checkpoint.megatron.reader import MegatronCheckpoint
from megalite.checkpoint.megatron.torch_files import writers
from tests.checkpoint.megatron_moe_files import moe_args, write_moe_torch

LAYOUTS = {  # (TP, EP, ETP, world): the folders Megatron writes
    "tp2_ep2_etp1": ((2, 2, 1, 4), ["mp_rank_00_000", "mp_rank_01_001"]),
    "tp1_ep2_etp1": ((1, 2, 1, 2), ["mp_rank_00_000", "mp_rank_00_001"]),
    "tp2_ep2_etp2": ((2, 2, 2, 4), ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"]),
    "tp2_ep1_etp1": ((2, 1, 1, 2), ["mp_rank_00", "mp_rank_01"]),
    "tp4_ep2_etp1_dp2": ((4, 2, 1, 8), ["mp_rank_00_000", "mp_rank_01_001", "mp_rank_02_000", "mp_rank_03_001"]),
}
CASES = [(layout, "sequential", False) for layout in LAYOUTS] + [
    ("tp2_ep2_etp1", "te_grouped", True), ("tp2_ep2_etp2", "te_grouped", True),
    ("tp2_ep2_etp1", "legacy_grouped", False), ("tp2_ep2_etp2", "legacy_grouped", True),
    ("tp1_ep2_etp1", "legacy_grouped", False)]


@pytest.mark.parametrize("layout,style,te_names", CASES)
def test_every_tensor_reads_as_the_model_it_was_cut_from(tmp_path, layout, style, te_names):
    (tp, ep, etp, world), folders = LAYOUTS[layout]
    expected, written = write_moe_torch(tmp_path, tp, ep, etp, world, style, te_names)
    assert sorted(written) == sorted(folders)
    checkpoint = MegatronCheckpoint(tmp_path)
    assert checkpoint.config.moe.num_experts == 4 and checkpoint.config.mtp_num_layers == 1
    names = checkpoint.names()
    assert "mtp.layers.0.mtp_model_layer.mlp.local_experts.3.linear_fc2.weight" in names
    assert set(names) == set(expected)
    for name in names:
        got = checkpoint.get(name)
        assert torch.equal(got, expected[name]), name
        assert checkpoint.spec(name) == (tuple(expected[name].shape), expected[name].dtype), name
    checkpoint.check_all_used()



@pytest.mark.parametrize("split_down", [True, False], ids=["local-spec-split", "te-spec-whole"])
def test_mla_down_projections_read_whole_from_either_layer_spec(tmp_path, split_down):
    """Megatron's local spec splits an MLA down projection over TP; Transformer Engine's
    duplicated linear saves it whole on every rank: both read as the one tensor (concatenating
    the whole copies would double its rows)."""
    expected, _ = write_moe_torch(tmp_path, 2, 1, 1, 2, family="deepseek_v3", split_down=split_down)
    checkpoint = MegatronCheckpoint(tmp_path)
    down = [n for n in checkpoint.names() if n.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight"))]
    assert len(down) >= 2
    for name in checkpoint.names():
        assert torch.equal(checkpoint.get(name), expected[name]), name
        assert checkpoint.spec(name) == (tuple(expected[name].shape), expected[name].dtype), name

def test_the_writer_layout_follows_megatrons_rank_order():
    """tp-cp-ep-dp-pp and --use-tp-pp-dp-mapping's tp-cp-ep-pp-dp: (TP, PP, EP) file -> ETP ranks."""
    args = moe_args(2, 2, 1, 4, "sequential")
    assert writers(args) == {(0, 0, 0): {0}, (1, 0, 1): {0}}
    args.pipeline_model_parallel_size, args.world_size, args.use_tp_pp_dp_mapping = 2, 8, True
    assert writers(args) == {(0, 0, 0): {0}, (1, 0, 1): {0}, (0, 1, 0): {0}, (1, 1, 1): {0}}


def test_files_two_ranks_race_to_write_are_refused(tmp_path):
    """ETP > TP: ranks holding different expert slices write one mp_rank file (Megatron keeps
    whichever wrote last): refused naming the file."""
    write_moe_torch(tmp_path, 1, 2, 1, 2)
    for path in (tmp_path / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt"):
        saved = torch.load(path, weights_only=False)
        saved["args"] = moe_args(1, 2, 2, 4, "sequential")
        torch.save(saved, path)
    with pytest.raises(CheckpointError, match=r"mp_rank_00_000/model_optim_rng.pt: written by ranks holding "
                                              r"different expert TP slices \[0, 1\]"):
        MegatronCheckpoint(tmp_path)


def test_a_missing_expert_file_is_named(tmp_path):
    write_moe_torch(tmp_path, 1, 2, 1, 2)
    (tmp_path / "iter_0000003" / "mp_rank_00_001" / "model_optim_rng.pt").unlink()
    with pytest.raises(CheckpointError, match="no file holds expert TP slice 0 of EP rank 1"):
        MegatronCheckpoint(tmp_path)


HF_CASES = {"mixtral": (2, 2, 1, 4, "te_grouped", True), "qwen2_moe": (2, 2, 1, 4, "te_grouped", True),
            "qwen3_moe": (2, 2, 2, 4, "legacy_grouped", False), "deepseek_v3": (2, 2, 1, 4, "sequential", False)}


@pytest.mark.parametrize("family", list(HF_CASES))
def test_convert_to_hugging_face_gives_megalites_logits(tmp_path, family):
    """convert.py --loader megatron --saver hf of an EP2 `torch` checkpoint (Mixtral's, Qwen2-MoE's
    at TP2 ETP1 with TEGroupedMLP names, Qwen2-MoE's with a gated shared expert and
    --moe-layer-freq [0,1]; Qwen3-MoE's with qk-norm and legacy GroupedMLP experts at ETP2;
    DeepSeek-V3's at TP2: MLA, sigmoid routing with the expert bias, a shared expert, an MoE MTP depth): transformers' model gives the logits of megalite's model holding
    the same tensors, within 1e-4."""
    transformers = pytest.importorskip("transformers")
    from megalite.convert.cli import main
    from megalite.model.gpt import GPTModel
    from tests.checkpoint.megatron_moe_files import family_config

    expected, _ = write_moe_torch(tmp_path / "megatron", *HF_CASES[family], family=family)
    assert main(["--loader", "megatron", "--saver", "hf", "--load-dir", str(tmp_path / "megatron"),
                 "--save-dir", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    assert hf.config.model_type == family
    model = GPTModel(family_config(family)).eval()
    missing, unexpected = model.load_state_dict(expected, strict=False)
    assert not unexpected and all(n.endswith("._extra_state") for n in missing)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens)[..., :64], hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_hf_export_of_a_family_hugging_face_lacks_is_refused_in_one_line(tmp_path):
    """CONFIG (an MTP depth without MLA; sigmoid routing with the expert bias) is no Hugging Face
    family megalite writes: refused naming what, nothing written."""
    from megalite.checkpoint.publish import ConversionError
    from megalite.convert.megatron_converters import megatron_to_hf

    write_moe_torch(tmp_path / "megatron", 1, 2, 1, 2)
    with pytest.raises(ConversionError, match="cannot be a Hugging Face model: .*mtp_num_layers=1"):
        megatron_to_hf(tmp_path / "megatron", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("target", [["--target-expert-parallel-size", "1"],
                                    ["--target-expert-parallel-size", "2", "--target-expert-tensor-parallel-size", "1"]])
def test_convert_to_megalite_at_another_expert_layout_keeps_every_tensor(tmp_path, target):
    """convert.py --loader megatron --saver megalite of a TP2 EP2 ETP1 legacy-GroupedMLP `torch`
    checkpoint at target TP2 EP1 (ETP2) and TP2 EP2 ETP1: megalite's checkpoint holds the model's
    full tensors (test_megatron_core_moe.py checks the logits of such conversions, slow)."""
    from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
    from megalite.convert.cli import main

    expected, _ = write_moe_torch(tmp_path / "megatron", 2, 2, 1, 4, "legacy_grouped")
    assert main(["--loader", "megatron", "--saver", "megalite", "--load-dir", str(tmp_path / "megatron"),
                 "--save-dir", str(tmp_path / "out"), "--target-tensor-parallel-size", "2", *target]) == 0
    converted = MegaliteCheckpoint(tmp_path / "out")
    for name, tensor in expected.items():
        assert torch.equal(converted.get_model(name), tensor), name


@pytest.mark.parametrize("layout", ["tp2_ep1_etp1", "tp1_ep2_etp1"])
def test_the_optimizer_state_of_expert_parallel_torch_files_is_refused(tmp_path, layout):
    from megalite.checkpoint.megatron.optimizer import MegatronOptimizerState

    (tp, ep, etp, world), _ = LAYOUTS[layout]
    write_moe_torch(tmp_path, tp, ep, etp, world)
    for path in (tmp_path / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt"):
        saved = torch.load(path, weights_only=False)
        saved["optimizer"] = {"optimizer": {"state": {}, "param_groups": []}}
        torch.save(saved, path)
    with pytest.raises(CheckpointError, match=f"optimizer state saved at expert_model_parallel_size={ep}, "
                                              f"expert_tensor_parallel_size={etp} in `torch` format"):
        MegatronOptimizerState(MegatronCheckpoint(tmp_path))
