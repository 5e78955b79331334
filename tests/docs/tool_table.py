"""The commands of the tools' usage docstrings (also printed by tools/README.md), and the benchmark
commands of tools/benchmarks/README.md and the dry-run and planner documents, each as printed
(the key) -> how it runs at toy scale (see readme_table.py for the rules). Placeholders (CKPT,
HF_DIR, P, N, `[--option X]`, `{a,b}`) become the workspace's files and one of the choices."""

import os

from tests.docs import checks
from tests.docs.readme_table import GPT3_AT_TOY_SIZE
from tests.docs.workspace import CannotRun, Elsewhere, Run, SameAs

GPU = "measures on a GPU (no GPU here); without one it says so and exits 0"
BENCH_MODEL = "tests/model/test_bench_model.py::"
BENCH_KERNELS = "tests/kernels/test_bench_kernels.py::"
BENCH_ATTENTION = "tests/model/test_bench_attention.py::"
DP_SMOKE = ("tests/parallel/data/test_bench_data_parallel.py::"
            "test_smoke_run_prints_both_tables_from_the_measured_numbers",)
PIPELINE_SMOKE = ("tests/parallel/pipeline/test_bench_pipeline.py::"
                  "test_tiny_run_reports_every_runner_and_derived_targets",)
CP_SMOKE = ("tests/parallel/context/test_bench_context_parallel.py::test_bench_smoke_run",)
MOE_SMOKE = ("tests/parallel/expert/test_bench_moe.py::test_bench_moe_smoke",)
DEMO = ("tests/training/test_demo_run.py::test_embedded_default_run",)
GPU_CHECK_SMOKE = "tests/planner/test_gpu_check.py::test_cpu_smoke_runs_every_step_and_one_over_its_budget_is_reported"
FP8_BENCH = "tests/parallel/tensor/test_bench_fp8.py::"
ONE_RUN_FLAGS = ("--input corpus.jsonl --output-prefix data/corpus --tokenizer-type SentencePieceTokenizer "
                 "--tokenizer-model tok.model --append-eod --workers 2")
TINY_DATA_BENCH = "--corpus-mb 0.3 --vocab-size 500"


def _root():
    return None if os.geteuid() == 0 else "--nice -20 needs root (os.nice with a negative increment)"


