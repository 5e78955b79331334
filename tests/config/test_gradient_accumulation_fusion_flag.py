"""--gradient-accumulation-fusion / --no-gradient-accumulation-fusion at the config boundary:
on by default (Megatron's default), off with the negative flag, what ParallelConfig hands
DistributedDataParallel (whose behaviour tests/parallel/tensor/test_gradient_accumulation_fusion.py
checks), FSDP2's fallback note and its refusal of the explicit flag, the --torch-compile note.

Megatron's behaviour: megatron/training/arguments.py has --no-gradient-accumulation-fusion
(store_false into gradient_accumulation_fusion, default True) and asserts
`not args.gradient_accumulation_fusion` with --use-torch-fsdp2.
"""

import pytest

from megalite.config.run_config import ParallelConfig, startup_notes
from tests.config.test_arguments import parsed, refused

FSDP2 = "--use-torch-fsdp2 --ckpt-format torch_dist --untie-embeddings-and-output-weights"


@pytest.mark.parametrize("extra, world, fused", [
    ("", 1, True),
    ("--gradient-accumulation-fusion", 1, True),
    ("--no-gradient-accumulation-fusion", 1, False),
    ("--use-distributed-optimizer --bf16", 2, True),
    (FSDP2, 2, False),
    (FSDP2 + " --no-gradient-accumulation-fusion", 2, False),
])
def test_what_the_data_parallel_wrapper_is_told(extra, world, fused):
    assert ParallelConfig.from_args(parsed(extra, world), world).gradient_accumulation_fusion is fused


def test_fsdp2_refuses_the_explicit_flag_by_name():
    message = refused(FSDP2 + " --gradient-accumulation-fusion", 2)
    assert "--gradient-accumulation-fusion" in message and "FSDP2" in message


def test_both_forms_together_contradict():
    assert "contradict" in refused("--gradient-accumulation-fusion --no-gradient-accumulation-fusion")


@pytest.mark.parametrize("extra, world, words", [
    (FSDP2, 2, "off under FSDP2"),
    ("--torch-compile", 1, "not inside the --torch-compile regions"),
])
def test_where_the_default_does_not_apply_one_line_says_so(extra, world, words):
    notes = [n for n in startup_notes(parsed(extra, world)) if "gradient accumulation fusion" in n]
    assert len(notes) == 1 and words in notes[0], notes


@pytest.mark.parametrize("extra, world", [("", 1), ("--no-gradient-accumulation-fusion", 1),
                                          (FSDP2 + " --no-gradient-accumulation-fusion", 2),
                                          ("--no-gradient-accumulation-fusion --torch-compile", 1)])
def test_no_note_where_the_flag_does_what_it_says(extra, world):
    assert not [n for n in startup_notes(parsed(extra, world)) if "accumulation fusion" in n]
