"""A GPT model built from tensor-parallel layers, any contiguous slice of which forms a
pipeline stage.

Layers live in `self.layers` under their global layer number ("layers.8" on whichever stage
owns layer 8), so checkpoints reshard by name. The embedding exists only where
`pre_process`, the final norm and output layer only where `post_process`.

Activations are [seq, batch, hidden] (split along seq over TP with sequence parallelism);
tokens, labels and the returned losses are [batch, seq].
"""

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from megalite.model.config import GPTConfig
from megalite.model.mla_config import mla_cos_sin
from megalite.model.moe_router import TopKRouter
from megalite.model.mtp import MultiTokenPrediction
from megalite.model.norms import build_norm
from megalite.model.offload import ActivationOffloader
from megalite.model.offload_plan import OffloadPlan
from megalite.model.recompute import checkpointed, prepare_for_compile
from megalite.model.rope import rotary_cos_sin_for
from megalite.model.transformer import TransformerLayer
from megalite.parallel import comm
from megalite.parallel.context import local_positions
from megalite.parallel.random import rng_fork_if
from megalite.parallel.sharding import mark_sequence_parallel
from megalite.parallel.state import ParallelState
from megalite.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

# The word embedding's initialisation name: a last pipeline stage holding a tied copy of it
# initialises that copy under this name, so both copies start identical.
WORD_EMBEDDING = "embedding.word_embeddings"


class Embedding(nn.Module):
    """Word embeddings (vocab-parallel) plus learned absolute positions, then dropout."""

    def __init__(self, config: GPTConfig, padded_vocab: int, tp_group=None, rng_tracker=None, device=None):
        super().__init__()
        self.config, self.tp_group, self.rng_tracker = config, tp_group, rng_tracker
        dtype = getattr(torch, config.params_dtype)
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab, config.hidden_size, tp_group=tp_group, sequence_parallel=config.sequence_parallel,
            init_std=config.init_method_std, init_rows=config.vocab_size, params_dtype=dtype, device=device)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                    dtype=dtype, device=device)
            mark_sequence_parallel(self.position_embeddings.weight, config.sequence_parallel)

    def reset_parameters(self, generator: torch.Generator) -> None:
        if self.position_embeddings is not None:
            with torch.no_grad():
                w = self.position_embeddings.weight
                w.copy_(torch.empty(w.shape, device=w.device).normal_(0.0, self.config.init_method_std, generator=generator))

    def forward(self, tokens, position_ids=None):
        x = self.word_embeddings(tokens.t())  # [s(/tp), b, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
            pos = self.position_embeddings(position_ids.t())  # [s, b or 1, h]
            if self.config.sequence_parallel:
                pos = comm.split_dim(pos, 0, self.tp_group)
            x = x + pos
        if self.config.use_mup and self.config.mup_embedding_mult != 1.0:
            x = x * self.config.mup_embedding_mult
        p = self.config.hidden_dropout if self.training else 0.0
        if p > 0:
            with rng_fork_if(self.rng_tracker, self.config.sequence_parallel):
                x = F.dropout(x, p, training=True)
        return x


