"""Where each tensor of a megalite checkpoint goes at a target TP x PP (x virtual stages, x
expert-parallel and expert-tensor-parallel sizes) layout, described as a training run at that
layout describes it to DCP.

A tensor is stored under its full (TP=1) shape, vocabulary tensors without padding rows. A
TP-sharded parameter is one chunk per TP rank and block (the SwiGLU [gate; up] projection has
two blocks), each written by the rank holding it; a replicated one is a single chunk written
by one TP rank of its pipeline stage. An expert's weights are split over ETP instead, written
by the EP rank holding the expert (megalite.parallel.expert.groups). Optimizer states
("optimizer/<state>/<name>") follow their parameter. A load reshards every tensor by name and
offsets, so the target layout decides only which rank's file holds what, and the layout and
flags the checkpoint records for the run that loads it.
"""

import dataclasses
import math
import re
from dataclasses import dataclass

from megalite.checkpoint.publish import ConversionError
from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.model.weights import persistent_buffers
from megalite.parallel.expert.groups import ExpertLayout
from megalite.parallel.pipeline.stage_layout import layer_owners
from megalite.parallel.state import ParallelLayout
from megalite.checkpoint.dcp.format import VOCAB_PARAMS, tp_chunks

_LAYER = re.compile(r"^layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class TargetLayout:
    """--target-tensor-parallel-size, --target-pipeline-parallel-size, --target-num-virtual-stages,
    --target-expert-parallel-size, --target-expert-tensor-parallel-size (None: the TP size)."""

    tp: int = 1
    pp: int = 1
    vp: int = 1
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the smallest run at this layout: one, unless the ETP x EP
        block of the expert grid needs more ranks per pipeline stage than TP (it is carved from
        the TP x DP ranks of a stage, as in training)."""
        block = self.ep * self.expert_tp
        return block // math.gcd(block, self.tp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def as_dict(self) -> dict:
        """common.json's layout entry (the smallest run's; EP and ETP only where they are not
        the defaults)."""
        out = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "vp": self.vp}
        if self.ep != 1:
            out["ep"] = self.ep
        if self.etp is not None and self.etp != self.tp:
            out["etp"] = self.etp
        return out

    def parallel_layout(self) -> ParallelLayout:
        return ParallelLayout(self.world_size, tensor=self.tp, pipeline=self.pp, virtual_pipeline=self.vp)

    def validate(self, config: GPTConfig) -> None:
        """Refuse a layout this model cannot be split into, naming the flag and the field."""
        for flag, value in (("--target-tensor-parallel-size", self.tp), ("--target-pipeline-parallel-size", self.pp),
                            ("--target-num-virtual-stages", self.vp), ("--target-expert-parallel-size", self.ep),
                            ("--target-expert-tensor-parallel-size", self.expert_tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConversionError(f"{flag} must be a positive integer, got {value!r}")
        for field in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            if getattr(config, field) % self.tp:
                raise ConversionError(f"--target-tensor-parallel-size {self.tp} does not divide the model's "
                                      f"{field} ({getattr(config, field)})")
        self._validate_experts(config.moe)
        if self.vp > 1 and self.pp == 1:
            raise ConversionError("--target-num-virtual-stages > 1 needs --target-pipeline-parallel-size > 1")
        if config.num_layers % (self.pp * self.vp):
            raise ConversionError(f"--target-pipeline-parallel-size {self.pp} x --target-num-virtual-stages {self.vp} "
                                  f"does not divide the model's num_layers ({config.num_layers})")

    def _validate_experts(self, moe) -> None:
        if moe is None:
            for flag, value, default in (("--target-expert-parallel-size", self.ep, 1),
                                         ("--target-expert-tensor-parallel-size", self.etp, None)):
                if value != default:
                    raise ConversionError(f"{flag} {value}: the model has no experts")
            return
        checks = (("--target-expert-parallel-size", self.ep, "num_experts", moe.num_experts),
                  ("--target-expert-tensor-parallel-size", self.expert_tp, "moe_ffn_hidden_size", moe.ffn_hidden_size),
                  ("--target-tensor-parallel-size", self.tp, "moe_shared_expert_intermediate_size",
                   moe.shared_expert_intermediate_size or 0))
        for flag, value, field, size in checks:
            if size % value:
                raise ConversionError(f"{flag} {value} does not divide the model's {field} ({size})")


def _probe_config(config: GPTConfig) -> GPTConfig:
    """The same architecture at toy size: its parameters carry the same sharding attributes.
    With experts: one MoE and one dense layer, every expert (names carry expert numbers). With
    Gated DeltaNet: one linear and one full-attention layer, the GDN shapes the model's (in_proj's
    partition_stride is its blocks' full sizes)."""
    moe = config.moe
    if moe is not None:
        # one MoE and one dense layer, the last as the model's (an MTP depth's layer follows it)
        last_moe = moe.is_moe_layer(config.num_layers - 1, config.num_layers)
        moe = dataclasses.replace(moe, layer_freq=[0, 1] if last_moe else [1, 0], ffn_hidden_size=8,
                                  num_groups=None, group_topk=None,
                                  shared_expert_intermediate_size=8 if moe.shared_expert_intermediate_size else None)
    gdn = config.gdn
    if gdn is not None:  # one linear and one full-attention layer, at the model's GDN sizes (in_proj's blocks)
        last_linear = gdn.is_linear_layer(config.num_layers - 1, config.num_layers)
        gdn = dataclasses.replace(gdn, linear_attention_freq=(0, 1) if last_linear else (1, 0))
    return config.replace(num_layers=2 if moe is not None or gdn is not None else 1, moe=moe, gdn=gdn, hidden_size=8,
                          num_attention_heads=2, num_query_groups=2, kv_channels=4,
                          ffn_hidden_size=8, vocab_size=8, max_position_embeddings=4, make_vocab_size_divisible_by=1,
                          sequence_parallel=False, recompute_granularity=None, params_dtype="float32",
                          fused_kernels=False, use_flash_attn=False)


