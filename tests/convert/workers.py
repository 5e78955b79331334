"""Functions run in spawned ranks by the conversion tests; this module does not import
transformers, so each rank starts quickly."""

import torch

from megalite.inference import SamplingParams, generate_tokens, load_model
from megalite.parallel import comm
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.checkpoint.dcp.checkpoint import save_checkpoint
from tests.convert.hf_models import VOCAB, tokens

PROMPT, NEW_TOKENS = [5, 17, 42, 7, 99, 3], 24
GREEDY = SamplingParams(temperature=0.0)


def megalite_outputs(ckpt, pstate) -> dict:
    model, _ = load_model(ckpt, pstate)
    with torch.no_grad():
        logits = comm.gather_dim(model(tokens()), -1, model.tp_group)[..., :VOCAB]
    return {"logits": logits,
            "cached": generate_tokens(model, PROMPT, NEW_TOKENS, GREEDY),
            "uncached": generate_tokens(model, PROMPT, NEW_TOKENS, GREEDY, use_cache=False),
            "padded_vocab": model.padded_vocab}


def tp2_parity_worker(rank, world_size, cases, root):
    pstate = ParallelState.create(ParallelLayout(world_size, tensor=2))
    out = {}
    for family, (ckpt, _) in cases.items():
        out[family] = megalite_outputs(ckpt, pstate)
        model, _ = load_model(ckpt, pstate)
        save_checkpoint(f"{root}/{family}-saved", 0, chunks=[model], optimizer=None, pstate=pstate, common={})
    return out