TOOLS = {
    # tools/train_tokenizer.py, preprocess_data.py, merge_datasets.py, inspect_data.py, make_demo_corpus.py
    "python tools/train_tokenizer.py --input corpus.jsonl --json-keys text --vocab-size 8000 --model-prefix tok":
        Run("doc-train-tokenizer", replace=(("--vocab-size 8000", "--vocab-size 500"),), needs=("corpus",),
            check=checks.sentencepiece(500, "tok.model")),
    "python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --tokenizer-type "
    "SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2":
        Run("doc-preprocess", needs=("corpus", "doc-train-tokenizer", "readme-mkdir-data"),  # writes under data/
            check=checks.tokenised_corpus("data/corpus_text_document", "tok.model")),
    "python tools/preprocess_data.py ... --partitions 64 --partition-index $SLURM_ARRAY_TASK_ID":
        Run("doc-partitions", replace=(("...", ONE_RUN_FLAGS), ("--partitions 64", "--partitions 4")), array=4,
            needs=("corpus", "doc-train-tokenizer", "readme-mkdir-data"), check=checks.partitions("data/corpus", 4)),
    # unquoted, as this docstring prints it: no file matches, so bash passes the pattern on
    "python tools/merge_datasets.py --input data/corpus-*-of-00064_text_document --output-prefix "
    "data/corpus_text_document":
        Run("doc-merge-unquoted", replace=(("00064", "00004"), ("--output-prefix data/corpus_text_document",
                                                                 "--output-prefix data/merged_text_document")),
            needs=("doc-partitions", "doc-preprocess"),
            check=checks.merged_equals_one_run("data/merged_text_document", "data/corpus_text_document")),
    "python tools/merge_datasets.py --input 'data/corpus-*-of-00064_text_document' --output-prefix "
    "data/corpus_text_document":
        Run("doc-merge-quoted", replace=(("00064", "00004"), ("--output-prefix data/corpus_text_document",
                                                               "--output-prefix data/merged_quoted_text_document")),
            needs=("doc-partitions", "doc-preprocess"),
            check=checks.merged_equals_one_run("data/merged_quoted_text_document", "data/corpus_text_document")),
    "python tools/inspect_data.py data/corpus_text_document --tokenizer-type SentencePieceTokenizer "
    "--tokenizer-model tok.model --show 3":
        Run("doc-inspect", needs=("doc-preprocess",), check=checks.inspected("data/corpus_text_document")),
    "python tools/make_demo_corpus.py --output demo.jsonl [--max-mb 4]":
        Run("doc-make-demo-corpus", replace=(("[--max-mb 4]", f"--max-mb {0.3}"),), needs=("corpus",),
            check=checks.same_bytes("demo.jsonl", "corpus.jsonl")),
    "python tools/plot_metrics.py runs/demo/metrics.jsonl --output runs/demo/loss.png":
        Run("doc-plot-metrics", replace=(("runs/demo/", "checkpoints/gpt2_124m/"),), needs=("readme-train-gpt2",),
            check=checks.png("checkpoints/gpt2_124m/loss.png")),
    "python tools/demo_summary.py --metrics-file M.jsonl --data-path PREFIX [--checkpoint DIR] [--plot PNG]":
        Elsewhere(DEMO, "the embedded default runs it on its own run's files; it exits 1 unless the validation "
                        "loss is below the corpus's unigram entropy, which no 2-iteration toy run reaches"),
    # tools/checkpoint/convert.py and megalite/convert/cli.py
    "python tools/checkpoint/convert.py --loader hf --saver megalite --load-dir HF_DIR --save-dir OUT "
    "--target-tensor-parallel-size 2 --target-pipeline-parallel-size 2":
        SameAs("readme-convert-to-megalite", replace=(("HF_DIR", "llama-hf/"), ("OUT", "checkpoints/llama"))),
    "python tools/checkpoint/convert.py --loader megalite --saver hf --load-dir CKPT --save-dir HF_OUT":
        SameAs("readme-convert-to-hf", replace=(("HF_OUT", "llama-out/"), ("CKPT", "checkpoints/llama"))),
    "python tools/checkpoint/convert.py --loader megalite --saver megalite --load-dir CKPT --save-dir OUT "
    "--target-tensor-parallel-size 4":
        Run("doc-convert-reshard", replace=(("CKPT", "checkpoints/llama"), ("OUT", "checkpoints/llama-tp4")),
            needs=("readme-convert-to-megalite",), slow=True,  # TP=4, the source's PP=2 kept: 8 processes
            check=checks.all_of(checks.printed(r"^To train from it \(8 processes"),
                                checks.same_weights("checkpoints/llama", "checkpoints/llama-tp4"))),
    "python tools/checkpoint/convert.py --loader megatron --saver {megalite,hf} --load-dir MEGATRON_SAVE "
    "--save-dir OUT":
        Run("doc-convert-megatron", replace=(("{megalite,hf}", "megalite"), ("MEGATRON_SAVE", "megatron/ckpt"),
                                             ("OUT", "checkpoints/from-megatron-ckpt")),
            needs=("megatron",), slow=True, check=checks.printed(r"^To train from it \(1 processes")),
    "python tools/checkpoint/convert.py --loader hf --saver megalite --load-dir MIXTRAL_DIR --save-dir OUT "
    "--target-tensor-parallel-size 2 --target-expert-parallel-size 2 --target-expert-tensor-parallel-size 1":
        Elsewhere(("tests/convert/test_moe_convert.py::test_the_printed_command_trains_from_the_moe_checkpoint",),
                  "the test converts a tiny random Mixtral built with transformers with these flags and runs the "
                  "training command convert.py prints"),
    # tools/generate.py and megalite/inference/cli.py
    'python tools/generate.py --load CKPT --prompt "Once upon a time" --max-new-tokens 32 --temperature 0':
        Run("doc-generate", replace=(("CKPT", "checkpoints/llama"),), needs=("readme-convert-to-megalite",), slow=True,
            check=checks.generated("Once upon a time")),
    "torchrun --nproc-per-node 2 tools/generate.py --load CKPT --tensor-model-parallel-size 2 --prompt-file P.txt":
        Run("doc-generate-tp2", replace=(("CKPT", "checkpoints/llama"),),
            needs=("readme-convert-to-megalite", "prompts"), slow=True,
            check=checks.printed(r"^def fibonacci\(n\):", r"^import os")),
    'python tools/generate.py --load CKPT --prompt "def main(" --max-new-tokens 64 --temperature 0':
        Run("doc-generate-cli", replace=(("CKPT", "checkpoints/llama"),), needs=("readme-convert-to-megalite",),
            slow=True, check=checks.generated("def main(")),
    "torchrun --nproc-per-node 2 tools/generate.py --load CKPT --tensor-model-parallel-size 2 --prompt-file "
    "prompts.txt --top-p 0.9 --seed 7":
        Run("doc-generate-cli-tp2", replace=(("CKPT", "checkpoints/llama"),),
            needs=("readme-convert-to-megalite", "prompts"), slow=True,
            check=checks.printed(r"^def fibonacci\(n\):", r"^import os")),
    # megalite/planner/cli.py (its first and third lines are megalite/planner/README.md's)
    "python tools/plan.py --cluster h100 --num-gpus 64 --hf-config llama3_8b/config.json --seq-length 8192 "
    "--global-batch-size 512":
        Run("doc-plan-hf", replace=(("--num-gpus 64", "--num-gpus 2"), ("llama3_8b/", "llama3-8b/"),
                                    ("--seq-length 8192", "--seq-length 64"), ("--global-batch-size 512",
                                                                               "--global-batch-size 8")),
            needs=("llama3-config",), slow=True,
            check=checks.printed(r"^   NPROC_PER_NODE=2 bash scripts/pretrain_gpt.sh ")),
    "python tools/plan.py --cluster cpu8.json -- --config model.yaml":
        Run("doc-plan-yaml", needs=("readme-calibrate", "model-yaml"), slow=True,
            check=checks.printed(r"^   NPROC_PER_NODE=2 bash scripts/pretrain_gpt.sh ")),
    # tools/megatron_functional_configs.py
    "python tools/megatron_functional_configs.py count [--set gpt|moe] [--verbose]":
        Run("doc-functional-configs-count", replace=(("[--set gpt|moe] [--verbose]", "--verbose"),), slow=True,
            check=checks.printed(r"^gpt: 152 of 161 configs parse and validate for their own world size")),
    "python tools/megatron_functional_configs.py count":
        SameAs("doc-functional-configs-count", replace=(("count", "count [--set gpt|moe] [--verbose]"),)),
    "python tools/megatron_functional_configs.py extract --megatron-lm ~/Megatron-LM":
        CannotRun("needs a Megatron-LM checkout, which nothing here may download; the JSON files it wrote are "
                  "vendored and read by the count", ("tests/config/test_megatron_functional_configs.py::test_accepted_count",
                                                     "run:doc-functional-configs-count")),
}

