"""Shared pieces of the pipeline executor tests: small GPT-2 and Llama configurations, the
micro-batches, and the single-device control run every pipelined run is compared against."""

import torch
import torch.distributed as dist

from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel, masked_mean_loss
from megalite.model.weights import gather_full_weights
from megalite.parallel.state import ParallelState
from tests.numerics import assert_rel_close

TOL = 1e-5
NUM_LAYERS, HIDDEN, VOCAB, SEQ, MICRO_BATCH = 8, 32, 100, 8, 2
INIT_SEED = 11
FAMILIES = ("gpt2", "llama")


def make_config(family: str, **overrides) -> GPTConfig:
    """GPT-2 (tied embeddings, learned positions, biases incl. a deferred fc1 bias) or Llama
    (untied, RoPE, SwiGLU, RMSNorm, GQA, no biases); fp32, dropout off."""
    common = dict(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=4,
                  vocab_size=VOCAB, max_position_embeddings=SEQ, attention_dropout=0.0,
                  hidden_dropout=0.0)
    if family == "gpt2":
        family_cfg = dict(activation="openai_gelu")
    else:
        family_cfg = dict(num_query_groups=2, ffn_hidden_size=48, activation="swiglu",
                          normalization="RMSNorm", position_embedding_type="rope",
                          add_bias_linear=False, untie_embeddings_and_output_weights=True)
    return GPTConfig(**{**common, **family_cfg, **overrides})


def microbatches(num_microbatches: int, seed: int = 0) -> list[dict]:
    """Micro-batches of tokens, labels and a loss mask with zeros (varying token counts)."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = []
    for _ in range(num_microbatches):
        out.append(dict(tokens=torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g),
                        labels=torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g),
                        loss_mask=(torch.rand(MICRO_BATCH, SEQ, generator=g) > 0.3).float()))
    return out


def reference_run(config: GPTConfig, batches: list[list[dict]]) -> dict:
    """The control: one device, no pipeline. `batches` holds one list of micro-batches per
    data-parallel replica; the loss is the mean over all micro-batches of each one's masked
    mean, as the pipelined step averaged over data-parallel replicas computes it."""
    model = GPTModel(config, ParallelState.single(), init_seed=INIT_SEED)
    count = sum(len(b) for b in batches)
    losses = []
    for replica in batches:
        for mb in replica:
            loss = masked_mean_loss(model(mb["tokens"], labels=mb["labels"]), mb["loss_mask"])
            (loss / count).backward()
            losses.append(loss.detach())
    return {"loss": torch.stack(losses).mean(), "grads": gather_full_weights(model, grads=True),
            "params": gather_full_weights(model)}


def all_reduce_shared_embedding_grads(chunks, pstate: ParallelState) -> None:
    """Without DistributedDataParallel: what finalize_model_grads does for tied embeddings."""
    if pstate.pp_size == 1:
        return
    for chunk in chunks:
        for param in chunk.parameters():
            if getattr(param, "shared_embedding", False) and param.grad is not None:
                dist.all_reduce(param.grad, group=pstate.embedding_group)


def compare_grads(rank_grads: list[dict], reference: dict, what: str) -> None:
    """Every rank's gradients against the control by global name; together the ranks must
    cover every parameter (a tied embedding is checked on the first and the last stage)."""
    covered = set()
    for grads in rank_grads:
        for name, grad in grads.items():
            assert name in reference["grads"], f"{what}: unexpected parameter {name}"
            expected = reference["grads"][name]
            if "word_embeddings" in name or "output_layer" in name:
                # the vocabulary padding depends on the TP size; compare the real rows
                grad, expected = grad[:VOCAB], expected[:VOCAB]
            assert_rel_close(grad, expected, TOL, f"{what} grad {name}")
            covered.add(name)
    missing = set(reference["grads"]) - covered
    assert not missing, f"{what}: no rank reported gradients of {sorted(missing)}"
