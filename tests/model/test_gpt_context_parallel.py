"""The GPT model at CP = 2 and 4 (and CP = 2 with TP = 2 and sequence parallelism) against the
CP = 1 model, both families, every --cp-comm-type: loss, logits and every parameter's
gradient (reduced by megalite.parallel.data over DP x CP), fp32, within 1e-5 relative; and
with position ids that restart mid-sequence (--reset-position-ids), and those together with
a document mask (--reset-attention-mask) for every comm type. With attention dropout on, the
CP = 4 runs of every comm type equal the CP = 2 ring run (the masks are a function of where
each probability sits, megalite.parallel.context.dropout) and differ from dropout off. At CP =
4, a2a+p2p with --hierarchical-context-parallel-sizes 2 2, both families, and a different comm
type per layer (Megatron's --cp-comm-type list), each layer's attention called with its own."""

import pytest
import torch

import megalite.model.attention as attention_module
from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel, masked_mean_loss
from megalite.model.pipeline_chunks import gpt_forward_step
from megalite.model.weights import gather_full_weights
from megalite.parallel import comm
from megalite.parallel.context import gather_sequence, split_sequence
from megalite.parallel.context.split import split_attention_mask
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.model.test_gpt_tp import SEQ, batch, compare, make_config, run_model

COMM_TYPES = ("p2p", "all_gather", "a2a")


def reset_positions():
    """Position ids restarting where documents begin (--reset-position-ids), a document
    crossing the chunk boundaries."""
    return torch.tensor([list(range(5)) + list(range(SEQ - 5)), list(range(11)) + list(range(SEQ - 11))])


