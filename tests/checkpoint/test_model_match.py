"""--load into a run whose model arguments differ from the checkpoint's: a change that keeps every
tensor's shape (more heads of the same width, another epsilon, other routing) is refused in one
line naming the flag, before any tensor is read; the context-extension knobs are noted; under
--finetune every difference is noted and the run goes on."""

import json
from dataclasses import asdict, replace

import pytest

from megalite.checkpoint.dcp.format import CheckpointError
from megalite.checkpoint.model_match import check_model_matches, model_differences
from megalite.model.config import GPTConfig
from megalite.model.mla_config import MLAConfig
from megalite.model.moe_config import MoEConfig
from tests.training.launch import BASE, drop_flags, launch


def _stored(config: GPTConfig) -> dict:
    return json.loads(json.dumps(asdict(config)))  # as common.json holds it


MOE_MLA = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, normalization="RMSNorm",
                    activation="swiglu", position_embedding_type="rope",
                    moe=MoEConfig(num_experts=4, ffn_hidden_size=32, layer_freq=[0, 1], router_topk=2),
                    mla=MLAConfig(kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16),
                    mtp_num_layers=1)


def test_the_same_model_has_no_differences_through_json():
    assert model_differences(_stored(MOE_MLA), MOE_MLA) == []
    # run-time settings are not the model's
    run = replace(MOE_MLA, hidden_dropout=0.0, recompute_granularity="full", params_dtype="bfloat16",
                  sequence_parallel=True, moe=replace(MOE_MLA.moe, token_dispatcher_type="alltoall",
                                                      aux_loss_coeff=1e-2))
    assert model_differences(_stored(MOE_MLA), run) == []


@pytest.mark.parametrize("change, field, flag", [
    (dict(num_attention_heads=8), "num_attention_heads", "--num-attention-heads"),
    (dict(norm_epsilon=1e-6), "norm_epsilon", "--norm-epsilon"),
    (dict(moe=replace(MOE_MLA.moe, router_topk=1)), "moe.router_topk", "--moe-router-topk"),
    (dict(moe=replace(MOE_MLA.moe, score_function="sigmoid")), "moe.score_function", "--moe-router-score-function"),
    (dict(mla=replace(MOE_MLA.mla, q_lora_rank=8)), "mla.q_lora_rank", "--q-lora-rank"),
    (dict(moe=None), "moe", "MoE (the checkpoint has it)"),
])
def test_a_change_that_reinterprets_the_weights_is_refused_naming_the_flag(change, field, flag):
    with pytest.raises(CheckpointError) as error:
        check_model_matches(_stored(MOE_MLA), replace(MOE_MLA, **change), "ckpt", new_run=False)
    message = str(error.value)
    assert message.startswith(f"--load ckpt: the checkpoint's model has {field}=") and f"({flag})" in message
    assert "\n" not in message
    notes = check_model_matches(_stored(MOE_MLA), replace(MOE_MLA, **change), "ckpt", new_run=True)
    assert notes and notes[0].startswith(f"--load ckpt: {field} was ") and "a new run from these weights" in notes[0]


def test_context_extension_is_noted_not_refused():
    run = replace(MOE_MLA, rotary_base=500000.0, mtp_num_layers=None)
    assert check_model_matches(_stored(MOE_MLA), run, "ckpt", new_run=False) == [
        "--load ckpt: rotary_base was 10000.0 in the checkpoint, 500000.0 in this run (--rotary-base; allowed on resume)",
        "--load ckpt: mtp_num_layers was 1 in the checkpoint, None in this run (--mtp-num-layers; allowed on resume)"]


def test_a_field_the_checkpoint_does_not_store_is_not_compared():
    stored = _stored(MOE_MLA)
    del stored["norm_epsilon"], stored["moe"]["router_topk"]
    run = replace(MOE_MLA, norm_epsilon=1e-6, moe=replace(MOE_MLA.moe, router_topk=1))
    assert model_differences(stored, run) == []
    assert check_model_matches(None, run, "ckpt", new_run=False) == []


def _pretrain(log_dir, *extra):
    """(exit status, ranks) of a one-process run on BASE with `extra` flags replacing its own."""
    args = [*drop_flags(BASE, *(flag for flag in extra if flag.startswith("--"))), "--train-iters", "4",
            "--eval-iters", "0", *extra]
    ranks = launch(args, 1, log_dir, separate_stderr=True)
    return ranks.wait()[0], ranks


def test_pretrain_gpt_refuses_a_resume_with_more_heads_of_the_same_shape(tmp_path):
    """8 heads of 8 channels instead of 4 of 16: every tensor has the checkpoint's shape, so only
    the stored model_config can tell (before this check the run resumed, computing another model)."""
    ckpt = tmp_path / "ckpt"
    code, ranks = _pretrain(tmp_path / "save", "--save", str(ckpt))
    assert code == 0, ranks.output()
    heads = ["--num-attention-heads", "8", "--num-query-groups", "4"]
    code, ranks = _pretrain(tmp_path / "refused", "--load", str(ckpt), *heads)
    assert code == 2, ranks.output()
    assert ranks.stderr(0).strip().splitlines() == [
        f"pretrain_gpt: error: --load {ckpt}: the checkpoint's model has num_attention_heads=4 but this run's has 8 "
        "(--num-attention-heads) (and 2 more): its weights would compute another model; give the checkpoint's "
        "value, or --finetune to start a new run from these weights"]
    code, ranks = _pretrain(tmp_path / "finetune", "--load", str(ckpt), *heads, "--finetune")
    assert code == 0, ranks.output()
    assert (f"--load {ckpt}: num_attention_heads was 4 in the checkpoint, 8 in this run (--num-attention-heads; "
            "a new run from these weights)") in ranks.logs[0].read_text()
