"""Text generation from a megalite checkpoint at any TP size, with a KV cache.

    model, common = load_model("checkpoints/", pstate)        # pstate: TP-only layout (PP = 1)
    new_ids = generate_tokens(model, prompt_ids, 32, SamplingParams(temperature=0), eod=tok.eod)

Every TP rank of a group runs the same calls: the forward passes are collective, the logits
are gathered over the vocabulary, and the chosen token is broadcast from the group's first
rank so the ranks never diverge.
"""

import torch
import torch.distributed as dist

from megalite.checkpoint.megalite_reader import read_common
from megalite.inference.kv_cache import InferenceCache
from megalite.inference.sampling import SamplingParams, sample_next
from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.parallel import comm
from megalite.parallel.expert.groups import ExpertState
from megalite.parallel.state import ParallelState
from megalite.checkpoint.dcp.checkpoint import load_checkpoint


def inference_config(model_config: dict) -> GPTConfig:
    """The checkpoint's GPTConfig with everything only training needs switched off (attention
    through SDPA: the KV cache's masked steps need it anyway, and it runs on any device)."""
    return GPTConfig.from_dict(model_config).replace(
        sequence_parallel=False, recompute_granularity=None, attention_dropout=0.0, hidden_dropout=0.0,
        fused_kernels=None, use_flash_attn=False)


def load_model(load_dir, pstate: ParallelState | None = None, *, iteration: int | None = None,
               device=None, expert_tensor_parallel_size: int | None = None) -> tuple[GPTModel, dict]:
    """The whole model (no pipeline split) at `pstate`'s TP size, in eval mode, with the
    weights of the checkpoint under `load_dir`; and the checkpoint's common state.

    A mixture-of-experts model holds every expert on every rank (EP = 1), each expert's weights
    split over `expert_tensor_parallel_size` ranks (default: the TP size, as in training; 1
    keeps whole experts on every TP rank). The expert grid is built here, a collective, unless
    `pstate` already has one."""
    pstate = pstate or ParallelState.single()
    if pstate.pp_size != 1:
        raise ValueError("generation runs without pipeline parallelism (use TP and/or DP only)")
    common, iteration = read_common(load_dir, iteration)
    config = inference_config(common["model_config"])
    if config.moe is not None and pstate.expert is None:
        etp = expert_tensor_parallel_size or pstate.tp_size
        if config.moe.ffn_hidden_size % etp:
            raise ValueError(f"--expert-tensor-parallel-size {etp} does not divide the experts' width "
                             f"(moe_ffn_hidden_size {config.moe.ffn_hidden_size})")
        pstate.expert = ExpertState.create(pstate, 1, config.moe.num_experts,
                                           expert_tensor_size=expert_tensor_parallel_size)
    elif expert_tensor_parallel_size is not None and config.moe is None:
        raise ValueError("--expert-tensor-parallel-size: the checkpoint's model has no experts")
    model = GPTModel(config, pstate, device=device).eval()
    loaded = load_checkpoint(load_dir, chunks=[model], pstate=pstate, load_rng=False, iteration=iteration)
    return model, loaded


def _last_logits(model: GPTModel, logits: torch.Tensor) -> torch.Tensor:
    """The last position's logits over the whole (padded) vocabulary, [b, V_padded]."""
    return comm.gather_dim(logits[:, -1].float().contiguous(), -1, model.tp_group)


def _agree(model: GPTModel, token: torch.Tensor) -> torch.Tensor:
    if comm.group_size(model.tp_group) > 1:
        dist.broadcast(token, src=model.pstate.tp_src_rank, group=model.tp_group)
    return token


def max_new_tokens_allowed(config: GPTConfig, prompt_length: int, max_new_tokens: int) -> int:
    """`max_new_tokens`, cut so the sequence fits max_position_embeddings."""
    if prompt_length < 1:
        raise ValueError("empty prompt: nothing to continue")
    if prompt_length >= config.max_position_embeddings:
        raise ValueError(f"prompt of {prompt_length} tokens leaves no room within the model's "
                         f"{config.max_position_embeddings} positions")
    return max(0, min(max_new_tokens, config.max_position_embeddings - prompt_length))


@torch.no_grad()
def generate_tokens(model: GPTModel, prompt_ids: list[int], max_new_tokens: int,
                    params: SamplingParams = SamplingParams(temperature=0.0), *, eod: int | None = None,
                    generator: torch.Generator | None = None, use_cache: bool = True) -> list[int]:
    """The tokens that follow `prompt_ids`: at most `max_new_tokens` (and no further than the
    model's positions), ending early with `eod` (included) when it is produced. Without
    `use_cache` every step recomputes the whole sequence (the reference for the cache)."""
    config = model.config
    if any(not 0 <= t < config.vocab_size for t in prompt_ids):
        raise ValueError(f"prompt token ids must lie in [0, {config.vocab_size}) (the model's vocabulary)")
    steps = max_new_tokens_allowed(config, len(prompt_ids), max_new_tokens)
    device = next(model.parameters()).device
    sequence = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    cache = InferenceCache(len(prompt_ids) + steps) if use_cache else None
    step_input, new = sequence, []
    for _ in range(steps):
        if cache is None:
            logits = model(sequence)
        else:
            logits = model(step_input, inference_cache=cache)
            cache.advance(step_input.shape[1])
        token = _agree(model, sample_next(_last_logits(model, logits), config.vocab_size, params, generator))
        new.append(int(token[0]))
        if eod is not None and new[-1] == eod:
            break
        step_input = token.view(1, 1)
        sequence = torch.cat([sequence, step_input], dim=1)
    return new
