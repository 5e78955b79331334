"""LR schedules: hand-computed values for each style, Megatron's scheduler as an oracle, and
exact resume through state_dict."""

import importlib.util
import math
import os
from types import SimpleNamespace

import pytest
import torch

from megalite.config.run_config import LRScheduleConfig
from megalite.training.lr_schedule import LRScheduler, lr_scheduler

MAX, MIN = 1.0, 0.1


def optimizer(*mults):
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in mults or (None,)]
    groups = [{"params": [p], **({"lr_mult": m} if m is not None else {})}
              for p, m in zip(params, mults or (None,))]
    return torch.optim.SGD(groups, lr=123.0)


def lr_at(steps: int, **kwargs) -> float:
    options = dict(max_lr=MAX, min_lr=MIN, warmup_steps=10, decay_steps=110)
    options.update(kwargs)
    scheduler = LRScheduler(optimizer(), **options)
    scheduler.step(steps)
    assert scheduler.optimizer.param_groups[0]["lr"] == scheduler.get_lr()
    return scheduler.get_lr()


@pytest.mark.parametrize("style, steps, expected", [
    # linear warmup from init_lr (0) over 10 steps, for every style
    ("linear", 0, 0.0), ("cosine", 5, 0.5), ("WSD", 10, 1.0),
    ("constant", 50, 1.0), ("constant", 10_000, 1.0),
    # decay over steps 10..110: r = (steps - 10) / 100
    ("linear", 60, 0.1 + 0.9 * 0.5), ("linear", 110, 0.1), ("linear", 111, 0.1),
    ("cosine", 35, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2), ("cosine", 60, 0.55),
    ("cosine", 110, 0.1), ("cosine", 500, 0.1),
])
def test_hand_computed_styles(style, steps, expected):
    kwargs = {"wsd_decay_steps": 20} if style == "WSD" else {}
    assert lr_at(steps, decay_style=style, **kwargs) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_warmup_from_init_lr():
    assert lr_at(5, init_lr=0.2) == pytest.approx(0.2 + 0.8 * 0.5, rel=1e-12)
    assert lr_at(0, init_lr=0.2) == 0.2


def test_inverse_square_root():
    options = dict(decay_style="inverse-square-root", decay_steps=1000)
    assert lr_at(40, **options) == pytest.approx(math.sqrt(10 / 40), rel=1e-12)      # 0.5
    assert lr_at(640, **options) == pytest.approx(0.125, rel=1e-12)
    assert lr_at(999, **options) == pytest.approx(math.sqrt(10 / 999), rel=1e-12)
    assert lr_at(1000, **options) == pytest.approx(0.1, rel=1e-12)                    # floor = min_lr
    assert lr_at(1001, **options) == MIN                                              # past decay


@pytest.mark.parametrize("wsd_style, at_100", [
    # stable to step 90 (= 110 - 20), then q = (steps - 90) / 20; at step 100 q = 0.5
    ("linear", 0.1 + 0.9 * 0.5),
    ("cosine", 0.1 + 0.9 * 0.5),
    ("exponential", 0.1 + 0.9 * (2 * 0.5 ** 0.5 - 1)),
    ("minus_sqrt", 0.1 + 0.9 * (1 - 0.5 ** 0.5)),
])
def test_wsd(wsd_style, at_100):
    options = dict(decay_style="WSD", wsd_decay_steps=20, wsd_decay_style=wsd_style)
    assert lr_at(50, **options) == 1.0 and lr_at(90, **options) == 1.0
    assert lr_at(100, **options) == pytest.approx(at_100, rel=1e-12)
    assert lr_at(110, **options) == pytest.approx(MIN, rel=1e-12, abs=1e-15)
    assert lr_at(111, **options) == MIN


def test_lr_mult_scales_each_group():
    scheduler = LRScheduler(optimizer(0.5, None), max_lr=MAX, min_lr=MIN, warmup_steps=10,
                            decay_steps=110)
    scheduler.step(60)
    assert [g["lr"] for g in scheduler.optimizer.param_groups] == pytest.approx([0.275, 0.55], rel=1e-12)


@pytest.mark.parametrize("kwargs, words", [
    (dict(warmup_steps=110), ["warmup"]),
    (dict(min_lr=2.0), ["--min-lr"]),
    (dict(init_lr=2.0), ["--lr-warmup-init"]),
    (dict(decay_style="WSD"), ["WSD"]),
    (dict(decay_style="step"), ["--lr-decay-style"]),
])
def test_bad_schedules_are_refused(kwargs, words):
    options = dict(max_lr=MAX, min_lr=MIN, warmup_steps=10, decay_steps=110)
    options.update(kwargs)
    with pytest.raises(ValueError) as info:
        LRScheduler(optimizer(), **options)
    assert all(w in str(info.value) for w in words)


