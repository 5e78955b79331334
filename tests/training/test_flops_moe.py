"""FLOPs and the memory report of MoE models: P_mm counts the router, the top-k experts and
the shared expert of each MoE layer (every expert with activated=False, which equals the
model's own matmul weights); the memory report counts every local expert's parameters."""


from megalite.model.gpt import GPTModel
from megalite.optimizer.memory_report import memory_report
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.state import ParallelState
from megalite.training.flops import flops_per_token, matmul_parameters
from tests.model.moe_reference import tiny_config


def _model_matmul_weights(model, expert_fraction=1.0):
    total = 0.0
    for name, p in model.named_parameters():
        if p.ndim != 2 or "word_embeddings" in name:
            continue
        total += p.numel() * (expert_fraction if ".local_experts." in name else 1.0)
    return total


def test_flops_count_activated_experts_only():
    config = tiny_config(num_layers=4, layer_freq=2, router_topk=2, shared_expert_intermediate_size=20,
                         shared_expert_gate=True)
    model = GPTModel(config)
    vocab = model.padded_vocab
    assert matmul_parameters(config, vocab, activated=False) == _model_matmul_weights(model)
    assert matmul_parameters(config, vocab) == _model_matmul_weights(model, 2 / 8)
    dense = config.replace(moe=None)
    moe_layer_extra = 16 * 8 + 2 * 3 * 16 * 24 + 3 * 16 * 20 + 16 - 3 * 16 * 32  # per MoE layer vs dense MLP
    assert flops_per_token(config, 32, vocab) == flops_per_token(dense, 32, vocab) + 6 * 2 * moe_layer_extra


def test_memory_report_counts_every_local_expert():
    config = tiny_config(num_layers=2)
    pstate = ParallelState.single()
    chunk = DistributedDataParallel(GPTModel(config), pstate)
    optimizer = build_optimizer([chunk], pstate, lr=1e-3)
    info, line = memory_report([chunk], optimizer, pstate)
    assert info["expert_params"] == 2 * 8 * (3 * 16 * 24) and "in this rank's experts" in line
    assert info["num_params"] == sum(p.numel() for p in chunk.module.parameters())