def _probe_parameters(config: GPTConfig) -> dict[str, object]:
    """{parameter (or persistent buffer: the routers' expert biases) name with 'layers.*.': that
    tensor of the probe model}."""
    probe = GPTModel(_probe_config(config), init_seed=0)
    named = [*probe.named_parameters(), *persistent_buffers(probe)]
    return {_LAYER.sub("layers.*.", name): tensor for name, tensor in named}


def _sharding(params: dict) -> dict[str, tuple[int, int] | None]:
    return {pattern: (p.partition_dim, p.partition_stride) if getattr(p, "tensor_model_parallel", False) else None
            for pattern, p in params.items()}


def sharding_by_pattern(config: GPTConfig) -> dict[str, tuple[int, int] | None]:
    """{parameter (or persistent buffer) name with 'layers.*.': (partition_dim, partition_stride) or
    None}."""
    return _sharding(_probe_parameters(config))


def parameter_of(key: str) -> str:
    """'model/<name>' or 'optimizer/<state>/<name>' -> <name>."""
    parts = key.split("/")
    if parts[0] == "model" and len(parts) == 2:
        return parts[1]
    if parts[0] == "optimizer" and len(parts) == 3:
        return parts[2]
    raise ConversionError(f"unexpected checkpoint tensor {key} (expected model/<name> or optimizer/<state>/<name>)")


class TensorPlacement:
    """The DCP chunks, and the rank writing each, of every tensor of `config` at `layout`."""

    def __init__(self, config: GPTConfig, layout: TargetLayout):
        layout.validate(config)
        self.config, self.layout = config, layout
        self.grid = layout.parallel_layout()
        params = _probe_parameters(config)
        self.sharding = _sharding(params)
        self.expert_patterns = {pattern for pattern, p in params.items() if getattr(p, "expert_parallel", False)}
        self.experts = None if config.moe is None else \
            ExpertLayout(self.grid, layout.ep, config.moe.num_experts, layout.expert_tp)
        self.owners = layer_owners(config.num_layers, layout.pp, layout.vp)
        self.elements_per_rank = [0] * self.grid.world_size

    def stage_of(self, name: str) -> int:
        """The pipeline rank holding parameter `name`."""
        layer = _LAYER.match(name)
        if layer:
            number = int(layer.group(1))
            if number >= self.config.num_layers:
                raise ConversionError(f"tensor {name}: layer {number} but the model has "
                                      f"{self.config.num_layers} layers")
            return self.owners[number][0]
        return 0 if name.startswith("embedding.") else self.layout.pp - 1

    def chunks(self, key: str, shape) -> list[tuple[int, list[int], list[int]]]:
        """[(writing rank, global offsets, sizes)] of tensor `key` whose stored shape is `shape`."""
        name = parameter_of(key)
        pattern = _LAYER.sub("layers.*.", name)
        if pattern not in self.sharding:
            raise ConversionError(f"tensor {key} is not a parameter of this model configuration")
        shape = list(shape)
        is_vocab = name in VOCAB_PARAMS
        if is_vocab and shape[0] != self.config.vocab_size:
            raise ConversionError(f"tensor {key} has {shape[0]} rows, the model's vocabulary {self.config.vocab_size}")
        stage = self.stage_of(name)
        ranks, split = [self.grid.rank_of(t, 0, stage) for t in range(self.layout.tp)], self.layout.tp
        if pattern in self.expert_patterns:  # split over ETP, on the EP rank holding the expert
            ep_rank = int(_EXPERT.search(name).group(1)) // (self.config.moe.num_experts // self.layout.ep)
            split = self.layout.expert_tp
            ranks = [self.experts.rank_of(t, ep_rank, 0, stage) for t in range(split)]
        if self.sharding[pattern] is None or split == 1:
            rank = min(ranks, key=lambda r: self.elements_per_rank[r])  # balance replicated tensors
            self.elements_per_rank[rank] += math.prod(shape)
            return [(rank, [0] * len(shape), shape)]
        dim, stride = self.sharding[pattern]
        padded = list(shape)
        if is_vocab:
            padded[0] = self.config.padded_vocab_size(self.layout.tp)
        blocks = stride if isinstance(stride, tuple) else (padded[dim] // stride,) * stride  # tuple: unequal blocks
        if sum(blocks) != padded[dim] or any(b % split for b in blocks):
            flag = "--target-expert-tensor-parallel-size" if pattern in self.expert_patterns \
                else "--target-tensor-parallel-size"
            raise ConversionError(f"tensor {key}: dim {dim} of size {padded[dim]} does not split into {stride} "
                                  f"block(s) x {flag} {split}")
        out = []
        for t, mine in enumerate(tp_chunks(padded, dim, stride, split, shape[0] if is_vocab else None)):
            for offsets, sizes, _ in mine:
                out.append((ranks[t], offsets, sizes))
                self.elements_per_rank[ranks[t]] += math.prod(sizes)
        return out
