"""Learning-rate schedules: Megatron's OptimizerParamScheduler, for the learning rate.

Linear warmup from `init_lr` to `max_lr` over `warmup_steps`, then one of

    constant             max_lr
    linear               min_lr + (max_lr - min_lr) * (1 - r)
    cosine               min_lr + (max_lr - min_lr) * (1 + cos(pi r)) / 2
    inverse-square-root  max(min_lr, max_lr * sqrt(warmup_steps / steps))
    WSD                  max_lr until the last `wsd_decay_steps` of the decay, then
                         linear (1 - q), cosine, exponential (2 * 0.5^q - 1) or minus_sqrt
                         (1 - sqrt(q)) down to min_lr

with r = (steps - warmup) / (decay_steps - warmup) and q the fraction of the WSD decay done;
after `decay_steps` every style but constant holds min_lr. As in Megatron, a step is a sample:
the training loop calls `step(global_batch_size)` after each optimizer step, so iteration- and
sample-based schedules are the same object (see megalite.config.schedules.schedule_lengths_from_args).
"""

import math

from megalite.config.run import DECAY_STYLES, WSD_DECAY_STYLES



class LRScheduler:
    """Sets `lr` on every param group of a torch optimizer (times the group's `lr_mult`, if any).

    Weight decay is left to the optimizer's param groups."""

    def __init__(self, optimizer, *, max_lr: float, decay_steps: float, decay_style: str = "linear",
                 min_lr: float = 0.0, init_lr: float = 0.0, warmup_steps: float = 0,
                 wsd_decay_steps: float | None = None, wsd_decay_style: str = "exponential"):
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {DECAY_STYLES}, got {decay_style!r}")
        if wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"--lr-wsd-decay-style must be one of {WSD_DECAY_STYLES}, "
                             f"got {wsd_decay_style!r}")
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= --min-lr ({min_lr}) <= --lr ({max_lr})")
        if not 0.0 <= init_lr <= max_lr:
            raise ValueError(f"need 0 <= --lr-warmup-init ({init_lr}) <= --lr ({max_lr})")
        if not 0 <= warmup_steps < decay_steps:
            raise ValueError(f"need 0 <= warmup steps ({warmup_steps}) < decay steps ({decay_steps})")
        if decay_style == "WSD" and not (wsd_decay_steps and 0 < wsd_decay_steps <= decay_steps):
            raise ValueError(f"--lr-decay-style WSD needs 0 < WSD decay steps ({wsd_decay_steps}) "
                             f"<= decay steps ({decay_steps})")
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.init_lr = float(init_lr)
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.decay_style = decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.wsd_decay_style = wsd_decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The learning rate at the current step, before any group's lr_mult; `max_lr` and
        `min_lr` replace the schedule's for a group that has its own (--decoupled-lr)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        steps, warmup = self.num_steps, self.warmup_steps
        if warmup > 0 and steps <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * float(steps) / float(warmup)
        if self.decay_style == "constant":
            return max_lr
        if steps > self.decay_steps:
            return min_lr
        if self.decay_style == "inverse-square-root":
            lr = max_lr * max(warmup, 1) ** 0.5 / max(steps, 1) ** 0.5
            return max(min_lr, lr)
        ratio = float(steps - warmup) / float(self.decay_steps - warmup)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable at max_lr, then anneal over the last wsd_decay_steps
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if steps <= anneal_start:
                coeff = 1.0
            else:
                q = float(steps - anneal_start) / float(self.wsd_decay_steps)
                coeff = {
                    "linear": lambda: 1.0 - q,
                    "cosine": lambda: 0.5 * (math.cos(math.pi * q) + 1.0),
                    "exponential": lambda: 2.0 * math.pow(0.5, q) - 1.0,
                    "minus_sqrt": lambda: 1.0 - math.sqrt(q),
                }[self.wsd_decay_style]()
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> float:
        """Advance by `increment` steps (samples: pass the global batch size) and set the lr."""
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            own = self.get_lr(group.get("max_lr"), group.get("min_lr")) if "max_lr" in group else lr
            group["lr"] = own * group.get("lr_mult", 1.0)
        return lr

    def _config(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "init_lr": self.init_lr,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "decay_style_id": DECAY_STYLES.index(self.decay_style),
            "wsd_decay_steps": self.wsd_decay_steps or 0,
            "wsd_decay_style_id": WSD_DECAY_STYLES.index(self.wsd_decay_style),
        }

    def state_dict(self) -> dict:
        """Plain ints and floats: the step count and the schedule it was computed with."""
        return {"num_steps": self.num_steps, **self._config()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Resume at the saved step. With `strict`, a schedule that differs from this one (a
        changed --lr, --min-lr, warmup, decay length or style) is refused, naming the value;
        otherwise this run's schedule is kept and only the step count is taken."""
        names = {"max_lr": "--lr", "min_lr": "--min-lr", "init_lr": "--lr-warmup-init",
                 "warmup_steps": "warmup steps", "decay_steps": "decay steps",
                 "decay_style_id": "--lr-decay-style", "wsd_decay_steps": "WSD decay steps",
                 "wsd_decay_style_id": "--lr-wsd-decay-style"}
        missing = sorted((set(names) | {"num_steps"}) - set(state))
        if missing:
            raise ValueError(f"lr scheduler state lacks {', '.join(missing)}")
        if strict:
            for key, current in self._config().items():
                if state[key] != current:
                    saved, now = state[key], current
                    if key.endswith("style_id"):
                        styles = DECAY_STYLES if key == "decay_style_id" else WSD_DECAY_STYLES
                        saved, now = styles[saved], styles[now]
                    raise ValueError(f"the checkpoint's lr schedule has {names[key]} {saved} but "
                                     f"this run has {now}")
        self.num_steps = int(state["num_steps"])
        self.step(0)


def lr_scheduler(schedule, optimizer) -> LRScheduler:
    """The LR schedule of a run's LRScheduleConfig (megalite.config.run_config); call
    `step(global batch size)` after every optimizer step."""
    return LRScheduler(optimizer, max_lr=schedule.max_lr, min_lr=schedule.min_lr, init_lr=schedule.init_lr,
                       decay_style=schedule.decay_style, wsd_decay_style=schedule.wsd_decay_style,
                       warmup_steps=schedule.warmup_steps, decay_steps=schedule.decay_steps,
                       wsd_decay_steps=schedule.wsd_decay_steps)
