"""Single-process reference runs that several layout tests compare with, computed once per
pytest session (per worker under pytest-xdist) and shared through the `reference_runs` fixture
of tests/conftest.py."""

import inspect


class ReferenceRuns:
    """get(fn, *args, **kwargs) returns fn(*args, **kwargs), calling fn only the first time for
    those arguments. The key is fn's name and the repr of its arguments bound to its signature,
    defaults filled in (model configs are dataclasses, whose repr names every field). Callers
    must not change what it returns."""

    def __init__(self):
        self._results = {}

    def get(self, fn, *args, **kwargs):
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        key = (fn.__module__, fn.__qualname__, repr(sorted(bound.arguments.items())))
        if key not in self._results:
            self._results[key] = fn(*args, **kwargs)
        return self._results[key]
