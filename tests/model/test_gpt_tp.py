"""The GPT model at TP = 2 and 4, with and without sequence parallelism, against the TP = 1
model: loss, logits and every parameter's gradient (gathered), fp32, dropout off, within 1e-5
relative. With dropout on, runs with the same seed are identical, and recompute (selective and
full) replays dropout exactly."""

import pytest
import torch

from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel, masked_mean_loss
from megalite.model.weights import gather_full_weights
from megalite.parallel import comm
from megalite.parallel.random import MODEL_PARALLEL_RNG, seed_everything
from megalite.parallel.sharding import all_reduce_sequence_parallel_grads
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.parallel.refusals import value_error_messages
from tests.numerics import assert_rel_close, rel_error

TOL = 1e-5
VOCAB, BATCH, SEQ = 250, 2, 16


def make_config(family: str, **overrides) -> GPTConfig:
    common = dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=VOCAB,
                  max_position_embeddings=SEQ, attention_dropout=0.0, hidden_dropout=0.0)
    if family == "gpt2":
        family_cfg = dict(activation="openai_gelu")
    else:
        family_cfg = dict(num_query_groups=4, ffn_hidden_size=96, activation="swiglu", normalization="RMSNorm",
                          position_embedding_type="rope", add_bias_linear=False,
                          untie_embeddings_and_output_weights=True)
    return GPTConfig(**{**common, **family_cfg, **overrides})


def batch(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.2).float()
    return tokens.to(device), labels.to(device), mask.to(device)


def run_model(config, state, tracker=None, train=False, device="cpu"):
    """Loss, vocabulary-gathered logits and full gradients of one forward/backward."""
    model = GPTModel(config, state, rng_tracker=tracker, init_seed=7, device=device)
    model.train(train)
    tokens, labels, mask = batch(device=device)
    losses = model(tokens, labels=labels)
    loss = masked_mean_loss(losses, mask)
    loss.backward()
    all_reduce_sequence_parallel_grads(model.parameters(), state.tp_group)
    with torch.no_grad():
        logits = comm.gather_dim(model(tokens), -1, state.tp_group)[..., :VOCAB]
    return {"loss": loss.detach(), "logits": logits, "grads": gather_full_weights(model, grads=True),
            "vocab_rows": (model.embedding.word_embeddings.weight.shape[0],
                           model.output_weight().shape[0])}


def compare(result, reference, what):
    assert_rel_close(result["loss"], reference["loss"], TOL, f"{what} loss")
    assert_rel_close(result["logits"], reference["logits"], TOL, f"{what} logits")
    assert set(result["grads"]) == set(reference["grads"]), what
    for name, grad in reference["grads"].items():
        ours = result["grads"][name]
        assert_rel_close(ours[: grad.shape[0]] if "word_embeddings" in name or "output_layer" in name else ours,
                         grad[: ours.shape[0]] if "word_embeddings" in name or "output_layer" in name else grad,
                         TOL, f"{what} grad {name}")


def rng_streams(config, state):
    """One TP training step with dropout, recording what the RNG streams did: the default
    generator's state before and after, the tracker's TP-rank stream before and after,
    tracker.fork calls per module, and the embedding's and each layer's output."""
    tracker = seed_everything(99, tp_rank=state.tp_rank)
    model = GPTModel(config, state, rng_tracker=tracker, init_seed=7)
    model.train()
    forks = {"other": 0}
    fork, current = tracker.fork, ["other"]

    def counting_fork(*args, **kwargs):
        forks[current[0]] += 1
        return fork(*args, **kwargs)

    tracker.fork = counting_fork
    outputs = {}

    def entered(name):
        def hook(module, args):
            current[0] = name
        return hook

    def left(name):
        def hook(module, args, output):
            outputs[name], current[0] = output.detach().clone(), "other"
        return hook

    for name, module in [("embedding", model.embedding)] + [(f"layers.{n}", m) for n, m in model.layers.items()]:
        forks[name] = 0
        module.register_forward_pre_hook(entered(name))
        module.register_forward_hook(left(name))
    tokens, labels, mask = batch()
    default_before, tracker_before = torch.get_rng_state(), tracker.get_states()[MODEL_PARALLEL_RNG]
    masked_mean_loss(model(tokens, labels=labels), mask).backward()
    return {"default": (default_before, torch.get_rng_state()),
            "tracker": (tracker_before, tracker.get_states()[MODEL_PARALLEL_RNG]),
            "forks": forks, "outputs": outputs}


