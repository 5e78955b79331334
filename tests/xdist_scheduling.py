"""How `python -m pytest tests -n 2` (pytest-xdist) shares the suite between its workers: whole
modules, so that a module-scoped fixture (one spawn of gloo ranks whose results a module's tests
check, a trained checkpoint) runs once rather than once on each worker; modules that share a
session fixture travel together (SHARED_SCOPES); and the most expensive module still waiting
goes to the next free worker (MODULE_SECONDS, measured), so that no long module starts last
and leaves the other worker idle. Modules not listed count a second a test."""

from xdist.scheduler import LoadScopeScheduling

# Modules that share a costly session-scoped fixture: one worker runs them all, the fixture once.
SHARED_SCOPES = {
    "training/test_launch_script.py": "trained_run",  # tests/training/conftest.py's training run
    "training/test_driver_flags.py": "trained_run",
}

# Seconds per module in the serial suite on the 2-core machine (2026-11-28, --durations, the
# machine shared): only the order matters, so rough and stale numbers do no harm.
MODULE_SECONDS: dict[str, float] = {}


class ModuleScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0].removeprefix("tests/")  # node ids may start at tests/ or in it
        return SHARED_SCOPES.get(module, module)

    def _cost(self, scope: str) -> float:
        tests = len(self.workqueue[scope])
        modules = [m for m, s in SHARED_SCOPES.items() if s == scope] or [scope]
        return sum(MODULE_SECONDS.get(m, 0.0) for m in modules) or float(tests)

    def _assign_work_unit(self, node) -> None:
        self.workqueue.move_to_end(max(self.workqueue, key=self._cost), last=False)
        super()._assign_work_unit(node)