class GPTModel(nn.Module):
    """GPT-2 or Llama family decoder, or one pipeline stage (chunk) of it.

    Args:
        config: model shape and behaviour.
        pstate: parallel state (None: a single process).
        rng_tracker: TP-rank RNG streams for dropout (None: dropout draws from the default stream).
        layer_numbers: global numbers of the layers this chunk holds (default: all).
        pre_process / post_process: whether this chunk holds the embedding / the output head
            (default: first / last pipeline stage).
        init_seed: weights are drawn per parameter from (init_seed, parameter name), so any
            TP or PP layout starts from slices of the same full model.
        device: where the parameters live; "meta" allocates nothing and initialises nothing:
            megalite.model.meta_init.materialize_ later gives exactly the weights construction
            on the target device would.
        init_on_shard: tensor-parallel weights are drawn shard by shard from (init_seed, name,
            TP rank), never as full tensors; the shards are then not slices of the TP=1 model.
    """

    def __init__(self, config: GPTConfig, pstate: ParallelState | None = None, *, rng_tracker=None,
                 layer_numbers=None, pre_process=None, post_process=None, init_seed: int = 1234, device=None,
                 init_on_shard: bool = False):
        super().__init__()
        pstate = pstate or ParallelState.single()
        pstate.layout.check_model(config.num_layers, config.hidden_size, config.num_attention_heads,
                                  config.num_query_groups, config.kv_channels)
        self.config, self.pstate, self.rng_tracker = config, pstate, rng_tracker
        self.tp_group = pstate.tp_group
        self.pre_process = pstate.is_first_stage if pre_process is None else pre_process
        self.post_process = pstate.is_last_stage if post_process is None else post_process
        self.padded_vocab = config.padded_vocab_size(pstate.tp_size)
        layer_numbers = range(config.num_layers) if layer_numbers is None else layer_numbers
        self.share_embeddings = not config.untie_embeddings_and_output_weights

        has_mtp = bool(config.mtp_num_layers) and self.post_process
        # multi-token prediction embeds tokens on the last stage too: a copy of the embedding there
        self.embedding = (Embedding(config, self.padded_vocab, self.tp_group, rng_tracker, device)
                          if self.pre_process or has_mtp else None)
        self.layers = nn.ModuleDict({str(n): TransformerLayer(config, n, self.tp_group, rng_tracker, device,
                                                              pstate.expert, pstate.cp_group)
                                     for n in layer_numbers})
        self.mtp = (MultiTokenPrediction(config, self.tp_group, rng_tracker, device, pstate.expert, pstate.cp_group)
                    if has_mtp else None)
        for router in (m for m in self.modules() if isinstance(m, TopKRouter)):
            router.dp_cp_group = pstate.dp_cp_group  # global_aux_loss counts the tokens of all of them
        self.final_layernorm = build_norm(config, device=device) if self.post_process else None
        self.output_layer = None
        if self.post_process:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, self.padded_vocab, tp_group=self.tp_group, bias=False,
                sequence_parallel=config.sequence_parallel, init_std=config.init_method_std,
                init_rows=config.vocab_size, skip_weight=self.share_embeddings and self.embedding is not None,
                params_dtype=getattr(torch, config.params_dtype), device=device)
            if self.output_layer.weight is not None and self.share_embeddings:
                # A tied copy of the word embedding on the last stage; kept equal to it by an
                # all-reduce of gradients over the embedding group.
                self.output_layer.weight.shared_embedding = True
        if self.embedding is not None and pstate.pp_size > 1 and (self.share_embeddings or config.mtp_num_layers):
            # the first stage's embedding and the MTP stage's copy (and the tied output layer)
            self.embedding.word_embeddings.weight.shared_embedding = True
            if config.mtp_num_layers and self.embedding.position_embeddings is not None:
                self.embedding.position_embeddings.weight.shared_embedding = True
        # --fine-grained-activation-offloading: one offloader per model chunk, shared by its layers
        self.offloader = ActivationOffloader(config.offload_modules, config.min_offloaded_tensor_size, OffloadPlan(
            config.activation_offload_fraction, config.delta_offload_bytes_across_pp_ranks, pstate.pp_rank,
            config.offload_max_inflight))
        for layer in (m for m in self.modules() if isinstance(m, TransformerLayer)):
            layer.share_offloader(self.offloader)
        self.init_seed, self.init_on_shard = init_seed, init_on_shard
        self._compiled_head = None  # compile_regions' compiled output_head
        # Layer number -> its CUDA-graphed call (megalite.training.cuda_graphs), used in training
        # with gradients on; a plain dict, so the graphed wrappers are not submodules.
        self.graphed_layers = {}
        if torch.device(device or "cpu").type != "meta":
            self.init_weights(init_seed)

    def init_weights(self, seed: int) -> None:
        tp_parallel = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
        for name, module in self.named_modules():
            first_param = next(module.parameters(), None)
            if first_param is None or not hasattr(module, "reset_parameters") \
                    or not type(module).__module__.startswith("megalite."):
                continue
            init_name = WORD_EMBEDDING if module is self.output_layer and self.share_embeddings else name
            key = f"{seed}:{init_name}"
            if not isinstance(module, tp_parallel):
                generator = torch.Generator(device=first_param.device).manual_seed(zlib.crc32(key.encode()))
                module.reset_parameters(generator)
                continue
            if self.init_on_shard and self.pstate.tp_size > 1:
                key += f":tp{self.pstate.tp_rank}"
            generator = torch.Generator(device=first_param.device).manual_seed(zlib.crc32(key.encode()))
            module.reset_parameters(generator, on_shard=self.init_on_shard)

    @property
    def needs_tokens(self) -> bool:
        """Whether forward reads `tokens`: the embedding's chunk, and the MTP block's."""
        return self.pre_process or self.mtp is not None

    def output_weight(self) -> torch.Tensor:
        if self.share_embeddings and self.embedding is not None:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def _rotary(self, seq_len: int, device):
        """cos and sin of positions 0..seq_len-1: multi-latent attention's own rotary part
        whatever the position embedding (as Megatron), else RoPE's."""
        mla = self.config.mla is not None
        if self.config.position_embedding_type != "rope" and not mla:
            return None
        key = (seq_len, str(device))
        if getattr(self, "_rotary_cache_key", None) != key:
            self._rotary_cache = (mla_cos_sin if mla else rotary_cos_sin_for)(self.config, seq_len, device)
            self._rotary_cache_key = key
        return self._rotary_cache

    def _run_layers(self, x, rotary, attention_mask, inference_cache=None):
        self.offloader.new_micro_batch()
        layers = list(self.layers.values())
        cfg = self.config
        if inference_cache is not None:
            for layer in layers:
                x = layer(x, rotary, attention_mask, inference_cache)
            return x
        if cfg.recompute_granularity != "full":
            graphed = self.graphed_layers if self.training and torch.is_grad_enabled() else {}
            for number, layer in self.layers.items():
                x = graphed.get(number, layer)(x, rotary, attention_mask)
            return x

        def run(chunk):
            def fn(h):
                for layer in chunk:
                    h = layer(h, rotary, attention_mask)
                return h
            return fn

        n = cfg.recompute_num_layers or 1
        if cfg.recompute_method == "uniform":
            for i in range(0, len(layers), n):
                x = checkpointed(run(layers[i:i + n]), self.rng_tracker, x)
        else:  # block: the first n layers of this chunk are recomputed, the rest are not
            for i, layer in enumerate(layers):
                x = checkpointed(run([layer]), self.rng_tracker, x) if i < n else layer(x, rotary, attention_mask)
        return x

    def forward(self, tokens=None, position_ids=None, attention_mask=None, labels=None, hidden_states=None,
                inference_cache=None, loss_mask=None):
        """Returns per-token losses [b, s] (fp32) when `labels` is given on the last stage,
        vocab-parallel logits [b, s, V/t] without labels, and hidden states [s(/t), b, h] on
        other stages. `hidden_states` is the previous stage's output (not pre_process).
        `attention_mask` is bool [b, 1, s, s], True where attention is not allowed; None
        means causal.

        `inference_cache` (generation, no sequence parallelism): a
        megalite.inference.InferenceCache; the tokens sit at positions cache.offset onwards
        and attend to the cached keys and values, which they extend. The caller advances
        cache.offset after the call.

        With multi-token prediction, a training forward with `labels` on the last stage (which
        then needs `tokens`, and `loss_mask` [b, s] if the loss has one) also trains the MTP
        depths, their losses attached to the returned one (see mtp.py)."""
        if inference_cache is not None:
            return self._forward_cached(tokens, hidden_states, inference_cache)
        cp = self.pstate.cp_size
        if self.pre_process:
            if position_ids is None and cp > 1:
                position_ids = local_positions(tokens.shape[1] * cp, cp, self.pstate.cp_rank, tokens.device)[None]
            x = self.embedding(tokens, position_ids)
        else:
            x = hidden_states
        seq_len = x.shape[0] * (self.pstate.tp_size if self.config.sequence_parallel else 1)
        rotary = self._rotary(seq_len * cp, x.device)
        if rotary is not None and cp > 1:  # the rotations of this CP rank's tokens' positions
            held = local_positions(seq_len * cp, cp, self.pstate.cp_rank, x.device)
            rotary = tuple(t.index_select(0, held) for t in rotary)
        x = self.offloader.end_forward(self._run_layers(x, rotary, attention_mask))
        if not self.post_process:
            return x
        if self.mtp is not None and labels is not None and torch.is_grad_enabled():
            return self._mtp_head(x, tokens, position_ids, labels, loss_mask, rotary, attention_mask)
        return (self._compiled_head or self.output_head)(x, labels)

    def output_head(self, x, labels=None):
        """The final norm, the output layer and, given `labels`, the loss (see forward)."""
        x = self.final_layernorm(x)
        if labels is None:
            return self._logits(x).transpose(0, 1)  # [b, s, V/t]
        return self.token_losses(x, labels)

    def _mtp_head(self, x, tokens, position_ids, labels, loss_mask, rotary, attention_mask):
        """output_head with the MTP depths trained on the final norm's output (see mtp.py)."""
        if tokens is None:
            raise ValueError("multi-token prediction needs the micro-batch's tokens on the last stage")
        cp = self.pstate.cp_size
        if position_ids is None:
            position_ids = local_positions(tokens.shape[1] * cp, cp, self.pstate.cp_rank, tokens.device)[None]
        x = self.final_layernorm(x)
        x = self.mtp(x, tokens, position_ids.expand(tokens.shape[0], -1), labels, loss_mask, self.embedding,
                     self.token_losses, rotary, attention_mask)
        return self.token_losses(x, labels)

    def token_losses(self, x, labels):
        """Per-token cross-entropy [b, s] (fp32) of the output layer on x [s(/t), b, h]."""
        logits = self._logits(x)  # [s, b, V/t]
        # In-place backward: nothing else reads these logits, so their buffer takes the gradient.
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group, self.config.vocab_size,
                                            self.config.label_smoothing,
                                            impl=self.config.kernel_impl_for("cross_entropy"),
                                            inplace_backward=True)
        return loss.t()

    def compile_regions(self, **compile_kwargs) -> None:
        """--torch-compile: torch.compile(**compile_kwargs) of each region this chunk holds -- the
        embedding (word and position embeddings, dropout), every transformer layer (one compiled
        graph serves all layers alike), and the head (output_head: final norm, output layer,
        loss) -- as the peer compiles its whole model. Regions rather than the whole forward:
        a chunk's layer count does not multiply the compile time, and what lies between the
        regions (full recompute with its RNG tracker, rotary tables, context-parallel position
        bookkeeping) stays eager."""
        prepare_for_compile()
        if self.embedding is not None:
            self.embedding.compile(**compile_kwargs)
        for layer in self.layers.values():
            layer.compile(**compile_kwargs)
        if self.post_process:
            self._compiled_head = torch.compile(self.output_head, **compile_kwargs)

    def _forward_cached(self, tokens, hidden_states, cache):
        if self.config.sequence_parallel:
            raise ValueError("generation with a KV cache needs sequence_parallel off")
        offset = cache.offset
        if self.pre_process:
            positions = torch.arange(offset, offset + tokens.shape[1], device=tokens.device).unsqueeze(0)
            x = self.embedding(tokens, positions)
        else:
            x = hidden_states
        cache.check_room(x.shape[0])
        rotary = self._rotary(cache.max_length, x.device)
        if rotary is not None:
            rotary = tuple(t[offset:offset + x.shape[0]] for t in rotary)
        x = self._run_layers(x, rotary, None, cache)
        if not self.post_process:
            return x
        return self._logits(self.final_layernorm(x)).transpose(0, 1)

    def _logits(self, x):
        """The output layer; under muP logits times mup_output_mult (applied to its input: the
        layer has no bias, so W (m x) = m W x without a vocabulary-sized product)."""
        if self.config.use_mup and self.config.mup_output_mult != 1.0:
            x = x * self.config.mup_output_mult
        return self.output_layer(x, weight=self.output_weight())


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """sum(loss * mask) / sum(mask): one micro-batch's loss."""
    if loss_mask is None:
        return per_token_loss.mean()
    loss_mask = loss_mask.to(per_token_loss.dtype)
    return (per_token_loss * loss_mask).sum() / loss_mask.sum()