def refused_models(state):
    """The ValueError messages of models this TP layout cannot shard."""
    return value_error_messages(
        lambda: GPTModel(make_config("gpt2", hidden_size=48, num_attention_heads=3), state),
        lambda: GPTModel(make_config("gpt2", num_attention_heads=4, num_query_groups=1), state))


def _tp_worker(rank, world_size):
    out = {}
    states = {tp: ParallelState.create(ParallelLayout(world_size, tensor=tp)) for tp in (2, 4)}
    out[("refused", rank)] = refused_models(states[2])
    for family in ("gpt2", "llama"):
        for sp in (False, True):
            cfg = make_config(family, sequence_parallel=sp, attention_dropout=0.2, hidden_dropout=0.2)
            out[("rng", family, sp, rank)] = rng_streams(cfg, states[2])
    for family in ("gpt2", "llama"):
        for tp, state in states.items():
            for sp in (False, True):
                result = run_model(make_config(family, sequence_parallel=sp), state)
                if state.tp_rank == 0:
                    out[(family, tp, sp)] = result
    # Dropout on, TP=2 with sequence parallelism: same seed twice, and recompute replays it.
    state = states[2]
    for family in ("gpt2", "llama"):
        for recompute in (None, None, "selective", "full"):
            cfg = make_config(family, sequence_parallel=True, attention_dropout=0.2, hidden_dropout=0.2,
                              recompute_granularity=recompute)
            tracker = seed_everything(99, tp_rank=state.tp_rank)
            result = run_model(cfg, state, tracker, train=True)
            if state.tp_rank == 0:
                out.setdefault((family, "dropout"), []).append(result)
    return out


@pytest.fixture(scope="module")
def tp_results():
    merged = {}
    for rank_result in run_distributed(_tp_worker, 4):
        merged.update(rank_result)  # TP ranks 0 of each DP replica agree; keep any
    return merged


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_matches_single_device(tp_results, family, tp, sp):
    reference = run_model(make_config(family), ParallelState.single())
    compare(tp_results[(family, tp, sp)], reference, f"{family} TP={tp} SP={sp}")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_dropout_is_reproducible_and_recompute_replays_it(tp_results, family):
    first, second, selective, full = tp_results[(family, "dropout")]
    assert torch.equal(first["loss"], second["loss"])
    for name in first["grads"]:
        assert torch.equal(first["grads"][name], second["grads"][name]), name
    no_dropout = tp_results[(family, 2, True)]
    assert abs(first["loss"].item() - no_dropout["loss"].item()) > 1e-4, "dropout had no effect"
    compare(selective, first, f"{family} selective recompute with dropout")
    compare(full, first, f"{family} full recompute with dropout")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("granularity, method, num", [("selective", "uniform", None), ("full", "uniform", 1),
                                                      ("full", "uniform", 2), ("full", "block", 1)])
def test_recompute_matches_no_recompute(family, granularity, method, num, device):
    """With dropout on, recompute replays every mask, from the default generator and from
    the tracker's stream (on CUDA: the device's generators)."""
    state = ParallelState.single()
    cfg = dict(attention_dropout=0.1, hidden_dropout=0.1, fused_kernels=False)
    reference = run_model(make_config(family, **cfg), state, seed_everything(5, device=device), train=True,
                          device=device)
    no_dropout = run_model(make_config(family, fused_kernels=False), state, device=device)
    assert max(rel_error(grad, no_dropout["grads"][name]) for name, grad in reference["grads"].items()) > 0.1, \
        "dropout had no effect"
    result = run_model(make_config(family, recompute_granularity=granularity, recompute_method=method,
                                   recompute_num_layers=num, **cfg), state, seed_everything(5, device=device),
                       train=True, device=device)
    compare(result, reference, f"{family} {granularity}/{method}/{num} on {device}")


