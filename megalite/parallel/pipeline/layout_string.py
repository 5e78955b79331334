"""Megatron's --pipeline-model-parallel-layout string, parsed and checked as Megatron-Core does.

"Et*3|(tt|)*29,m|L": E embedding, t decoder layer, m MTP layer, L loss; '|' ends a stage; stages are
listed virtual stage by virtual stage (stage i is pp rank i % PP, virtual stage i // PP); commas are
cosmetic; "(...)*n" and "x*n" repeat. The flag itself: config/pipeline_layout.py.
"""

import re
from dataclasses import dataclass

LAYER_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
_REPEATS = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")


class LayoutError(ValueError):
    """A --pipeline-model-parallel-layout that Megatron-Core would refuse."""


def parse_stages(layout: str) -> list[list[str]]:
    """The stages in the string's order, each a list of layer kinds (Megatron's parse_str_to_list)."""
    text = layout.replace(",", "")
    for pattern in _REPEATS:
        text = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), text)
    stages = []
    for stage in text.split("|"):
        for char in stage:
            if char not in LAYER_CHARS:
                raise LayoutError(
                    f"--pipeline-model-parallel-layout: invalid layer character {char!r} in stage {stage!r}"
                    f" (known: {', '.join(LAYER_CHARS)})")
        stages.append([LAYER_CHARS[char] for char in stage])
    return stages


@dataclass(frozen=True)
class PipelineLayout:
    """stages[pp_rank][vp_stage]: the layer kinds of that stage."""
    stages: tuple
    pipeline_size: int

    @property
    def virtual_size(self) -> int:
        return len(self.stages[0])

    def flat(self) -> list[str]:
        """All layers in model order (virtual stage outer, pp rank inner)."""
        return [kind for vp in range(self.virtual_size) for pp in range(self.pipeline_size)
                for kind in self.stages[pp][vp]]

    def count(self, kind: str, pp_rank: int, vp_stage: int) -> int:
        return self.stages[pp_rank][vp_stage].count(kind)

    def offset(self, kind: str, pp_rank: int, vp_stage: int) -> int:
        """How many layers of this kind come before the stage (Megatron's get_layer_offset)."""
        return sum(self.count(kind, pp, vp) for vp in range(vp_stage + 1)
                   for pp in range(self.pipeline_size if vp < vp_stage else pp_rank))

    def layer_ids(self, kind: str, pp_rank: int, vp_stage: int) -> list[int]:
        start = self.offset(kind, pp_rank, vp_stage)
        return list(range(start, start + self.count(kind, pp_rank, vp_stage)))


def build_layout(layout: str, pipeline_size: int) -> PipelineLayout:
    """Parse and split over the pipeline ranks; the virtual size is the stage count / PP (as Megatron)."""
    stages = parse_stages(layout)
    if len(stages) % pipeline_size:
        raise LayoutError(f"--pipeline-model-parallel-layout has {len(stages)} stages, not divisible by"
                          f" --pipeline-model-parallel-size {pipeline_size}")
    virtual = len(stages) // pipeline_size
    grid = tuple(tuple(tuple(stages[vp * pipeline_size + pp]) for vp in range(virtual))
                 for pp in range(pipeline_size))
    return PipelineLayout(grid, pipeline_size)


def validate_layout(layout: PipelineLayout, num_layers: int, mtp_num_layers: int | None) -> bool:
    """Megatron-Core's validate_layer_layout; returns whether MTP sits off the last pp rank (standalone)."""
    flat = layout.flat()
    name = "--pipeline-model-parallel-layout"
    checks = [
        (flat[:1] == ["embedding"], f"{name}: the first layer must be the embedding E"),
        (flat[-1:] == ["loss"], f"{name}: the last layer must be the loss L"),
        (flat.count("embedding") == 1, f"{name}: the embedding E must appear exactly once"),
        (flat.count("loss") == 1, f"{name}: the loss L must appear exactly once"),
        (flat.count("decoder") == num_layers,
         f"{name}: {flat.count('decoder')} decoder layers t, --num-layers is {num_layers}"),
        (flat.count("mtp") == (mtp_num_layers or 0),
         f"{name}: {flat.count('mtp')} MTP layers m, --mtp-num-layers is {mtp_num_layers or 0}"),
    ]
    for ok, message in checks:
        if not ok:
            raise LayoutError(message)
    if "mtp" in flat and "decoder" in flat[flat.index("mtp"):]:
        raise LayoutError(f"{name}: decoder layers must be placed before MTP layers")
    last_vp = layout.virtual_size - 1
    for pp in range(layout.pipeline_size):
        if any("mtp" in layout.stages[pp][vp] for vp in range(last_vp)):
            raise LayoutError(f"{name}: MTP layers must be in the last virtual stage of their pp rank")
        if "mtp" in layout.stages[pp][last_vp] and layout.count("mtp", pp, last_vp) != mtp_num_layers:
            raise LayoutError(f"{name}: all MTP layers must be in one virtual stage")
    return any("mtp" in layout.stages[pp][last_vp] for pp in range(layout.pipeline_size - 1))


def decoder_layers_per_virtual_stage(layout: PipelineLayout) -> list[int]:
    """Decoder layer count of every global virtual stage s = vp*PP + pp (stage_layout's order).

    megalite's chunks hold the embedding on virtual stage 0 and the output layer, loss and MTP
    on the last one; a layout placing them elsewhere is refused by name."""
    p, v = layout.pipeline_size, layout.virtual_size
    first, last = layout.stages[0][0], layout.stages[p - 1][v - 1]
    for kind, char, stage, where in (("embedding", "E", first, "first"), ("loss", "L", last, "last"),
                                     ("mtp", "m", last, "last")):
        if kind in layout.flat() and kind not in stage:
            raise LayoutError(f"--pipeline-model-parallel-layout: megalite places {char} only on the {where} "
                              "virtual stage (pp rank 0 / PP-1, its first / last virtual stage)")
    return [layout.count("decoder", s % p, s // p) for s in range(p * v)]
