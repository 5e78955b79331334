"""The planner's inputs and outputs in megalite's own terms: a model from Megatron flags, a
YAML --config or a Hugging Face config.json (the same GPTConfig megalite would build), layout
flags refused among the model's, and every enumerated layout's launch flags accepted by
pretrain_gpt's parser and validation with the same layout back."""

import json

import pytest

from megalite.checkpoint.hf.mapping import config_from_hf, hf_config_dict
from megalite.planner.layouts import Space, enumerate_layouts
from megalite.planner.workload import from_flags, from_hf_config
from megalite.config.arguments import layout_from_args, model_config_from_args, parse_args, validate_args
from megalite.model.moe_config import MoEConfig
from tests.planner.models import LLAMA

MIXTRAL = LLAMA.replace(qk_layernorm=False, moe=MoEConfig(num_experts=4, ffn_hidden_size=176, router_topk=2))

FLAGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
         "--ffn-hidden-size 176 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
         "--untie-embeddings-and-output-weights --seq-length 128 --global-batch-size 16 --bf16 "
         "--tokenizer-type NullTokenizer --vocab-size 999").split()


def test_flags_and_yaml_give_the_model_megalite_builds(tmp_path):
    w = from_flags(FLAGS)
    assert (w.seq_length, w.global_batch_size, w.precision) == (128, 16, "bf16")
    assert w.config == model_config_from_args(parse_args(FLAGS), 1000)
    yaml = tmp_path / "m.yaml"
    pairs = [(FLAGS[i][2:], FLAGS[i + 1]) if i + 1 < len(FLAGS) and not FLAGS[i + 1].startswith("--") else (FLAGS[i][2:], "true")
             for i in range(len(FLAGS)) if FLAGS[i].startswith("--")]
    yaml.write_text("".join(f"{k}: {v}\n" for k, v in pairs))
    from_yaml = from_flags(["--config", str(yaml)], seq_length=256)
    assert from_yaml.config == w.config.replace(max_position_embeddings=256) and from_yaml.seq_length == 256
    assert "--seq-length" not in w.model_flags and "--global-batch-size" not in w.model_flags


@pytest.mark.parametrize("flag", ["--tensor-model-parallel-size 2", "--sequence-parallel", "--micro-batch-size 2",
                                  "--recompute-granularity full", "--use-distributed-optimizer",
                                  "--pipeline-model-parallel-layout Et|tL"])
def test_layout_flags_among_the_model_are_refused(flag):
    with pytest.raises(ValueError, match="the planner chooses the layout"):
        from_flags(FLAGS + flag.split())


def test_missing_batch_or_tokenizer_is_named():
    with pytest.raises(ValueError, match="--global-batch-size is required"):
        from_flags([f for f in FLAGS if f not in ("--global-batch-size", "16")])
    with pytest.raises(ValueError, match="need a tokenizer"):
        from_flags(FLAGS[:-4])


@pytest.mark.parametrize("config", [LLAMA, MIXTRAL])
def test_hugging_face_config(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config_dict(config)))
    w = from_hf_config(str(path), 128, 16, "bf16")
    expected = config_from_hf(hf_config_dict(config))
    assert w.config.num_layers == expected.num_layers and w.config.moe == expected.moe
    # the printed model flags rebuild the same model (with the all-to-all dispatcher the planner's
    # expert-parallel model assumes)
    args = parse_args(w.model_flags + ["--seq-length", "128"])
    rebuilt = model_config_from_args(args, w.config.vocab_size).to_dict()
    expected = w.config.to_dict()
    if config.moe is not None:
        assert rebuilt["moe"].pop("token_dispatcher_type") == "alltoall"
        expected["moe"].pop("token_dispatcher_type")
    assert rebuilt == expected
    with pytest.raises(ValueError, match="--hf-config .*: not valid JSON"):
        path.write_text("{")
        from_hf_config(str(path), 128, 16)


@pytest.mark.parametrize("world", [4, 8])
def test_every_layout_is_one_pretrain_gpt_accepts(world):
    w = from_flags(FLAGS)
    run = ["--mock-data", "--lr", "1e-4", "--train-iters", "1"]
    layouts = list(enumerate_layouts(w, world, Space(schedules=["default", "zb_h1"])))
    assert len(layouts) > 20
    assert {lay.tp for lay in layouts} == {1, 2} and {lay.pp for lay in layouts} >= {1, 2, 4}
    for lay in layouts:
        args = parse_args(w.model_flags + ["--seq-length", "128", "--global-batch-size", "16"] + lay.flags() + run)
        validate_args(args, world)
        parallel = layout_from_args(args, world)
        assert (parallel.tensor, parallel.pipeline, parallel.virtual_pipeline, parallel.data) == \
            (lay.tp, lay.pp, lay.vp, lay.dp), lay
        assert args.num_micro_batches == lay.num_microbatches(16)
        assert args.sequence_parallel == lay.sequence_parallel and args.use_distributed_optimizer == lay.distributed_optimizer