BENCHMARKS = {
    # tools/benchmarks/README.md, megalite/dryrun/README.md, megalite/planner/README.md
    "python tools/benchmarks/bench_model.py --time-limit 540 --output bench_model.md": CannotRun(GPU, (
        BENCH_MODEL + "test_without_gpu_says_so_and_exits_0",
        BENCH_MODEL + "test_time_limit_skips_rows_that_would_not_fit",
        BENCH_MODEL + "test_cpu_smoke_every_row_and_kernel_benchmark")),
    "python tools/benchmarks/bench_kernels.py": CannotRun(GPU, (
        BENCH_KERNELS + "test_without_gpu_says_so_and_exits_0", BENCH_KERNELS + "test_cpu_smoke_prints_a_table")),
    "python tools/benchmarks/bench_data.py --skip-index --repeats 3":
        Run("readme-bench-data", replace=(("--repeats 3", "--repeats 1"),), append=TINY_DATA_BENCH, slow=True,
            check=checks.printed(r"megalite 2 workers takes")),
    "python tools/benchmarks/bench_data_preprocess.py --compare 200 [--rounds 3]": Elsewhere(
        ("tests/data/test_bench_preprocess.py::test_compare_alternates_the_order_and_checks_the_outputs",),
        "the comparison at 0.3 MB, 2 rounds, vocabulary 300"),
    "python tools/benchmarks/bench_data_parallel.py": Elsewhere(DP_SMOKE, "the benchmark at its docstring's tiny size"),
    "python tools/benchmarks/bench_pipeline.py --rounds 40": Elsewhere(PIPELINE_SMOKE, "the benchmark at a tiny size "
                                                                                       "(hidden 16, 3 rounds)"),
    "python tools/benchmarks/bench_context_parallel.py --rounds 3": Elsewhere(CP_SMOKE, "the benchmark at sequence 64"),
    "python tools/benchmarks/bench_quantize.py --load /tmp/megalite-demo/checkpoints "
    "--data-path /tmp/megalite-demo/data/demo_text_document":
        Elsewhere(("tests/generation/test_generate_cli.py::test_bench_quantize_reports_memory_and_perplexity",),
                  "the benchmark on a toy checkpoint and a 3-document corpus instead of the demo's"),
    "python tools/benchmarks/bench_moe.py": Elsewhere(MOE_SMOKE, "the benchmark at its docstring's smoke size"),
    "python tools/benchmarks/bench_fp8_convergence.py --output-dir tools/benchmarks": Elsewhere(
        (FP8_BENCH + "test_convergence_smoke_writes_the_three_curves_and_their_ratios",),
        "the benchmark at 3 iterations, 1 layer of hidden 32, on a 0.1 MB corpus (its 200 iterations take most of "
        "an hour of a shared 2-core CPU)"),
    "python tools/benchmarks/bench_fp8.py [--json out.json]": CannotRun(GPU, (
        FP8_BENCH + "test_bench_fp8_without_a_gpu_says_so", FP8_BENCH + "test_bench_fp8_holds_each_model_to_its_targets",
        GPU_CHECK_SMOKE)),
    "python tools/benchmarks/bench_fp8.py": CannotRun(GPU, (
        FP8_BENCH + "test_bench_fp8_without_a_gpu_says_so", FP8_BENCH + "test_bench_fp8_holds_each_model_to_its_targets",
        GPU_CHECK_SMOKE)),
    "python tools/benchmarks/bench_fp8.py --cpu-smoke": Elsewhere(
        (GPU_CHECK_SMOKE,), "gpu_check.sh --cpu-smoke runs it (--models 8b-layers: the 8B layers' two runs at toy size)"),
    "python tools/benchmarks/bench_host_overhead.py [--calls 300] [--ops rms_norm,swiglu] [--shape 8,2048]": Elsewhere(
        ("tests/planner/test_gpu_check.py::test_cpu_smoke_runs_every_step_and_one_over_its_budget_is_reported", "tests/kernels/test_host_path.py"),
        "gpu_check.sh's CPU smoke run runs it (--ops rms_norm); its host-only driver is the kernels' host-path test's"),
    "python tools/benchmarks/gpu_check_report.py rates --trace TRACE.json --bench-kernels LOG --cluster h200 --out "
    "kernel_rates.json -- PRETRAIN_GPT_FLAGS (the profiled run's model and layout)": Elsewhere(
        ("tests/planner/test_gpu_check.py::test_profile_summary_classes_and_idle_time",
         "tests/planner/test_gpu_check.py::test_rates_invert_the_traffic_model",
         "tests/planner/test_gpu_check.py::test_cpu_smoke_runs_every_step_and_one_over_its_budget_is_reported"),
        "gpu_check.sh runs it on its profiled step; the tests feed it made-up traces"),
    "python tools/benchmarks/gpu_check_report.py table --logs DIR --out gpu_check.md --command \"...\" [--gpu NAME]":
        Elsewhere(("tests/planner/test_gpu_check.py::test_logs_are_summarised",
                   "tests/planner/test_gpu_check.py::test_cpu_smoke_runs_every_step_and_one_over_its_budget_is_reported"),
                  "gpu_check.sh ends with it; the tests give it made-up logs"),
    "PYTHONPATH=tools/benchmarks python -m pytest -p pytest_stream --stream-results FILE ...": Elsewhere(
        ("tests/planner/test_gpu_check_tests_step.py::test_a_killed_run_names_every_failure_and_what_it_was_running",
         "tests/planner/test_gpu_check_tests_step.py::test_under_xdist_the_controller_alone_writes"),
        "the tests run it on a made-up test file (killed mid-run, and under xdist); gpu_check.sh's tests step loads it"),
    "bash tools/benchmarks/gpu_check.sh": CannotRun(GPU, (
        "tests/planner/test_gpu_check.py::test_without_a_gpu_it_says_so_and_exits_0",
        "tests/planner/test_gpu_check.py::test_cpu_smoke_runs_every_step_and_one_over_its_budget_is_reported")),
    "python tools/benchmarks/bench_host_overhead.py": Elsewhere(
        ("tests/planner/test_gpu_check.py::test_cpu_smoke_runs_every_step_and_one_over_its_budget_is_reported", "tests/kernels/test_host_path.py"),
        "gpu_check.sh's CPU smoke run runs it (--ops rms_norm); every op takes minutes of CPU at 200 batches"),
    "python tools/plan.py --cluster h200 --kernel-rates kernel_rates.json -- ...": Elsewhere(
        ("tests/planner/test_gpu_check.py::test_the_rates_file_feeds_the_planner",),
        "the planner reading a rates file gpu_check_report.py wrote"),
    "python tools/benchmarks/dry_run_llama3.py": Elsewhere(
        ("run:doc-dry-run-llama3", "run:readme-dry-run-405b"), "all four models take minutes of CPU: one (8B, TP1) "
        "runs through the same runner, and the 405B layout as megalite/dryrun/README.md writes it"),
    "python tools/benchmarks/bench_plan.py --json out.json": Elsewhere(
        ("run:doc-bench-plan",), "the docstring's --world-sizes/--json entry runs the benchmark at one world size "
        "and 2 iterations"),
    "python tools/plan.py --cluster a100-megatron2021 --num-gpus 1024 --recompute full --sequence-parallel off "
    "--distributed-optimizer off --simulate 30 --top 25 -- --num-layers 96 --hidden-size 12288 --num-attention-heads "
    "96 --seq-length 2048 --max-position-embeddings 2048 --global-batch-size 1536 --fp16 --tokenizer-type "
    "NullTokenizer --vocab-size 51199 --attention-backend unfused":
        Run("readme-plan-gpt3-paper", replace=GPT3_AT_TOY_SIZE + (
            ("--seq-length 2048 --max-position-embeddings 2048", "--seq-length 64 --max-position-embeddings 64"),),
            slow=True, check=checks.printed(r"^   NPROC_PER_NODE=2 bash .* --recompute-granularity full")),
    "python -m pytest tests -m slow": CannotRun("the slow suite, which holds this test's slow entries: run from "
                                                "here it would run this test again"),
    # tools/benchmarks/*.py docstrings
    "python tools/benchmarks/bench_context_parallel.py": Elsewhere(CP_SMOKE, "the benchmark at sequence 64"),
    "python tools/benchmarks/bench_context_parallel.py --json out.json":
        Run("doc-bench-cp-json", replace=(("out.json", "out-cp.json"),), append="--seq 64 --rounds 1 --memory-seq 64",
            slow=True, timeout=900, check=checks.files("out-cp.json")),
    "python tools/benchmarks/bench_context_parallel.py --seq 256 --rounds 1 --memory-seq 256":
        Elsewhere(CP_SMOKE, "these flags at sequence 64"),
    "python tools/benchmarks/bench_data.py": Elsewhere(("run:doc-bench-data-small",), "full size is a 12 MB corpus and "
                                                       "a 1e9-token index; --small runs the same steps"),
    "python tools/benchmarks/bench_data.py --small":
        Run("doc-bench-data-small", replace=(("--small", "--small --repeats 1"),), append=TINY_DATA_BENCH, slow=True,
            check=checks.printed(r"megalite 2 workers takes", r"index")),
    "python tools/benchmarks/bench_data_index.py --child ours --prefix P --seq-length 2048 --num-samples N":
        Run("doc-bench-data-index", replace=(("--prefix P", "--prefix data/corpus_text_document"),
                                             ("--seq-length 2048", "--seq-length 64"),
                                             ("--num-samples N", "--num-samples 100")),
            needs=("doc-preprocess",), check=checks.printed(r'"samples": \d+')),
    "python tools/benchmarks/bench_data_parallel.py": Elsewhere(DP_SMOKE, "the benchmark at its docstring's tiny size"),
    "python tools/benchmarks/bench_data_parallel.py --json out.json": Elsewhere(DP_SMOKE, "with --json, tiny size"),
    "python tools/benchmarks/bench_data_parallel.py --layers 1 --hidden 64 --vocab 256 --seq 16 --rounds 2":
        Elsewhere(DP_SMOKE, "these flags, with --bucket-size 10000 and --json"),
    "python tools/benchmarks/bench_attention.py [--quick] [--shapes driver,gpt2,mla,driver-dropout]": CannotRun(GPU, (
        BENCH_ATTENTION + "test_without_gpu_says_so_and_exits_0",
        BENCH_ATTENTION + "test_measured_order_is_fastest_first_per_head_widths_and_leaves_dropout_out")),
    "python tools/benchmarks/bench_attention.py --cpu-smoke": Elsewhere(
        (BENCH_ATTENTION + "test_cpu_smoke_checks_and_times_each_kernel",), "this command"),
    "python tools/benchmarks/bench_kernels.py [--quick] [--ops rms_norm,cross_entropy] [--compile]": CannotRun(GPU, (
        BENCH_KERNELS + "test_cpu_smoke_prints_a_table", BENCH_KERNELS + "test_unknown_op_is_rejected")),
    "python tools/benchmarks/bench_model.py --output bench.md": CannotRun(GPU, (
        BENCH_MODEL + "test_without_gpu_says_so_and_exits_0",)),
    "python tools/benchmarks/bench_model.py --time-limit 540 --output bench.md": CannotRun(GPU, (
        BENCH_MODEL + "test_time_limit_skips_rows_that_would_not_fit",)),
    "python tools/benchmarks/bench_model.py --models llama-1.3b --skip-kernels --micro-batch-size llama-1.3b=4":
        CannotRun(GPU, (BENCH_MODEL + "test_cpu_smoke_rows_without_triton",)),
    "python tools/benchmarks/bench_model.py --cpu-smoke": Elsewhere(
        (BENCH_MODEL + "test_cpu_smoke_every_row_and_kernel_benchmark",), "this command (slow)"),
    "python tools/benchmarks/bench_moe.py --layers 1 --hidden 32 --steps 2": Elsewhere(MOE_SMOKE, "these flags (and "
                                                                                      "--ffn 32 --seq 16) in process"),
    "python tools/benchmarks/bench_pipeline.py": Elsewhere(PIPELINE_SMOKE, "the benchmark at a tiny size"),
    "python tools/benchmarks/bench_pipeline.py --nice -20 --json out.json":
        Run("doc-bench-pipeline-nice", replace=(("out.json", "out-pipeline.json"),),
            append="--microbatches 2 --hidden 16 --seq 4 --rounds 3", slow=True, requires=_root,
            check=checks.files("out-pipeline.json")),
    "python tools/benchmarks/bench_plan.py": Elsewhere(("run:doc-bench-plan",), "at one world size, 2 iterations"),
    "python tools/benchmarks/bench_plan.py --world-sizes 8 --json out.json":
        Run("doc-bench-plan", replace=(("--world-sizes 8", "--world-sizes 4"), ("out.json", "out-plan.json")),
            append="--iterations 2 --skip 1", slow=True, timeout=1200,
            check=checks.all_of(checks.files("out-plan.json"), checks.printed(r"^Spearman .* \(target >= 0.8\)"),
                                checks.printed(r"^targets (met|missed): Spearman"))),
    "python tools/benchmarks/bench_plan.py --calibrate-each": Elsewhere(
        ("run:doc-bench-plan",), "the same benchmark with a calibration before each run instead of once"),
    "python tools/benchmarks/dry_run_llama3.py [8b-tp1 8b-tp2 70b 405b]":
        Run("doc-dry-run-llama3", replace=(("[8b-tp1 8b-tp2 70b 405b]", "8b-tp1"),), slow=True, timeout=900,
            check=checks.printed(r"8B")),
}
