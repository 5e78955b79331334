"""Context-parallel options: the defaults run, the options reach the layout and the model, and
shapes a layout cannot split stop with one line naming the flags."""

import pytest

from tests.config.test_arguments import parsed, refused


def test_defaults_run():
    args = parsed("--context-parallel-size 1 --expert-model-parallel-size 1 --attention-backend auto", 1)
    assert (args.context_parallel_size, args.num_experts, args.attention_backend) == (1, None, "auto")


def test_context_parallel_options_reach_the_layout_and_model():
    from megalite.config.arguments import layout_from_args, model_config_from_args

    args = parsed("--context-parallel-size 2 --attention-dropout 0 --cp-comm-type a2a --tensor-model-parallel-size 2", 8)
    layout = layout_from_args(args, 8)
    assert (layout.context, layout.data, args.data_parallel_size) == (2, 2, 2)
    assert layout.cp_groups()[0] == [0, 2]  # TP innermost, then CP
    assert model_config_from_args(args, 100).cp_comm_type == "a2a"
    assert model_config_from_args(args, 100).cp_a2a_size == 1
    # attention dropout (default 0.1) and document masks run under CP; a2a+p2p reaches the model
    args = parsed("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 "
                  "--reset-attention-mask", 8)
    config = model_config_from_args(args, 100)
    assert (config.cp_comm_type, config.cp_a2a_size, config.attention_dropout) == ("a2a+p2p", 2, 0.1)
    # one comm type per layer, as Megatron's list (BASE has 4 layers)
    args = parsed("--context-parallel-size 4 --cp-comm-type p2p a2a all_gather a2a+p2p "
                  "--hierarchical-context-parallel-sizes 2 2", 8)
    config = model_config_from_args(args, 100)
    assert (config.cp_comm_type, config.cp_a2a_size) == (("p2p", "a2a", "all_gather", "a2a+p2p"), 2)
    assert [config.cp_comm_type_for(n) for n in range(4)] == ["p2p", "a2a", "all_gather", "a2a+p2p"]
    mapped = layout_from_args(parsed("--context-parallel-size 2 --attention-dropout 0 "
                                     "--pipeline-model-parallel-size 2 --use-tp-pp-dp-mapping", 8), 8)
    assert mapped.pp_groups()[0] == [0, 2] and mapped.dp_groups()[0] == [0, 4]


@pytest.mark.parametrize("extra, words", [
    ("--context-parallel-size 2 --attention-dropout 0 --seq-length 30", ["--seq-length 30", "2 x --context-parallel-size", "= 4"]),
    ("--context-parallel-size 4 --attention-dropout 0 --cp-comm-type a2a --num-attention-heads 2 --hidden-size 64",
     ["--cp-comm-type a2a", "--num-attention-heads 2"]),
    ("--context-parallel-size 4 --cp-comm-type a2a+p2p", ["--cp-comm-type a2a+p2p", "--hierarchical-context-parallel-sizes"]),
    ("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 3",
     ["--hierarchical-context-parallel-sizes 2 3", "--context-parallel-size 4"]),
    ("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 4",
     ["--hierarchical-context-parallel-sizes 4", "two"]),
    ("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 x",
     ["--hierarchical-context-parallel-sizes", "integers"]),
    ("--context-parallel-size 4 --hierarchical-context-parallel-sizes 2 2", ["--hierarchical-context-parallel-sizes",
                                                                             "a2a+p2p"]),
    ("--context-parallel-size 4 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 4 1 "
     "--num-attention-heads 2 --hidden-size 64", ["--cp-comm-type a2a+p2p", "--num-attention-heads 2"]),
    ("--context-parallel-size 2 --cp-comm-type p2p a2a p2p", ["--cp-comm-type p2p a2a p2p", "3 values",
                                                              "--num-layers 4"]),
    ("--context-parallel-size 4 --cp-comm-type p2p a2a p2p p2p --num-attention-heads 2 --hidden-size 64",
     ["--cp-comm-type a2a", "--num-attention-heads 2"]),
    ("--context-parallel-size 4 --cp-comm-type p2p a2a+p2p p2p p2p", ["a2a+p2p", "--hierarchical-context-parallel-sizes"]),
])
def test_context_parallel_shapes_refused(extra, words):
    message = refused(extra, 8)
    assert "\n" not in message and all(w in message for w in words), message
