"""The preset nearest a card that has none, for the one line `--cluster NAME` answers.

A name containing a preset's (`NVIDIA H100 PCIe` -> h100) names that preset; otherwise a card
of the table below is matched to the preset nearest in dense 16-bit peak and memory (data-sheet
figures, SXM / OAM parts). The nearest preset is named, never used: its rates are not the card's.
"""

import math
import re

CARDS = {  # name: (dense 16-bit peak TFLOP/s, memory GiB), data sheets
    "v100": (125, 32), "a10": (125, 24), "a40": (150, 48), "l4": (121, 24), "l40s": (362, 48),
    "h20": (148, 96), "h800": (989, 80), "gh200": (989, 96), "b200": (2250, 180), "gb200": (2500, 186),
    "mi250x": (383, 128), "mi300x": (1307, 192),
}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower().replace("nvidia", "").replace("amd", "").replace("instinct", ""))


def nearest_preset(name: str, presets: dict) -> tuple[str, str] | None:
    """(preset, why) for the card `name`, or None when the card is not known."""
    key = _key(name)
    named = [p for p in presets if _key(p) and _key(p) in key]
    if named:
        preset = max(named, key=lambda p: len(_key(p)))
        return preset, f"its name contains {preset!r}"
    card = next((c for c in sorted(CARDS, key=len, reverse=True) if c in key), None)
    if card is None:
        return None
    peak, memory = CARDS[card]

    def distance(p: str) -> float:
        values = presets[p]
        return abs(math.log(values["peak_flops"] / 1e12 / peak)) + abs(math.log(values["memory_bytes"] / 2**30 / memory))

    preset = min((p for p in presets if "megatron" not in p), key=distance)
    values = presets[preset]
    return preset, (f"{card.upper()} {peak} TFLOP/s, {memory} GiB against {preset}'s "
                    f"{values['peak_flops'] / 1e12:.0f} TFLOP/s, {values['memory_bytes'] / 2**30:.0f} GiB")
