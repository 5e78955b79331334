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
MODULE_SECONDS: dict[str, float] = {
    "dryrun/test_dry_run.py": 163, "docs/test_readme_commands.py": 130, "dryrun/test_dry_run_cp_ep.py": 127,
    "checkpoint/test_dcp_checkpoint.py": 56, "checkpoint/test_user_failures.py": 39, "data/test_loader.py": 38,
    "convert/test_demo_export.py": 34, "checkpoint/test_megatron_core_variants.py": 31, "convert/test_memory.py": 30,
    "convert/test_parity.py": 26, "convert/test_moe_convert.py": 20, "checkpoint/test_save_failures.py": 19,
    "convert/test_training_load.py": 19, "checkpoint/test_model_match.py": 18,
}


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
