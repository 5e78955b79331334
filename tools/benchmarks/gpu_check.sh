#!/usr/bin/env bash
# megalite on one GPU in one command (issue 23): the CUDA tests, the kernel and model benchmarks,
# and three driver runs, each beside its dry-run peak and the planner's step, in <= 8 minutes.
#
#   bash tools/benchmarks/gpu_check.sh [--out FILE] [--budget SECONDS] [--only STEPS]
#   bash tools/benchmarks/gpu_check.sh --cpu-smoke     # every step at toy scale on the CPU (CI)
#
# Steps (--only takes a comma-separated subset; default all):
#   tests    TRITON_INTERPRET=0 pytest tests/kernels (but test_compile_sm90.py, which needs no GPU)
#            tests/optimizer/test_optimizer_cuda.py (each test's start and outcome streamed to a file as
#            they happen, tools/benchmarks/pytest_stream.py, so a run killed at its budget still names
#            its failures and what it was running; over the host's cores with pytest-xdist
#            and 90 s a test with pytest-timeout, where installed), and the
#            "cuda" cases of tests/model/test_gpt_tp.py and tests/parallel/tensor/test_tp_layers.py
#            (pytest -k cuda: their device parameter) and tests/generation/test_quantize.py (--quantize
#            int4 on CUDA: torchao's tinygemm layout, where torchao is installed); meanwhile, on the CPU, each driver run's dry
#            run (--dry-run on fake CUDA: its peak against the run's torch.cuda.max_memory_allocated)
#            and planner prediction (tools/plan.py, --cluster h200 or h100 by the GPU's name,
#            --num-gpus 1, restricted to the run's own layout)
#   kernels  tools/benchmarks/bench_kernels.py --quick, tools/benchmarks/bench_host_overhead.py
#            (each operator's host time per call beside a trivial Triton launch), and
#            tools/benchmarks/bench_attention.py --quick (each SDPA attention kernel alone, and the
#            flash_attn package, forward and backward at the driver's, GPT-2's and MLA's shapes,
#            with its share of the bf16 peak and the measured order for attention_kernels.MEASURED)
#   drivers  the three runs issue 23 measured (python -m megalite.pretrain_gpt ... --mock-data,
#            8 iterations, --log-interval 1, --metrics-file): a 1.1B Llama; Llama-3-8B layer
#            shapes, 4 layers, s=8192, --use-distributed-optimizer; the 1.1B with full recompute.
#            ms/step is the median over iterations 3-8 but the profiled one; the first run
#            profiles its 7th iteration (torch.profiler), whose kernel times by class become
#            kernel_rates.json beside the output file (plan.py --kernel-rates reads it), and the
#            planner predicts the three again with those rates; then the 1.1B with --torch-compile
#            --cross-entropy-loss-fusion, and that with --cuda-graph-impl local (both dropout 0; the
#            report gives their largest relative loss difference)
#   fp8      tools/benchmarks/bench_fp8.py (issue 31): the 8B layers and the 1.1B above in bf16 and with
#            --fp8-format hybrid --fp8-recipe tensorwise, 8 steps each in one process: tokens/s and loss
#            ratios against the targets (>= 1.25x and loss within 1% for the 8B layers, >= 1.1x for the 1.1B)
#   model    tools/benchmarks/bench_model.py --quick --skip-kernels (all rows, both models) with
#            --time-limit set to the time left: rows that do not fit say "not measured"
# Each step runs under `timeout` with its budget (a step that fails or times out is reported and
# the script goes on); the table ends the output and goes to --out (default $OUT/gpu_check.md
# when $OUT is set, else ./gpu_check.md), the logs to gpu_check_logs/ beside it. Budgets in
# seconds, overridable: BUDGET_TESTS=200 BUDGET_KERNELS=60 BUDGET_RUN=60 (each driver run;
# BUDGET_RUN_1B=90 for the profiled one, BUDGET_RUN_FAST=75 for the compiled ones)
# BUDGET_HOST=30 BUDGET_ATTENTION=60 BUDGET_DRY=120 (each dry run) BUDGET_PLAN=60 BUDGET_FP8=150;
# bench_model gets what is left of --budget (480): --only model gives it the whole budget. With
# --cpu-smoke the budget is 1200 and each step's 2-4 times the above.
# Without a GPU it says so and exits 0. Runs from any directory; python is $PYTHON or python3.
# Pure-Python wheels carried to a machine without a package index: each *.whl in $GPU_CHECK_WHEELS
# (default tools/benchmarks/wheels/, git-ignored) is unpacked into a scratch folder put first on
# every step's PYTHONPATH, e.g. fla-core 0.6.0 and its einops (pip download --no-deps there, where
# an index is) for Gated DeltaNet's fla kernels (tests/kernels/test_gated_delta_fla_cuda.py).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 2
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
MODE=gpu
OUT_FILE=""
ONLY="tests,kernels,drivers,fp8,model"
TOTAL=""
COMMAND="bash tools/benchmarks/gpu_check.sh $*"

