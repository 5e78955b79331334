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

# Seconds per module (its tests' setup, call and teardown) in `python -m pytest tests -n 2 --durations=0`
# on the 2-core machine shared with other jobs (2026-11-28 16:38-16:57, load 3-10; the three modules
# changed since are at their measured cuts): inflated, but only the order matters, so rough numbers do
# no harm. Every module over 8 s is listed: an unlisted one counts a second a test, so a long module of
# few tests left out (the newest, training/test_muon_driver.py at 59 s, was) could start last and
# hold one worker alone at the end.
MODULE_SECONDS: dict[str, float] = {
    "planner/test_gpu_check.py": 143, "dryrun/test_dry_run_cp_ep.py": 91,
    "model/test_model_torch_compile.py": 90, "docs/test_readme_commands.py": 88,
    "model/test_model_compile_parallel.py": 75, "slurm/test_slurm_cluster.py": 65,
    "training/test_pretrain_resume.py": 62, "training/test_driver_flags.py": 59,
    "training/test_muon_driver.py": 59, "parallel/test_mla_layouts.py": 58, "dryrun/test_dry_run.py": 46,
    "parallel/tensor/test_fp8_model.py": 42, "parallel/tensor/test_gradient_accumulation_fusion.py": 38,
    "planner/test_gpu_model.py": 36, "convert/test_memory.py": 35, "dryrun/test_fake_cuda.py": 35,
    "parallel/test_gdn_layouts.py": 34, "training/test_orderly_end.py": 32, "planner/test_gdn_memory.py": 29,
    "parallel/data/test_data_parallel.py": 28, "dryrun/test_dry_run_stages.py": 27,
    "parallel/test_spawn.py": 27, "parallel/pipeline/test_pipeline_executor.py": 27,
    "checkpoint/test_megatron_core_variants.py": 26, "planner/test_fsdp2.py": 26,
    "kernels/test_bench_kernels.py": 24, "parallel/test_fp8_layouts.py": 23,
    "training/test_megatron_rerun_mode.py": 22, "optimizer/test_muon_layouts.py": 22,
    "training/test_megatron_examples.py": 22, "training/test_launch_base_install.py": 21,
    "training/test_start_up_signal.py": 20, "training/test_job_script.py": 20,
    "model/test_bench_model.py": 19, "convert/test_demo_export.py": 19, "kernels/test_compile_sm90.py": 18,
    "planner/test_gpt3_175b.py": 18, "parallel/pipeline/test_pipeline_hybrid.py": 18,
    "training/test_fp8_resume.py": 16, "planner/test_fp8_planner.py": 16,
    "training/test_async_save_workers.py": 16, "parallel/expert/test_expert_parallel.py": 16,
    "parallel/expert/test_expert_grid.py": 15, "kernels/test_dispatch.py": 15,
    "optimizer/test_muon_moe.py": 15, "parallel/data/test_optimizer_instances.py": 15,
    "kernels/test_custom_ops.py": 14, "checkpoint/test_save_failures.py": 14,
    "kernels/test_bias_dropout_add.py": 13, "optimizer/test_muon.py": 13,
    "training/test_launch_script.py": 13, "optimizer/test_optimizer_context_parallel.py": 12,
    "training/test_megatron_logging_flags.py": 12, "planner/test_verify.py": 12,
    "training/test_mla_driver.py": 11, "parallel/data/test_megatron_fsdp.py": 11, "model/test_gpt_tp.py": 10,
    "convert/test_moe_convert.py": 10, "training/test_metrics.py": 10,
    "checkpoint/test_dcp_checkpoint.py": 10, "training/test_context_parallel_run.py": 10,
    "parallel/tensor/test_bench_fp8.py": 10, "checkpoint/test_model_match.py": 10,
    "dryrun/test_gdn_dry_run.py": 10, "config/test_negative_numbers.py": 9,
    "optimizer/test_optimizer_state.py": 9, "generation/test_generate_moe.py": 9,
    "optimizer/test_optimizer.py": 9, "parallel/pipeline/test_bench_pipeline.py": 9,
    "parallel/expert/test_expert_fsdp_per_token.py": 9, "data/test_preprocess.py": 8,
    "training/test_cuda_graphs.py": 8,
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
