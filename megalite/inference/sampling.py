"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Megatron's conventions: temperature 0 is greedy; top_k 0 and top_p 0 switch those filters
off. Vocabulary padding ids (>= the true vocabulary size) are dropped before anything else, so
they can never be chosen.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """Divides the logits; 0 picks the most likely token (greedy)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    top_p: float = 0.0
    """Sample among the most likely tokens whose probabilities sum to at least p (0: all)."""

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in [0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] / temperature with tokens outside top-k / top-p set to -inf."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
        remove_sorted = before >= params.top_p  # the most likely token always stays
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, vocab_size: int, params: SamplingParams,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [b] from logits [b, V_padded]; ids >= vocab_size are never chosen."""
    logits = logits[..., :vocab_size]
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filtered_logits(logits, params), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