def test_state_dict_resumes_exactly():
    make = lambda: LRScheduler(optimizer(), max_lr=3e-4, min_lr=3e-5, warmup_steps=64,
                               decay_steps=1024, decay_style="cosine")
    straight, first = make(), make()
    for _ in range(7):
        first.step(32)
    state = first.state_dict()
    assert all(type(v) in (int, float) for v in state.values()), state
    resumed = make()
    resumed.load_state_dict(state)
    for _ in range(7):
        straight.step(32)
    assert resumed.get_lr() == straight.get_lr()
    for _ in range(30):
        assert resumed.step(32) == straight.step(32)
    changed = LRScheduler(optimizer(), max_lr=6e-4, min_lr=3e-5, warmup_steps=64,
                          decay_steps=1024, decay_style="cosine")
    with pytest.raises(ValueError, match="--lr 0.0003 but this run has 0.0006"):
        changed.load_state_dict(state)
    changed.load_state_dict(state, strict=False)              # keeps this run's schedule
    assert changed.num_steps == 224 and changed.max_lr == 6e-4
    with pytest.raises(ValueError, match="lacks num_steps"):
        changed.load_state_dict({k: v for k, v in state.items() if k != "num_steps"})
    linear = LRScheduler(optimizer(), max_lr=3e-4, min_lr=3e-5, warmup_steps=64, decay_steps=1024)
    with pytest.raises(ValueError, match="--lr-decay-style cosine but this run has linear"):
        linear.load_state_dict(state)


def schedule_args(**overrides):
    args = dict(lr=1.0, min_lr=0.1, lr_warmup_init=0.0, lr_decay_style="linear",
                lr_wsd_decay_style="exponential", global_batch_size=4, train_iters=None,
                train_samples=None, lr_decay_iters=None, lr_decay_samples=None,
                lr_warmup_iters=0, lr_warmup_samples=0, lr_warmup_fraction=None,
                lr_wsd_decay_iters=None, lr_wsd_decay_samples=None)
    args.update(overrides)
    return SimpleNamespace(**args)


def run(args, iterations):
    scheduler = lr_scheduler(LRScheduleConfig.from_args(args), optimizer())
    return [scheduler.step(args.global_batch_size) for _ in range(iterations)]


def test_iteration_and_sample_based_schedules_agree():
    by_iters = run(schedule_args(train_iters=100, lr_warmup_iters=10), 100)
    by_samples = run(schedule_args(train_samples=400, lr_warmup_samples=40), 100)
    by_fraction = run(schedule_args(train_iters=100, lr_warmup_fraction=0.1), 100)
    assert by_iters == by_samples == by_fraction
    # after iteration k the scheduler has seen k iterations: lr = 0.1 + 0.9 (1 - (k - 10) / 90)
    assert by_iters[4] == pytest.approx(0.5, rel=1e-12)
    assert by_iters[54] == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-12)
    assert by_iters[99] == pytest.approx(0.1, rel=1e-12)
    decay_longer = run(schedule_args(train_iters=100, lr_decay_iters=190, lr_warmup_iters=10), 100)
    assert decay_longer[99] == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-12)
    wsd = run(schedule_args(train_iters=100, lr_decay_style="WSD", lr_wsd_decay_iters=20,
                            lr_wsd_decay_style="linear"), 100)
    assert wsd[79] == 1.0 and wsd[89] == pytest.approx(0.55, rel=1e-12)


def test_factory_names_what_is_missing():
    with pytest.raises(ValueError, match="--train-iters or --train-samples"):
        LRScheduleConfig.from_args(schedule_args())
    with pytest.raises(ValueError, match="--lr"):
        LRScheduleConfig.from_args(schedule_args(train_iters=10, lr=None))


def megatron_scheduler_class():
    """Megatron-core's OptimizerParamScheduler, loaded from its source file alone (importing
    megatron.core takes ~10 s)."""
    spec = importlib.util.find_spec("megatron")
    if spec is None:
        pytest.skip("megatron-core is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "core", "optimizer_param_scheduler.py")
    if not os.path.exists(path):
        pytest.skip("megatron-core has no optimizer_param_scheduler.py")
    source = open(path).read().replace("from megatron.core.utils import log_single_rank",
                                       "log_single_rank = lambda *args, **kwargs: None")
    namespace = {"__name__": "megatron_optimizer_param_scheduler"}
    exec(compile(source, path, "exec"), namespace)
    return namespace["OptimizerParamScheduler"]


@pytest.mark.parametrize("style, wsd_style", [
    ("constant", None), ("linear", None), ("cosine", None), ("inverse-square-root", None),
    ("WSD", "exponential"), ("WSD", "linear"), ("WSD", "cosine"), ("WSD", "minus_sqrt"),
])
def test_matches_megatron_core(style, wsd_style):
    Megatron = megatron_scheduler_class()
    theirs_opt, ours_opt = optimizer(), optimizer()
    theirs = Megatron(theirs_opt, init_lr=1e-5, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=96,
                      lr_decay_steps=960, lr_decay_style=style, start_wd=0.1, end_wd=0.1,
                      wd_incr_steps=960, wd_incr_style="constant", wsd_decay_steps=320,
                      lr_wsd_decay_style=wsd_style)
    ours = LRScheduler(ours_opt, init_lr=1e-5, max_lr=3e-4, min_lr=3e-5, warmup_steps=96,
                       decay_steps=960, decay_style=style, wsd_decay_steps=320,
                       wsd_decay_style=wsd_style or "exponential")
    for _ in range(40):   # 32 samples per step, past the end of the decay
        theirs.step(32)
        ours.step(32)
        assert ours_opt.param_groups[0]["lr"] == theirs_opt.param_groups[0]["lr"]
