"""SIGTERM and SIGUSR1 (Slurm's warning before a time limit), remembered until the run can act
on them. It imports nothing heavy: pretrain_gpt installs it before it imports torch, so that a
signal during start-up is not the default action's instant death (no exit reason written, no
requeue) but a stop before the first iteration."""

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Remembers a SIGTERM / SIGUSR1 (its number) until the loop reaches an iteration boundary."""

    def __init__(self):
        self.received = 0
        self._previous = {}

    def __enter__(self):
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = max(self.received, signum)  # SIGTERM (15) outranks SIGUSR1 (10)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def signal_name(number: float) -> str:
    return signal.Signals(int(number)).name
