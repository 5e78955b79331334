"""Key/value cache for incremental decoding.

GPTModel.forward(tokens, inference_cache=cache) runs `tokens` at positions cache.offset
onwards: each layer appends its new keys and values to its KVCache and attends to all cached
positions. The caller advances the offset once the whole model has run:

    cache = InferenceCache(max_length=prompt_len + max_new_tokens)
    logits = model(prompt, inference_cache=cache); cache.advance(prompt.shape[1])
    logits = model(next_token, inference_cache=cache); cache.advance(1)
"""

import torch


class KVCache:
    """One layer's keys and values, [max_length, batch, groups (this TP rank's), head_dim] (the
    values' head_dim MLA's value width)."""

    def __init__(self, parent: "InferenceCache"):
        self.parent = parent
        self.keys = self.values = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [s, b, g, d] at the current offset; return every cached position's."""
        self.parent.check_room(k.shape[0])
        start, end = self.parent.offset, self.parent.offset + k.shape[0]
        if self.keys is None:  # values may be narrower than keys (multi-latent attention)
            self.keys = torch.empty((self.parent.max_length, *k.shape[1:]), dtype=k.dtype, device=k.device)
            self.values = torch.empty((self.parent.max_length, *v.shape[1:]), dtype=v.dtype, device=v.device)
        self.keys[start:end] = k
        self.values[start:end] = v
        return self.keys[:end], self.values[:end]

    def attention_mask(self, num_queries: int, device) -> torch.Tensor | None:
        """Megatron-convention mask (True = not allowed) [1, 1, s, offset + s] letting query i
        (position offset + i) see positions up to its own; None (plain causal) at offset 0."""
        offset = self.parent.offset
        if offset == 0:
            return None
        query_pos = torch.arange(offset, offset + num_queries, device=device).unsqueeze(1)
        key_pos = torch.arange(offset + num_queries, device=device).unsqueeze(0)
        return (key_pos > query_pos).view(1, 1, num_queries, -1)


class LinearAttentionState:
    """One Gated DeltaNet layer's generation state: the causal convolution's last kernel-1
    inputs conv [b, channels (this TP rank's), kernel - 1] and the delta rule's state
    recurrent [b, heads (this rank's), dk, dv] (fp32); None before the first call."""

    def __init__(self):
        self.conv = self.recurrent = None


class InferenceCache:
    """Every layer's KVCache plus the shared position offset, for sequences of at most
    `max_length` tokens."""

    def __init__(self, max_length: int):
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        self.max_length = max_length
        self.offset = 0
        self.layers: dict[int, KVCache | LinearAttentionState] = {}

    def layer(self, layer_number: int) -> KVCache:
        if layer_number not in self.layers:
            self.layers[layer_number] = KVCache(self)
        return self.layers[layer_number]

    def linear_layer(self, layer_number: int) -> LinearAttentionState:
        """A linear-attention layer's state (Gated DeltaNet): constant in the sequence length."""
        if layer_number not in self.layers:
            self.layers[layer_number] = LinearAttentionState()
        return self.layers[layer_number]

    def check_room(self, num_tokens: int) -> None:
        if self.offset + num_tokens > self.max_length:
            raise ValueError(f"KV cache holds {self.max_length} positions; position "
                             f"{self.offset + num_tokens - 1} asked for")

    def advance(self, num_tokens: int) -> None:
        """Mark `num_tokens` more positions as cached (after a forward pass over them)."""
        self.offset += num_tokens