def test_models_this_layout_cannot_shard_are_refused(tp_results):
    """At TP=2, GPTModel itself refuses heads or query groups TP cannot split."""
    for rank in range(4):
        assert tp_results[("refused", rank)] == [
            "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2",
            "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2",
        ]


@pytest.mark.parametrize("shape, message", [
    (dict(hidden_size=64, num_attention_heads=6), "--hidden-size 64 is not divisible by --num-attention-heads 6"),
    (dict(num_attention_heads=8, num_query_groups=3), "--num-attention-heads 8 is not divisible by --num-query-groups 3"),
    (dict(num_query_groups=16), "--num-attention-heads 8 is not divisible by --num-query-groups 16"),
    (dict(num_attention_heads=0), "--num-attention-heads must be a positive integer, got 0"),
])
def test_config_refuses_impossible_shapes(shape, message):
    with pytest.raises(ValueError, match=message):
        make_config("gpt2", **shape)


def test_explicit_kv_channels_need_not_divide_hidden():
    config = make_config("gpt2", hidden_size=64, num_attention_heads=6, kv_channels=10)
    assert config.kv_channels == 10
    model = GPTModel(config, ParallelState.single())
    assert model.layers["0"].self_attention.linear_qkv.weight.shape == (3 * 6 * 10, 64)
    tokens, labels, _ = batch()
    assert torch.isfinite(model(tokens, labels=labels)).all()


def test_vocabulary_padding(tp_results):
    """The vocabulary is padded to a multiple of --make-vocab-size-divisible-by x TP."""
    assert [make_config("gpt2").padded_vocab_size(tp) for tp in (1, 2, 4)] == [256, 256, 512]
    assert [make_config("gpt2", vocab_size=256).padded_vocab_size(tp) for tp in (1, 2, 4)] == [256, 256, 512]
    assert [make_config("gpt2", make_vocab_size_divisible_by=1).padded_vocab_size(tp)
            for tp in (1, 2, 4)] == [250, 250, 252]
    assert [make_config("gpt2", make_vocab_size_divisible_by=8).padded_vocab_size(tp)
            for tp in (1, 2, 4)] == [256, 256, 256]
    for tp, padded in ((2, 256), (4, 512)):
        for family in ("gpt2", "llama"):
            # the shards of the word embedding and of the output layer cover the padded vocabulary
            assert tp_results[(family, tp, False)]["vocab_rows"] == (padded // tp, padded // tp)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("sp", [False, True])
def test_dropout_draws_from_the_right_stream(tp_results, family, sp):
    """Dropout inside a TP region (attention probabilities of this rank's heads), and with
    sequence parallelism every dropout (each rank holds other tokens), draws from the
    tracker's per-TP-rank stream; dropout on activations replicated over TP draws from the
    default generator, identically on every TP rank."""
    layout = ParallelLayout(4, tensor=2)
    for tp_group in layout.tp_groups():
        runs = [tp_results[("rng", family, sp, rank)] for rank in tp_group]
        layers = [name for name in runs[0]["forks"] if name.startswith("layers.")]
        assert len(layers) == 2
        for run in runs:
            # the step drew from each rank's TP stream; those streams differ between TP ranks
            assert not torch.equal(*run["tracker"])
            assert run["forks"] == {"other": 0, "embedding": int(sp), **{n: 3 if sp else 1 for n in layers}}
            before, after = run["default"]
            # with sequence parallelism nothing draws from the default generator
            assert torch.equal(before, after) == sp
        assert not torch.equal(runs[0]["tracker"][1], runs[1]["tracker"][1])
        assert torch.equal(runs[0]["default"][1], runs[1]["default"][1])
        dropped = [run["outputs"]["embedding"] == 0 for run in runs]
        assert all(d.float().mean() > 0.1 for d in dropped), "embedding dropout dropped nothing"
        if sp:  # each rank's tokens get their own mask
            assert not torch.equal(dropped[0], dropped[1])
        else:  # replicated activations stay identical on every TP rank through every dropout
            for name in ["embedding"] + layers:
                assert torch.equal(runs[0]["outputs"][name], runs[1]["outputs"][name]), name
