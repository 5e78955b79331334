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

# Seconds per module (its tests' setup, call and teardown) in `python -m pytest tests -n 2` on the
# 2-core machine shared with other jobs (2026-11-28, load 15-30): inflated, but only the order
# matters, so rough and stale numbers do no harm. Modules under 40 s are left out.
MODULE_SECONDS: dict[str, float] = {
    "planner/test_gpu_check.py": 496, "training/test_pretrain_resume.py": 311, "dryrun/test_dry_run_cp_ep.py": 299,
    "checkpoint/test_user_failures.py": 211, "model/test_model_torch_compile.py": 205,
    "docs/test_readme_commands.py": 189, "model/test_model_compile_parallel.py": 183, "dryrun/test_dry_run.py": 163,
    "training/test_driver_flags.py": 159, "parallel/test_mla_layouts.py": 153,
    "parallel/pipeline/test_pipeline_executor.py": 135, "parallel/expert/test_expert_parallel.py": 113,
    "planner/test_gpu_model.py": 112, "dryrun/test_dry_run_stages.py": 112, "convert/test_training_load.py": 108,
    "convert/test_memory.py": 103, "model/test_bench_model.py": 101, "checkpoint/test_dcp_checkpoint.py": 100,
    "training/test_megatron_rerun_mode.py": 98, "convert/test_demo_export.py": 98,
    "training/test_megatron_training_flags.py": 94, "checkpoint/test_save_failures.py": 91,
    "generation/test_generate_cli.py": 89, "parallel/pipeline/test_pipeline_hybrid.py": 88,
    "parallel/data/test_data_parallel.py": 84, "optimizer/test_optimizer.py": 81,
    "checkpoint/test_model_match.py": 81, "training/test_launch_script.py": 80,
    "training/test_megatron_logging_flags.py": 79, "parallel/data/test_optimizer_instances.py": 77,
    "parallel/expert/test_expert_grid.py": 77, "convert/test_parity.py": 76, "model/test_gpt_tp.py": 73,
    "optimizer/test_optimizer_context_parallel.py": 66, "kernels/test_bench_kernels.py": 59,
    "kernels/test_dispatch.py": 59, "parallel/tensor/test_tp_comm_overlap.py": 58, "parallel/test_state.py": 57,
    "parallel/context/test_attention.py": 56, "model/test_megatron_features.py": 54, "model/test_hf_parity.py": 53,
    "parallel/data/test_megatron_fsdp.py": 53, "kernels/test_cross_entropy.py": 52, "kernels/test_norms.py": 50,
    "kernels/test_compile_sm90.py": 50, "convert/test_moe_convert.py": 50,
    "parallel/expert/test_expert_fsdp_per_token.py": 50, "data/test_loader.py": 49,
    "optimizer/test_optimizer_state.py": 49, "parallel/tensor/test_deferred_wgrad.py": 48,
    "slurm/test_slurm_cluster.py": 47, "training/test_mla_driver.py": 46,
    "parallel/pipeline/test_pipeline_split_accounting.py": 44, "checkpoint/test_megatron_core_variants.py": 43,
    "parallel/test_spawn.py": 43, "kernels/test_activations.py": 40,
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
