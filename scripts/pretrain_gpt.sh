#!/usr/bin/env bash
# Pretrain a GPT with megalite.
#
#   bash scripts/pretrain_gpt.sh                      # the embedded default, end to end on CPU
#   bash scripts/pretrain_gpt.sh --config examples/gpt2_124m.yaml --data-path ...   # your run
#
# Locally the run goes through torchrun on every GPU of this machine, or on CPU processes
# joined by gloo when there is none (pretrain_gpt's default backend: nccl with CUDA, else
# gloo); on one node torchrun picks a free port itself (--standalone) unless MASTER_PORT is
# set. Inside a Slurm step (srun, detected from SLURM_STEP_ID and SLURM_PROCID) each task is
# one rank and one Python process (this script execs it): RANK = SLURM_PROCID, WORLD_SIZE =
# SLURM_NTASKS, LOCAL_RANK = SLURM_LOCALID, MASTER_ADDR = the first host of SLURM_JOB_NODELIST
# (through `scontrol show hostnames`), MASTER_PORT = 10000 + SLURM_JOB_ID % 50000 (one port per
# job, so jobs sharing a node do not collide).
#
# Environment: NPROC_PER_NODE (processes on this node; default: GPU count, or TP x PP on CPU),
# NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (multi-node torchrun; override srun's too),
# LAUNCHER (torchrun|srun, to override detection), PYTHON (interpreter), RUN_DIR (the embedded
# default's output folder). Every argument is passed to `python -m megalite.pretrain_gpt`.
set -euo pipefail

PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

has_flag() {  # has_flag --name "$@": whether the arguments set --name
    local name=$1; shift
    for a in "$@"; do [[ $a == "$name" || $a == "$name="* ]] && return 0; done
    return 1
}

run_facts() {  # "<GPU count> <TP x PP>" for these arguments (and any --config file), one Python start;
    # a flag whose optional package is missing stops here, before torchrun starts any rank
    "$PYTHON" -c 'import sys
import torch
from megalite.config.arguments import parse_args
from megalite.config.optional_packages import check_optional_packages
try:
    a = parse_args(sys.argv[1:])
    check_optional_packages(a)
except ValueError as e:
    print(f"pretrain_gpt: error: {e}", file=sys.stderr)
    sys.exit(2)
print(torch.cuda.device_count(), a.tensor_model_parallel_size * a.pipeline_model_parallel_size)' "$@"
}

launch() {
    if has_flag --help "$@" || has_flag -h "$@"; then
        exec "$PYTHON" -m megalite.pretrain_gpt --help
    fi
    local launcher=${LAUNCHER:-}
    if [[ -z $launcher ]]; then
        if [[ -n ${SLURM_STEP_ID:-${SLURM_STEPID:-}} && -n ${SLURM_PROCID:-} ]]; then launcher=srun; else launcher=torchrun; fi
    fi
    if [[ $launcher == srun ]]; then
        : "${SLURM_PROCID:?srun launch needs SLURM_PROCID (run the script under srun)}"
        : "${SLURM_NTASKS:?srun launch needs SLURM_NTASKS (run the script under srun)}"
        export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=${SLURM_LOCALID:-0}
        if [[ -z ${MASTER_ADDR:-} ]]; then
            local nodes=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:?srun launch needs SLURM_JOB_NODELIST or MASTER_ADDR}}
            local hosts  # no `| head -n 1`: under pipefail, scontrol's SIGPIPE would end the script
            hosts=$(scontrol show hostnames "$nodes")
            export MASTER_ADDR=${hosts%%$'\n'*}
        fi
        export MASTER_PORT=${MASTER_PORT:-$(( 10000 + ${SLURM_JOB_ID:-0} % 50000 ))}
        exec "$PYTHON" -m megalite.pretrain_gpt "$@"   # the task's one Python process
    fi
    local facts gpus model_parallel
    facts=$(run_facts "$@")
    gpus=${facts% *} model_parallel=${facts#* }
    local nproc=${NPROC_PER_NODE:-}
    if [[ -z $nproc ]]; then
        if [[ $gpus != 0 ]]; then
            nproc=$gpus
        else
            nproc=$model_parallel
        fi
    fi
    if [[ $gpus == 0 && -z ${OMP_NUM_THREADS:-} ]]; then
        local cores
        cores=$(nproc)  # the CPUs this process may use
        export OMP_NUM_THREADS=$(( cores / nproc > 0 ? cores / nproc : 1 ))
    fi
    local -a rendezvous=(--standalone)
    if [[ ${NNODES:-1} != 1 || -n ${MASTER_PORT:-} ]]; then
        rendezvous=(--nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}"
                    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}")
    fi
    exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$nproc" "${rendezvous[@]}" \
        -m megalite.pretrain_gpt "$@"
}

if [[ $# -gt 0 ]]; then
    launch "$@"
fi

# ---- the embedded default: no download, no GPU -------------------------------------------
# Builds a corpus from this Python's own standard library, trains a SentencePiece tokenizer,
# preprocesses it into Megatron's .bin/.idx files and trains a small GPT with TP=2 and PP=2 on
# four CPU processes; then evaluates, saves a checkpoint and plots the loss.
RUN_DIR=${RUN_DIR:-${TMPDIR:-/tmp}/megalite-demo}
mkdir -p "$RUN_DIR/data"
cd "$REPO"
echo "megalite demo: writing to $RUN_DIR"
"$PYTHON" tools/make_demo_corpus.py --output "$RUN_DIR/data/corpus.jsonl"
"$PYTHON" tools/train_tokenizer.py --input "$RUN_DIR/data/corpus.jsonl" --json-keys text \
    --vocab-size 2048 --model-prefix "$RUN_DIR/data/tokenizer"
"$PYTHON" tools/preprocess_data.py --input "$RUN_DIR/data/corpus.jsonl" --json-keys text \
    --output-prefix "$RUN_DIR/data/demo" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$RUN_DIR/data/tokenizer.model" --append-eod --workers 2
rm -rf "$RUN_DIR/checkpoints" "$RUN_DIR/metrics.jsonl"
(launch --config "$REPO/examples/demo_cpu.yaml" \
    --data-path "$RUN_DIR/data/demo_text_document" \
    --tokenizer-model "$RUN_DIR/data/tokenizer.model" \
    --save "$RUN_DIR/checkpoints" --metrics-file "$RUN_DIR/metrics.jsonl")
"$PYTHON" tools/plot_metrics.py "$RUN_DIR/metrics.jsonl" --output "$RUN_DIR/loss.png"
"$PYTHON" tools/demo_summary.py --metrics-file "$RUN_DIR/metrics.jsonl" \
    --data-path "$RUN_DIR/data/demo_text_document" --checkpoint "$RUN_DIR/checkpoints" --plot "$RUN_DIR/loss.png"
