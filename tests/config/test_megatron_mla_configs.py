"""Megatron-LM's functional tests of multi-latent attention run their flags unchanged in
megalite: tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp2_mla/model_config.yaml and its
twin gpt3_mcore_te_tp2_pp2_mla_1node/model_config.yaml (byte-identical files), vendored below
from Megatron-LM commit ab16414a20a539d9530d8f0986d35423ccb95025 (the last to touch them; HEAD
d98e8a64ddf34856e74b24714e3bedb2f5a39553), nothing downloaded at test time. Only the harness's
${...} placeholders are filled with paths. They parse, validate at TP=2 PP=2 (4 processes),
build the GPTConfig Megatron builds (MLA with YaRN at factor 1, learned absolute positions beside
it, bf16) and print one start-up line per flag megalite serves another way."""

import math

from megalite.config.arguments import model_config_from_args, parse_args
from megalite.config.validate import validate_args
from megalite.config.run_config import startup_notes

SOURCE_COMMIT = "ab16414a20a539d9530d8f0986d35423ccb95025"
MODEL_ARGS = {
    '--num-layers': 4,
    '--hidden-size': 512,
    '--num-attention-heads': 8,
    '--multi-latent-attention': True,
    '--q-lora-rank': 192,
    '--kv-lora-rank': 64,
    '--qk-head-dim': 16,
    '--qk-pos-emb-head-dim': 8,
    '--v-head-dim': 16,
    '--log-params-norm': True,
    '--log-num-zeros-in-grad': True,
    '--log-validation-ppl-to-tensorboard': True,
    '--log-timers-to-tensorboard': True,
    '--tensorboard-dir': '${TENSORBOARD_PATH}',
    '--micro-batch-size': 4,
    '--global-batch-size': 32,
    '--seq-length': 1024,
    '--max-position-embeddings': 1024,
    '--train-iters': 50,
    '--timing-log-level': 0,
    '--lr-decay-iters': 320000,
    '--save': '${CHECKPOINT_SAVE_PATH}',
    '--load': '${CHECKPOINT_LOAD_PATH}',
    '--data-path': '${DATA_PATH}/text/common_pile/v01_filtered_data/my-gpt3_00_text_document',
    '--vocab-file': '${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/vocab.json',
    '--merge-file': '${DATA_PATH}/text/common_pile/v01_filtered_data/bpe/merges.txt',
    '--split': '949,50,1',
    '--distributed-backend': 'nccl',
    '--lr': 0.00015,
    '--lr-decay-style': 'cosine',
    '--min-lr': 1e-05,
    '--weight-decay': '1e-2',
    '--clip-grad': 1.0,
    '--lr-warmup-fraction': 0.01,
    '--log-interval': 1,
    '--save-interval': 25,
    '--eval-interval': 1000,
    '--eval-iters': 10,
    '--transformer-impl': 'transformer_engine',
    '--tensor-model-parallel-size': 2,
    '--pipeline-model-parallel-size': 2,
    '--sequence-parallel': True,
    '--untie-embeddings-and-output-weights': True,
    '--deterministic-mode': True,
    '--no-gradient-accumulation-fusion': True,
    '--attention-softmax-in-fp32': True,
    '--use-mcore-models': True,
    '--ckpt-format': 'torch_dist',
    '--data-cache-path': '${DATA_CACHE_PATH}',
    '--bf16': True,
    '--attention-backend': 'unfused',
    '--log-memory-to-tensorboard': True,
    '--async-save': True,
    '--use-persistent-ckpt-worker': True,
}
PLACEHOLDERS = {"${TENSORBOARD_PATH}": "tb", "${CHECKPOINT_SAVE_PATH}": "ckpt", "${CHECKPOINT_LOAD_PATH}": "ckpt",
                "${DATA_PATH}": "data", "${DATA_CACHE_PATH}": "cache"}


def argv(root) -> list[str]:
    out = []
    for flag, value in MODEL_ARGS.items():
        if value is True:
            out.append(flag)
            continue
        text = str(value)
        for placeholder, folder in PLACEHOLDERS.items():
            text = text.replace(placeholder, str(root / folder))
        out += [flag, text]
    return out


def test_functional_test_flags_validate_unchanged(tmp_path):
    args = parse_args(argv(tmp_path))
    validate_args(args, 4)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (2, 2, 1)
    config = model_config_from_args(args, 50257)
    mla = config.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.qk_pos_emb_head_dim, mla.v_head_dim) == \
        (192, 64, 16, 8, 16)
    assert (mla.rope_type, mla.rotary_scaling_factor, mla.concentration()) == ("yarn", 1.0, 1.0)
    assert math.isclose(mla.softmax_scale(), (16 + 8) ** -0.5)  # Megatron's MLA default: YaRN, at factor 1 RoPE
    assert config.position_embedding_type == "learned_absolute" and not config.qk_layernorm
    assert config.sequence_parallel and config.params_dtype == "bfloat16" and config.attention_backend == "unfused"
    notes = startup_notes(args)
    assert any(line.startswith("--transformer-impl transformer_engine") for line in notes)
