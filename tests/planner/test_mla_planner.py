"""The planner's terms for multi-latent attention and multi-token prediction: parameters per rank
equal those megalite builds (tied and untied, with and without a query latent, the MTP depths and
their copy of the embedding on the last stage, experts over EP); the activation memory adds the
MTP depths and their logits to the last stage only; a DeepSeek-V3 config.json becomes a workload
whose model flags rebuild it."""

import pytest

from megalite.model.config import GPTConfig
from megalite.planner.layouts import Layout
from megalite.planner.memory import rank_memory
from megalite.planner.parameters import rank_parameters
from tests.parallel.mla_harness import mla_config
from tests.planner.models import workload
from tests.planner.test_parameters import built

DEEPSEEK = mla_config(vocab_size=1000, hidden_size=32, num_layers=4)
VARIANTS = {
    "untied": DEEPSEEK,
    "tied-no-q-latent": DEEPSEEK.replace(untie_embeddings_and_output_weights=False,
                                         mla={**DEEPSEEK.mla.to_dict(), "q_lora_rank": None}),
    "learned-positions-dense": DEEPSEEK.replace(moe=None, position_embedding_type="learned_absolute"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("t, p, v", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 2, 2)])
def test_counts_equal_the_built_model(name, t, p, v):
    config = VARIANTS[name]
    ep = 2 if config.moe is not None else 1
    for rank in range(p):
        assert rank_parameters(config, t, p, v, rank, ep) == built(config, t, p, v, rank, ep), (name, rank)


def test_mtp_adds_to_the_last_stage_only():
    plain = workload(DEEPSEEK.replace(mtp_num_layers=None, moe=None), seq=64, batch=8)
    with_mtp = workload(DEEPSEEK.replace(moe=None), seq=64, batch=8)
    layout = Layout(tp=1, pp=2, vp=1, dp=1, micro_batch_size=1, schedule="1f1b")
    first = [rank_memory(w, layout, 0) for w in (plain, with_mtp)]
    last = [rank_memory(w, layout, 1) for w in (plain, with_mtp)]
    assert first[0].activations == first[1].activations and first[0].logits == first[1].logits
    assert last[1].activations > last[0].activations and last[1].logits == 3 * last[0].logits
    assert last[1].parameters > last[0].parameters


def test_deepseek_v3_hf_config_becomes_a_workload(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megalite.config.arguments import model_config_from_args, parse_args
    from megalite.planner.workload import from_hf_config

    hf = transformers.DeepseekV3Config(num_hidden_layers=4, first_k_dense_replace=1, hidden_size=256,
                                       n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                                        "original_max_position_embeddings": 4096, "mscale": 1.0,
                                                        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    path = tmp_path / "config.json"
    hf.to_json_file(path)
    work = from_hf_config(str(path), seq_length=4096, global_batch_size=64)
    rebuilt: GPTConfig = model_config_from_args(parse_args(work.model_flags + ["--seq-length", "4096"]),
                                                work.config.vocab_size)
    assert rebuilt.mla == work.config.mla and rebuilt.mtp_num_layers == work.config.mtp_num_layers == 1
    assert rebuilt.moe.to_dict() == work.config.moe.to_dict() | {"token_dispatcher_type": "alltoall"}
