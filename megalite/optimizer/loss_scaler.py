"""Loss scaling for fp16 training, with Megatron's semantics.

The loss is multiplied by the scale before backward and the gradients divided by it before the
update. A dynamic scaler halves the scale after `hysteresis` overflowing steps (consecutive or
not: the tracker is only refilled when the scale grows) and doubles it after `window`
consecutive clean steps; it never goes below `min_scale`.
"""


class ConstantLossScaler:
    """A fixed loss scale (--loss-scale)."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"--loss-scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    """Dynamic loss scale (--initial-loss-scale, --min-loss-scale, --loss-scale-window,
    --hysteresis)."""

    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0, window: int = 1000,
                 hysteresis: int = 2, growth_factor: float = 2.0, backoff_factor: float = 0.5):
        for flag, value in (("--initial-loss-scale", initial_scale), ("--min-loss-scale", min_scale),
                            ("--loss-scale-window", window), ("--hysteresis", hysteresis)):
            if value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        if initial_scale < min_scale:
            raise ValueError(f"--initial-loss-scale {initial_scale} is below --min-loss-scale {min_scale}")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.window = int(window)
        self.hysteresis = int(hysteresis)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.window:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))