def document_mask():
    """The --reset-attention-mask mask of the documents reset_positions() starts: [b, 1, s, s],
    True = masked out."""
    docs = (reset_positions() == 0).long().cumsum(1)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return ~(causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


def run_reference_with_positions(config, attention_mask=None):
    model = GPTModel(config, ParallelState.single(), init_seed=7)
    tokens, labels, mask = batch()
    loss = masked_mean_loss(model(tokens, position_ids=reset_positions(), labels=labels,
                                  attention_mask=attention_mask), mask)
    loss.backward()
    with torch.no_grad():
        logits = model(tokens, position_ids=reset_positions(), attention_mask=attention_mask)[..., :config.vocab_size]
    return {"loss": loss.detach(), "logits": logits, "grads": gather_full_weights(model, grads=True)}


def run_cp_model(config, state, position_ids=None, attention_mask=None):
    """Loss, gathered logits and full gradients of one CP forward/backward through
    gpt_forward_step and the DDP gradient buffers."""
    model = GPTModel(config, state, init_seed=7)
    ddp = DistributedDataParallel(model, state)
    tokens, labels, mask = (split_sequence(t, 1, state.cp_size, state.cp_rank) for t in batch())
    if position_ids is not None:
        position_ids = split_sequence(position_ids, 1, state.cp_size, state.cp_rank)
    if attention_mask is not None:
        attention_mask = split_attention_mask(attention_mask, state.cp_size, state.cp_rank)
    loss = gpt_forward_step(ddp, {"tokens": tokens, "labels": labels, "loss_mask": mask,
                                  "position_ids": position_ids, "attention_mask": attention_mask}, None)
    loss.backward()
    finalize_model_grads([ddp], state)
    for param in model.parameters():
        param.grad = param.main_grad.view_as(param)
    with torch.no_grad():
        logits = model(tokens, position_ids=position_ids, attention_mask=attention_mask)
        logits = comm.gather_dim(logits, -1, state.tp_group)[..., :config.vocab_size]
        logits = gather_sequence(logits, 1, state.cp_group)
    return {"loss": loss.detach(), "logits": logits, "grads": gather_full_weights(model, grads=True)}


def _cp_worker(rank, world_size):
    layouts = [ParallelLayout(world_size, context=world_size)]
    if world_size == 4:
        layouts.append(ParallelLayout(4, tensor=2, context=2))
    states = [ParallelState.create(layout) for layout in layouts]
    failures = []
    for family in ("gpt2", "llama"):
        reference = run_model(make_config(family), ParallelState.single())
        for state in states:
            for comm_type in COMM_TYPES:
                config = make_config(family, cp_comm_type=comm_type, sequence_parallel=state.tp_size > 1)
                what = f"{family} {comm_type} cp={state.cp_size} tp={state.tp_size}"
                try:
                    compare(run_cp_model(config, state), reference, what)
                except AssertionError as e:
                    failures.append(str(e))
    try:  # learned positions read the data's position ids (--reset-position-ids), split like the tokens
        compare(run_cp_model(make_config("gpt2"), states[0], reset_positions()),
                run_reference_with_positions(make_config("gpt2")), f"reset positions cp={world_size}")
    except AssertionError as e:
        failures.append(str(e))
    reference = run_reference_with_positions(make_config("llama"), document_mask())
    for comm_type in COMM_TYPES:  # documents split across chunks (--reset-attention-mask)
        try:
            compare(run_cp_model(make_config("llama", cp_comm_type=comm_type), states[0], reset_positions(),
                                 document_mask()), reference, f"document mask {comm_type} cp={world_size}")
        except AssertionError as e:
            failures.append(str(e))
    if world_size == 4:
        failures += _dropout_failures(states[0])
        failures += _per_layer_failures(states[0])
        for family in ("gpt2", "llama"):  # a2a+p2p: a2a inside pairs of CP ranks, a ring across the pairs
            try:
                compare(run_cp_model(make_config(family, cp_comm_type="a2a+p2p", cp_a2a_size=2), states[0]),
                        run_model(make_config(family), ParallelState.single()), f"{family} a2a+p2p 2 x 2")
            except AssertionError as e:
                failures.append(str(e))
    return failures


def _per_layer_failures(cp4_state):
    """Layer 0 and layer 1 with different comm types: equal to CP = 1, each layer's attention
    called with its own type (recorded around context_parallel_attention)."""
    failures, used = [], []
    original = attention_module.context_parallel_attention

    def recording(q, k, v, group, comm_type, *args, **kwargs):
        used.append(comm_type)
        return original(q, k, v, group, comm_type, *args, **kwargs)
    attention_module.context_parallel_attention = recording
    try:
        for family, types in (("gpt2", ("p2p", "a2a")), ("llama", ("all_gather", "a2a+p2p"))):
            used.clear()
            try:
                compare(run_cp_model(make_config(family, cp_comm_type=types, cp_a2a_size=2), cp4_state),
                        run_model(make_config(family), ParallelState.single()), f"{family} per layer {types}")
            except AssertionError as e:
                failures.append(str(e))
            if used[:2] != list(types):  # forward of layer 0, then layer 1
                failures.append(f"{family}: layers called context-parallel attention with {used[:2]}, not {types}")
    finally:
        attention_module.context_parallel_attention = original
    return failures


def _dropout_failures(cp4_state):
    cp2_state = ParallelState.create(ParallelLayout(4, context=2))
    config = make_config("llama", attention_dropout=0.3)
    torch.manual_seed(11)  # the seed each attention call draws (equal on every rank)
    reference = run_cp_model(config, cp2_state)
    failures = []
    if abs(reference["loss"] - run_model(make_config("llama"), ParallelState.single())["loss"]) < 1e-3:
        failures.append("attention dropout 0.3 left the CP loss unchanged")
    # selective recompute re-runs core attention: it must redraw the same seed (the tracker's fork)
    for comm_type, recompute in [(c, None) for c in COMM_TYPES] + [("p2p", "selective")]:
        torch.manual_seed(11)
        try:
            config = make_config("llama", attention_dropout=0.3, cp_comm_type=comm_type, recompute_granularity=recompute)
            compare(run_cp_model(config, cp4_state), reference,
                    f"attention dropout {comm_type} recompute={recompute} cp=4 against p2p cp=2")
        except AssertionError as e:
            failures.append(str(e))
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_model_matches_cp1(world_size):
    for failures in run_distributed(_cp_worker, world_size):
        assert not failures, failures


def test_per_layer_comm_types_are_one_per_layer():
    config = make_config("llama", cp_comm_type=["a2a", "p2p"])  # a list, as a config file holds it
    assert config.cp_comm_type == ("a2a", "p2p") and GPTConfig.from_dict(config.to_dict()) == config
    model = GPTModel(config, ParallelState.single())
    assert [layer.self_attention.cp_comm_type for layer in model.layers.values()] == ["a2a", "p2p"]
    with pytest.raises(ValueError, match="3 values for 2 layers"):
        make_config("llama", cp_comm_type=("a2a", "p2p", "p2p"))
    with pytest.raises(ValueError, match="'ring'"):
        make_config("llama", cp_comm_type=("a2a", "ring"))
