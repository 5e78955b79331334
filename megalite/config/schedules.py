"""The schedules the options define: the learning-rate schedule's lengths in samples
(schedule_lengths_from_args), and the global batch size of each iteration: constant, Megatron's --rampup-batch-size, or its
--step-batch-size-schedule. Both depend on the samples consumed so far, as in Megatron's
num-microbatches calculators:

    rampup (start, increment, ramp samples) to B:
        B_now = B                                  once consumed > ramp samples
        B_now = start + increment * floor(consumed / (ramp samples / ((B - start) / increment)))
    step schedule "T0:B0 T1:B1 ..." (thresholds in tokens, T0 = 0):
        B_now = B_k for the largest T_k / seq_length <= consumed

A ramp-up needs --train-samples; a step schedule runs with --train-samples (iterations until
the samples are consumed) or --train-iters. With --train-iters Megatron, which refuses
--global-batch-size beside a step schedule, leaves the global batch size at its default
--micro-batch-size x DP, and that is what the learning-rate schedule's iteration counts are
multiplied by (iteration_samples).

    schedule = batch_schedule_from_args(args)
    for each iteration: b = schedule.at(consumed_samples); micro-batches = b / (mbs x DP)
"""


def parse_threshold(text: str, fail) -> int:
    """'250B' -> 250_000_000_000; suffixes K M B T as Megatron reads them."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
    text = text.strip().upper()
    factor = scale.get(text[-1:], 1)
    number = text[:-1] if factor > 1 else text
    try:
        return int(float(number) * factor)
    except ValueError:
        fail(f"--step-batch-size-schedule: {text!r} is not a number (suffixes K, M, B, T)")


class BatchSchedule:
    def __init__(self, final: int, *, rampup: tuple[int, int, int] | None = None,
                 steps: list[tuple[int, int]] | None = None):
        """`final`: the global batch size after any ramp-up; `steps`: (threshold in samples,
        batch size) sorted, the first at 0."""
        self.final, self.rampup, self.steps = final, rampup, steps
        if rampup is not None:
            start, increment, samples = rampup
            increments = (final - start) // increment
            self.samples_per_increment = samples / increments if increments else float("inf")

    @property
    def varies(self) -> bool:
        return self.rampup is not None or self.steps is not None

    def at(self, consumed_samples: int) -> int:
        """The global batch size of the iteration that starts after `consumed_samples`."""
        if self.steps is not None:
            size = self.steps[0][1]
            for threshold, batch in self.steps:
                if consumed_samples >= threshold:
                    size = batch
            return size
        if self.rampup is None or consumed_samples > self.rampup[2]:
            return self.final
        start, increment, _ = self.rampup
        return min(self.final, start + increment * int(consumed_samples / self.samples_per_increment))

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a --train-samples run, counted as Megatron's update_train_iters counts
        them: the ramp-up's iterations, then whole batches of the final size; a step schedule's
        iterations until the samples are reached."""
        iterations = consumed = 0
        if self.steps is not None:
            while consumed < train_samples:
                consumed += self.at(consumed)
                iterations += 1
            return iterations
        if self.rampup is not None:
            while consumed <= self.rampup[2] and consumed <= train_samples:
                consumed += self.at(consumed)
                iterations += 1
        return iterations + (train_samples - consumed) // self.final

    def samples(self, iterations: int) -> int:
        """The samples `iterations` iterations consume from the start."""
        consumed = 0
        for _ in range(iterations):
            consumed += self.at(consumed)
        return consumed

    def sizes(self, train_samples: int | None, train_iters: int | None = None) -> list[int]:
        """Every batch size a run of `train_samples` (or of `train_iters` iterations) uses."""
        seen, consumed = [], 0
        for _ in range(self.train_iters(train_samples) if train_samples is not None else train_iters):
            size = self.at(consumed)
            if size not in seen:
                seen.append(size)
            consumed += size
        return seen or [self.final]


def parse_step_schedule(text: str, seq_length: int, parse_threshold) -> list[tuple[int, int]]:
    """'0:768 250B:1536' -> [(0, 768), (250e9 // seq_length, 1536)] (thresholds to samples)."""
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, batch = entry.split(":", 1)
        steps.append((parse_threshold(threshold) // seq_length, parse_threshold(batch)))
    return sorted(steps)


def batch_schedule_from_args(args, fail=None) -> BatchSchedule:
    def default_fail(message):
        raise ValueError(message)

    fail = fail or default_fail
    if args.step_batch_size_schedule is not None:
        steps = parse_step_schedule(args.step_batch_size_schedule, args.seq_length,
                                    lambda t: parse_threshold(t, fail))
        if steps[0][0] != 0:
            fail(f"--step-batch-size-schedule {args.step_batch_size_schedule!r}: the first threshold must be 0")
        if len({t for t, _ in steps}) != len(steps) or any(b <= 0 for _, b in steps):
            fail(f"--step-batch-size-schedule {args.step_batch_size_schedule!r}: thresholds must differ "
                 "and batch sizes be positive")
        return BatchSchedule(steps[-1][1], steps=steps)
    if args.rampup_batch_size is not None:
        return BatchSchedule(args.global_batch_size, rampup=tuple(int(v) for v in args.rampup_batch_size))
    return BatchSchedule(args.global_batch_size)


def iteration_samples(args) -> int:
    """Samples per iteration in an iteration-based (--train-iters) learning-rate schedule:
    --global-batch-size, or under a step batch-size schedule Megatron's global batch size, which
    it leaves at --micro-batch-size x DP (see the module doc)."""
    if getattr(args, "step_batch_size_schedule", None) is not None:  # schedule-only namespaces lack it
        return args.micro_batch_size * args.data_parallel_size
    return args.global_batch_size


def schedule_lengths_from_args(args) -> dict:
    """Warmup, decay and WSD-decay lengths in samples, as Megatron computes them.

    With --train-iters: iterations x --global-batch-size (decay defaults to --train-iters; under
    --step-batch-size-schedule, x --micro-batch-size x DP as in Megatron: iteration_samples);
    with --train-samples: samples (decay defaults to --train-samples). --lr-warmup-fraction
    is a fraction of the decay length."""
    if args.train_iters is None and args.train_samples is None:
        raise ValueError("an lr schedule needs --train-iters or --train-samples")
    if args.train_samples is not None:
        decay = args.lr_decay_samples or args.train_samples
        wsd = args.lr_wsd_decay_samples
        warmup = args.lr_warmup_samples
    else:
        batch = iteration_samples(args)
        decay = (args.lr_decay_iters or args.train_iters) * batch
        wsd = args.lr_wsd_decay_iters * batch if args.lr_wsd_decay_iters is not None else None
        warmup = args.lr_warmup_iters * batch
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return {"warmup_steps": warmup, "decay_steps": decay, "wsd_decay_steps": wsd}
