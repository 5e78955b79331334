"""The megalite model loaded from a converted checkpoint against transformers on the same input
(fp32): logits within 1e-4 max abs at TP=1 and TP=2; greedy generation with the KV cache equals
generation without it and transformers' `generate`, token for token. At TP=2 the converted
checkpoint's DCP chunks are exactly those save_checkpoint writes from the loaded model."""

import pytest
import torch

from megalite.parallel.state import ParallelState
from megalite.checkpoint.dcp.format import read_metadata_file
from megalite.checkpoint.dcp.checkpoint import iteration_dir, read_tracker
from tests.convert.hf_models import FAMILIES, hf_model, hf_to_megalite, save_hf, tokens
from tests.convert.workers import NEW_TOKENS, PROMPT, megalite_outputs, tp2_parity_worker
from tests.distributed import run_distributed

transformers = pytest.importorskip("transformers")

LOGITS_TOL = 1e-4


def hf_greedy(model, prompt, new_tokens):
    model.generation_config.eos_token_id = None  # run the full length, as megalite without eod
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check(family, hf, result):
    with torch.no_grad():
        reference = hf(tokens()).logits
    diff = (result["logits"] - reference).abs().max().item()
    assert diff <= LOGITS_TOL, f"{family}: logits differ from transformers' by {diff:.2e}"
    assert result["cached"] == result["uncached"], f"{family}: KV-cache generation differs from the full recompute"
    assert result["cached"] == hf_greedy(hf, PROMPT, NEW_TOKENS), f"{family}: greedy tokens differ from transformers'"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{family: (hf model, checkpoint at TP=2 PP=2, checkpoint at TP=2 PP=1)}."""
    root = tmp_path_factory.mktemp("parity")
    out = {}
    for family in FAMILIES:
        model = hf_model(family, seed=7)
        hf_dir = save_hf(model, root / f"{family}-hf")
        out[family] = (model, hf_to_megalite(hf_dir, root / f"{family}-tp2pp2", tp=2, pp=2),
                       hf_to_megalite(hf_dir, root / f"{family}-tp2", tp=2))
    return root, out


@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_matches_transformers(converted, family):
    _, cases = converted
    hf, ckpt, _ = cases[family]
    check(family, hf, megalite_outputs(ckpt, ParallelState.single()))


def _chunks(ckpt) -> dict:
    meta = read_metadata_file(iteration_dir(ckpt, read_tracker(ckpt)) / ".metadata").state_dict_metadata
    return {k: (tuple(v.size), v.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
            for k, v in meta.items()}


def test_tp2_matches_transformers_and_save_checkpoint(converted):
    root, cases = converted
    results = run_distributed(tp2_parity_worker, 2, {f: (c[1], c[2]) for f, c in cases.items()}, str(root))
    for family, (hf, _, ckpt_tp2) in cases.items():
        check(family, hf, results[0][family])
        assert results[1][family]["cached"] == results[0][family]["cached"]
        assert results[0][family]["padded_vocab"] == 512  # 300 padded to a multiple of 128 x 2
        assert _chunks(ckpt_tp2) == _chunks(root / f"{family}-saved"), \
            f"{family}: converted TP=2 chunks differ from those save_checkpoint writes at TP=2"