while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) MODE=smoke ;;
    --out) OUT_FILE="${2:?--out needs a file}"; shift ;;
    --budget) TOTAL="${2:?--budget needs seconds}"; shift ;;
    --only) ONLY="${2:?--only needs steps}"; shift ;;
    -h|--help) sed -n '2,/^set -uo pipefail/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for step in ${ONLY//,/ }; do
  case "$step" in tests|kernels|drivers|fp8|model) ;; *) echo "gpu_check.sh: --only: unknown step $step" >&2; exit 2 ;; esac
done
# a CPU smoke run is no measurement: the budgets only keep it bounded, on a slow shared CPU
if [ "$MODE" = smoke ]; then
  TOTAL=${TOTAL:-1200}
  for b in TESTS:300 KERNELS:120 HOST:120 ATTENTION:120 RUN:180 RUN_1B:180 RUN_FAST:180 DRY:240 PLAN:120 FP8:240; do
    var=BUDGET_${b%%:*}; [ -n "${!var:-}" ] || export "$var=${b#*:}"
  done
else
  TOTAL=${TOTAL:-480}
fi
case "$TOTAL" in *[!0-9]*) echo "gpu_check.sh: --budget must be whole seconds, got $TOTAL" >&2; exit 2 ;; esac

if [ "$MODE" = gpu ]; then
  GPU_NAME="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>/dev/null)"
  if [ -z "$GPU_NAME" ]; then
    echo "gpu_check: no CUDA GPU on this machine, nothing to measure (--cpu-smoke checks the script on the CPU)"
    exit 0
  fi
  case "$GPU_NAME" in *H200*) CLUSTER=h200 ;; *) CLUSTER=h100 ;; esac
else
  GPU_NAME="CPU (smoke run: the numbers mean nothing)"
  CLUSTER=h200
