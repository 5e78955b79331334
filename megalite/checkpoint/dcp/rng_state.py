"""Each rank's random-number states, saved as JSON (nothing to unpickle on load).

States are keyed by the rank's (tp, pp, dp) coordinates; they are restored only when the
checkpoint was written with the same parallel layout (other layouts cannot map them)."""

import base64
import json
import logging
import random

import numpy as np
import torch

log = logging.getLogger(__name__)


def rng_file_name(pstate) -> str:
    cp = f"_cp{pstate.cp_rank}" if pstate.cp_size > 1 else ""
    return f"rng_tp{pstate.tp_rank}_pp{pstate.pp_rank}_dp{pstate.dp_rank}{cp}.json"


def layout_record(pstate) -> dict:
    """The parallel layout a checkpoint's RNG states belong to (cp only when > 1, so
    checkpoints without context parallelism keep their record)."""
    layout = {"tp": pstate.tp_size, "pp": pstate.pp_size, "dp": pstate.dp_size, "vp": pstate.vp_size}
    if pstate.cp_size > 1:
        layout["cp"] = pstate.cp_size
    return layout


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def save_rng_state(path, rng_tracker=None) -> None:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(mt), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "tracker": {k: _b64(v) for k, v in rng_tracker.get_states().items()} if rng_tracker else {},
    }
    with open(path, "w") as f:
        json.dump(state, f)


def load_rng_state(checkpoint_dir, pstate, rng_tracker, saved_layout: dict | None) -> bool:
    layout = layout_record(pstate)
    if saved_layout != layout:
        if pstate.rank == 0:
            log.warning("checkpoint layout %s differs from this run's %s: RNG states not restored",
                        saved_layout, layout)
        return False
    path = checkpoint_dir / rng_file_name(pstate)
    if not path.exists():  # a converted checkpoint, or one saved with --no-save-rng
        if pstate.rank == 0:
            log.warning("%s: no RNG states in this checkpoint; keeping this run's seeds", checkpoint_dir)
        return False
    try:
        state = json.loads(path.read_text())
        version, mt, gauss = state["python"]
        random.setstate((version, tuple(mt), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(_unb64(state["torch"]))
        if state["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
        if rng_tracker is not None and state["tracker"]:
            rng_tracker.set_states({k: _unb64(v) for k, v in state["tracker"].items()})
    except (OSError, ValueError, KeyError, TypeError) as e:
        from megalite.checkpoint.dcp.format import CheckpointError

        raise CheckpointError(f"{path}: unreadable RNG state ({e})") from e
    return True