fi
if [ -z "$OUT_FILE" ]; then OUT_FILE="${OUT:+$OUT/}gpu_check.md"; fi
mkdir -p "$(dirname "$OUT_FILE")" || exit 2
LOGS="$(cd "$(dirname "$OUT_FILE")" && pwd)/gpu_check_logs"
RATES="$(dirname "$LOGS")/kernel_rates.json"
rm -rf "$LOGS" && mkdir -p "$LOGS" || exit 2
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
CARRIED=""
for wheel in "${GPU_CHECK_WHEELS:-$REPO/tools/benchmarks/wheels}"/*.whl; do
  [ -e "$wheel" ] || continue
  "$PY" -m zipfile -e "$wheel" "$SCRATCH/wheels" 2>/dev/null || { echo "gpu_check.sh: cannot unpack the wheel $wheel" >&2; exit 2; }
  CARRIED="$CARRIED $(basename "$wheel")"
done
if [ -n "$CARRIED" ]; then
  export PYTHONPATH="$SCRATCH/wheels:$PYTHONPATH"
  echo "gpu_check: carried wheels on PYTHONPATH:$CARRIED" >&2
fi
START=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - START) )); }
wants() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# step NAME BUDGET COMMAND...: run it under `timeout`, its output in $LOGS/NAME.log, its status in steps.tsv
step() {
  local name=$1 budget=$2 began rc status
  shift 2
  began=$(date +%s)
  if [ "$budget" -lt 1 ]; then
    printf '%s\tnot run (no time left)\t0\t0\n' "$name" >> "$LOGS/steps.tsv"
    return
  fi
  timeout --kill-after=10 "$budget" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="timed out" ;;
    *) status="failed (exit $rc)" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - began ))" "$budget" >> "$LOGS/steps.tsv"
  echo "gpu_check: $name: $status ($(( $(date +%s) - began )) s)" >&2
}
budget() { local want=$1 have; have=$(left); echo $(( want < have ? want : have )); }

# The driver runs: name, model flags, the run's layout flags, the planner's restriction to that layout.
if [ "$MODE" = gpu ]; then
  LLAMA_1B="--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --group-query-attention --num-query-groups 8
    --ffn-hidden-size 8192 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
    --untie-embeddings-and-output-weights --seq-length 4096 --global-batch-size 4 --bf16 --attention-backend flash
    --tokenizer-type NullTokenizer --vocab-size 32000"
  LLAMA3_8B_4L="--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8
    --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
    --untie-embeddings-and-output-weights --seq-length 8192 --global-batch-size 2 --bf16 --attention-backend flash
    --tokenizer-type NullTokenizer --vocab-size 128256"
  ITERS=8; PROFILED=7; DRY_DEVICE=cuda
else
  LLAMA_1B="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --ffn-hidden-size 176 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
    --untie-embeddings-and-output-weights --seq-length 64 --global-batch-size 4 --bf16
    --tokenizer-type NullTokenizer --vocab-size 1000"
  LLAMA3_8B_4L="--num-layers 2 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --ffn-hidden-size 352 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
    --untie-embeddings-and-output-weights --seq-length 128 --global-batch-size 2 --bf16
    --tokenizer-type NullTokenizer --vocab-size 2000"
  ITERS=2; PROFILED=2; DRY_DEVICE=cpu
fi
RUNS=(1b 8b-layers 1b-recompute)
declare -A MODEL=([1b]="$LLAMA_1B" [8b-layers]="$LLAMA3_8B_4L" [1b-recompute]="$LLAMA_1B")
declare -A LAYOUT=([1b]="--micro-batch-size 2" [8b-layers]="--micro-batch-size 1 --use-distributed-optimizer"
                   [1b-recompute]="--micro-batch-size 2 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
# the planner leaves the distributed optimizer out on one GPU: it shards nothing there
declare -A PLAN=([1b]="--micro-batch-size 2 --recompute none" [8b-layers]="--micro-batch-size 1 --recompute none"
                 [1b-recompute]="--micro-batch-size 2 --recompute full")
echo "{\"1b\": $PROFILED}" > "$LOGS/profiled.json"

predictions() {  # the dry runs and the planner, CPU only
  local name
  for name in "${RUNS[@]}"; do
    # shellcheck disable=SC2086
    step "dry-$name" "${BUDGET_DRY:-120}" "$PY" -m megalite.planner.verify ${MODEL[$name]} ${LAYOUT[$name]} --dry-run \
      --dry-run-world-size 1 --dry-run-device "$DRY_DEVICE" --mock-data --lr 1e-4 --train-iters 1
    # shellcheck disable=SC2086
    step "plan-$name" "${BUDGET_PLAN:-60}" "$PY" tools/plan.py --cluster "$CLUSTER" --num-gpus 1 ${PLAN[$name]} \
      --distributed-optimizer off --top 1 --finalists 1 --json "$LOGS/plan-$name.json" -- ${MODEL[$name]}
  done
}

if wants drivers; then predictions & PREDICTING=$!; fi
if wants tests; then
  if [ "$MODE" = gpu ]; then
    # test_compile_sm90.py compiles for sm_90 on any host (CI runs it); here it would only take time
    KERNEL_TESTS=(tests/kernels tests/optimizer/test_optimizer_cuda.py --ignore tests/kernels/test_compile_sm90.py)
    TP_FILTER=cuda
    # Triton's compiles dominate these tests (a first H100 run did half in 112 s serially; about 240
    # compilations since the edge shapes, tests/kernels/compile_count.py): one worker a core, up to
    # 16, where pytest-xdist is installed (each compile is one CPU's work; the GPU work is small)
    workers=$(nproc); [ "$workers" -gt 16 ] && workers=16
    if [ "$workers" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then KERNEL_TESTS+=(-n "$workers"); fi
    # a test stuck on the GPU fails by name instead of taking the step's budget with it
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then KERNEL_TESTS+=(--timeout 90); fi
  else  # the plumbing only: a small file of each selection
    KERNEL_TESTS=(tests/kernels/test_to_dtype.py); TP_FILTER="cuda or rng_tracker_streams"
  fi
  # each test's start and outcome streamed to <step>.results as it happens (pytest_stream.py): a run
  # killed at its budget writes no --junitxml, and its buffered -v log loses its last lines
  STREAM=(env PYTHONUNBUFFERED=1 PYTHONPATH="$REPO/tools/benchmarks:$PYTHONPATH")
  TRITON_INTERPRET=$([ "$MODE" = gpu ] && echo 0 || echo 1) step tests-kernels "$(budget $(( ${BUDGET_TESTS:-200} * 3 / 4 )))" \
    "${STREAM[@]}" "$PY" -m pytest -v -rfE --durations 15 -p no:cacheprovider -p no:benchmark "${KERNEL_TESTS[@]}" \
    -p pytest_stream --stream-results "$LOGS/tests-kernels.results" --junitxml="$LOGS/tests-kernels.xml"
  TRITON_INTERPRET=$([ "$MODE" = gpu ] && echo 0 || echo 1) step tests-tp-cuda "$(budget $(( ${BUDGET_TESTS:-200} / 4 )))" \
    "${STREAM[@]}" "$PY" -m pytest -q -p no:cacheprovider tests/model/test_gpt_tp.py tests/parallel/tensor/test_tp_layers.py \
    tests/generation/test_quantize.py \
    -k "$TP_FILTER" -p pytest_stream --stream-results "$LOGS/tests-tp-cuda.results" --junitxml="$LOGS/tests-tp-cuda.xml"
fi
if [ -n "${PREDICTING:-}" ]; then wait "$PREDICTING"; fi  # the driver runs are timed on an idle host
if wants kernels; then
  step bench-kernels "$(budget "${BUDGET_KERNELS:-60}")" "$PY" tools/benchmarks/bench_kernels.py \
    $([ "$MODE" = gpu ] && echo --quick || echo --cpu-smoke)
  # it times compiled Triton's launch path, so never the interpreter a caller (pytest's conftest) may have set
  step bench-host-overhead "$(budget "${BUDGET_HOST:-30}")" env -u TRITON_INTERPRET "$PY" tools/benchmarks/bench_host_overhead.py \
    $([ "$MODE" = gpu ] || echo --ops rms_norm)
  step bench-attention "$(budget "${BUDGET_ATTENTION:-60}")" "$PY" tools/benchmarks/bench_attention.py \
    $([ "$MODE" = gpu ] && echo --quick || echo --cpu-smoke)
fi
if wants drivers; then
  for name in "${RUNS[@]}"; do
    extra=()
    if [ "$name" = 1b ]; then  # the trace goes to --tensorboard-dir, else to <--save>/profile
      # --profile-step-start counts the iterations done before it: iteration $PROFILED as logged
      extra=(--profile --profile-step-start "$((PROFILED - 1))" --profile-step-end "$PROFILED")
      if "$PY" -c "import tensorboard" 2>/dev/null; then
        extra+=(--tensorboard-dir "$SCRATCH/profile")
      else
        extra+=(--save "$SCRATCH/save" --no-save-optim --no-save-rng)
      fi
    fi
    # shellcheck disable=SC2086
    want=${BUDGET_RUN:-60}; [ "$name" = 1b ] && want=${BUDGET_RUN_1B:-90}
    step "run-$name" "$(budget "$want")" "$PY" -m megalite.pretrain_gpt ${MODEL[$name]} ${LAYOUT[$name]} \
      --mock-data --lr 1e-4 --train-iters "$ITERS" --log-interval 1 --eval-iters 0 \
      --metrics-file "$LOGS/run-$name.jsonl" "${extra[@]}"
  done
  TRACE="$(ls "$SCRATCH"/profile/*.pt.trace.json "$SCRATCH"/save/profile/*.pt.trace.json 2>/dev/null | head -1)"
  if [ -n "$TRACE" ]; then
    # shellcheck disable=SC2086
    step profile "$(budget 60)" "$PY" tools/benchmarks/gpu_check_report.py rates --trace "$TRACE" \
      --bench-kernels "$LOGS/bench-kernels.log" --cluster "$CLUSTER" --summary "$LOGS/profile.json" \
      --out "$RATES" -- ${MODEL[1b]} ${LAYOUT[1b]}
  fi
  # the 1.1B as fast as megalite runs it (issue 23: >= 55% MFU): compiled regions with the fused
  # cross-entropy, then with per-layer CUDA graphs too (no dropout: a graph cannot swap RNG streams)
  # (both without dropout, so that the two differ in the graphs alone and their losses should agree:
  # the first H100 run, dropout in the first only, left them 10x apart after 8 steps, unexplained)
  for name in 1b-compile 1b-compile-graphs; do
    fast=(--torch-compile --cross-entropy-loss-fusion --attention-dropout 0 --hidden-dropout 0)
    [ "$name" = 1b-compile-graphs ] && fast+=(--cuda-graph-impl local)
    [ "$MODE" = gpu ] || fast=(--cross-entropy-loss-fusion)  # the CPU smoke run checks the plumbing only
    # shellcheck disable=SC2086
    step "run-$name" "$(budget "${BUDGET_RUN_FAST:-75}")" "$PY" -m megalite.pretrain_gpt ${MODEL[1b]} ${LAYOUT[1b]} \
      --mock-data --lr 1e-4 --train-iters "$ITERS" --log-interval 1 --eval-iters 0 \
      --metrics-file "$LOGS/run-$name.jsonl" "${fast[@]}"
  done
  if [ -f "$RATES" ]; then
    for name in "${RUNS[@]}"; do
      # shellcheck disable=SC2086
      step "plan-rates-$name" "$(budget "${BUDGET_PLAN:-60}")" "$PY" tools/plan.py --cluster "$CLUSTER" --num-gpus 1 \
        --kernel-rates "$RATES" ${PLAN[$name]} --distributed-optimizer off --top 1 --finalists 1 \
        --json "$LOGS/plan-rates-$name.json" -- ${MODEL[$name]}
    done
  fi
fi
if wants fp8; then
  # the whole runs' limit inside the step's (the script reports what finished); its own --json for the table
  FP8_BUDGET=$(budget "${BUDGET_FP8:-150}")
  step bench-fp8 "$FP8_BUDGET" "$PY" tools/benchmarks/bench_fp8.py --time-limit "$(( FP8_BUDGET > 15 ? FP8_BUDGET - 10 : 5 ))" \
    --json "$LOGS/bench-fp8.json" $([ "$MODE" = gpu ] || echo --cpu-smoke --models 8b-layers)  # smoke: 2 runs, not 4
fi
if wants model; then
  if [ "$MODE" = gpu ]; then
    LIMIT=$(( $(left) - 30 ))
    step bench-model "$(( LIMIT + 20 ))" "$PY" tools/benchmarks/bench_model.py --quick --skip-kernels \
      --time-limit "$LIMIT" --output "$LOGS/bench-model.md"
  else
    # one step, no warm-up: the plumbing only (the row's Triton kernels run interpreted, ~6 s a step)
    step bench-model "$(budget 300)" "$PY" tools/benchmarks/bench_model.py --cpu-smoke --skip-kernels \
      --models gpt2-tiny --rows kernels --warmup 0 --steps 1 --output "$LOGS/bench-model.md"
  fi
fi
"$PY" tools/benchmarks/gpu_check_report.py table --logs "$LOGS" --out "$OUT_FILE" --command "$COMMAND" \
  --gpu "$GPU_NAME" --cluster "$CLUSTER"
echo "gpu_check: wrote $OUT_FILE (logs in $LOGS)" >&2
