"""The commands of the documents (README.md, examples/README.md and the topic documents under
megalite/, tools/, scripts/ and tests/: tests/docs/commands.py finds them), each as printed (the
key) -> how it runs at toy scale (tests/docs/workspace.py: Run, SameAs, Elsewhere, CannotRun, Checked, Prose).

Toy scale changes sizes and paths only: a 0.3 MB corpus, a 500-piece SentencePiece model, models
of 2-4 layers and hidden 64, 2 iterations, 4 partitions instead of 64, absolute paths made
relative to the workspace; process counts only where the documented layout needs more
processes than a 2-core machine runs in a test (each such change is in the entry).
"""

from tests.docs import checks
from tests.docs.workspace import CannotRun, Checked, Elsewhere, Prose, Run

SLURM = ("real sbatch on a one-node cluster: the real-Slurm test (issue 22 item 6, "
         "tests/slurm/test_slurm_cluster.py); here the script runs as Slurm runs it")
DEMO = "tests/training/test_demo_run.py::test_embedded_default_run"
LAUNCH = "tests/training/test_launch_script.py::"
SIZES = "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --lr-warmup-iters 1"
TWO_ITERATIONS = "--train-iters 2 --eval-interval 2 --eval-iters 1 --save-interval 2 --log-interval 1"
TINY_GPT2_MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 " + SIZES
TINY_GPT2 = f"{TINY_GPT2_MODEL} {TWO_ITERATIONS}"
SP_DATA = ("--data-path data/corpus_text_document --tokenizer-type SentencePieceTokenizer "
           "--tokenizer-model tokenizer.model")
TINY_MOE_BASE = (f"{SP_DATA} --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                 "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 2 --lr 1e-3 "
                 "--log-interval 1 --eval-iters 0 --num-workers 0")


def _pip_install(command: str):
    """The extras the command installs are setup.py's, and a torch it pins is the one tested here."""
    import re

    import torch

    from tests.docs.commands import REPO

    setup = (REPO / "setup.py").read_text()
    for extra in [e for group in re.findall(r"\.\[([\w,-]+)\]", command) for e in group.split(",")]:
        assert re.search(rf'^\s+"{extra}": \[', setup, re.M), f'setup.py has no extra "{extra}"'
    pin = re.search(r"torch==(\S+)", command)
    assert pin is None or torch.__version__.split("+")[0] == pin[1], (command, torch.__version__)


# GPT-3 175B on 1024 GPUs, as the planner commands give it, at toy size on 2
GPT3_AT_TOY_SIZE = (("--num-gpus 1024", "--num-gpus 2"), ("--num-layers 96", "--num-layers 4"),
                    ("--hidden-size 12288", "--hidden-size 64"),
                    ("--num-attention-heads 96", "--num-attention-heads 4"),
                    ("--global-batch-size 1536", "--global-batch-size 8"), ("--vocab-size 51199", "--vocab-size 511"))
PIP = Checked("installs into this environment from the network", _pip_install)

README = {
    # README.md: quickstart, performance, contributing; scripts/README.md
    'pip install torch==2.13.0 -e ".[plot]"': PIP,
    "bash scripts/pretrain_gpt.sh": Elsewhere((DEMO,), "the embedded default end to end (slow): corpus, tokenizer, "
                                              "data, TP=2 PP=2 training, plot, summary"),
    'pip install torch==2.13.0 -e ".[dev]"': PIP,
    "pip install --no-deps --ignore-requires-python emerging-optimizers==0.3.0": PIP,
    "python -m pytest tests -n 2": Elsewhere((".ci/run",), "CI runs the README's test command as written, in a fresh "
                                        "virtual environment; this test is part of that suite"),
    'pip install -e ".[gpu]"': PIP,
    "pip install -e .": PIP,
    'pip install -e ".[tensorboard]"': PIP,
    'pip install -e ".[data]"': PIP,
    'pip install -e ".[plot]"': PIP,
    "python -m megalite.pretrain_gpt": Prose("names the driver; its runs are the commands below"),
    "python -m megalite.pretrain_gpt --dry-run": Prose("names the dry-run mode; run:readme-dry-run-405b runs it"),
    "srun": Prose("names Slurm's launcher"),
    "sbatch": Prose("names Slurm's submit command; the sbatch lines below run"),
    "python -m megalite.pretrain_gpt ... --mock-data": Prose(
        "the form of the GPU driver runs, whose flags tools/benchmarks/README.md spells out; gpu_check.sh runs them"),
    "python -m tests.docs.test_readme_commands": Elsewhere(
        ("tests/docs/test_readme_commands.py::test_the_listing_the_readme_points_to_runs",),
        "the listing of this table, run from the checkout"),
    "NPROC_PER_NODE=8 NNODES=... bash scripts/pretrain_gpt.sh <flags>": Prose(
        "the form of plan.py's printed launch lines, which test_plan_finalists_run runs"),
    # megalite/data/README.md: prepare data (and tools/README.md)
    "python tools/train_tokenizer.py --input corpus.jsonl --json-keys text --vocab-size 32000 --model-prefix tokenizer":
        Run("readme-train-tokenizer", replace=(("--vocab-size 32000", "--vocab-size 500"),), needs=("corpus",),
            check=checks.sentencepiece(500, "tokenizer.model")),
    "mkdir -p data": Run("readme-mkdir-data", check=lambda ws, proc: ws.path("data").is_dir()),
    "mkdir -p logs": Run("readme-mkdir-logs", check=lambda ws, proc: ws.path("logs").is_dir()),
    "python tools/preprocess_data.py --input 'shards/*.jsonl.gz' --json-keys text --output-prefix data/corpus "
    "--tokenizer-type SentencePieceTokenizer --tokenizer-model tokenizer.model --append-eod --workers 16":
        Run("readme-preprocess", needs=("shards", "readme-train-tokenizer", "readme-mkdir-data"),
            check=checks.tokenised_corpus("data/corpus_text_document", "tokenizer.model")),
    # sbatch: the workspace's stand-in, which runs the array's tasks under bash (see workspace.py);
    # real sbatch: tests/slurm/test_slurm_cluster.py
    "INPUT='/data/fineweb/*.parquet' OUTPUT_PREFIX=/data/tok/fineweb TOKENIZER_MODEL=tok.model "
    "sbatch --array=0-63 scripts/slurm/preprocess_data.sbatch":
        Run("readme-sbatch-preprocess", replace=(("/data/", "cluster/"), ("--array=0-63", "--array=0-3")),
            needs=("fineweb", "doc-train-tokenizer"), check=checks.partitions("cluster/tok/fineweb", 4)),
    "python tools/merge_datasets.py --input '/data/tok/fineweb-*-of-00064_text_document' "
    "--output-prefix /data/tok/fineweb_text_document":
        Run("readme-merge", replace=(("/data/", "cluster/"), ("00064", "00004")), needs=("readme-sbatch-preprocess",),
            check=checks.merged_equals_one_run(
                "cluster/tok/fineweb_text_document", "cluster/tok/one_text_document",
                one_run_command="python tools/preprocess_data.py --input 'cluster/fineweb/*.parquet' --output-prefix "
                                "cluster/tok/one --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model "
                                "--append-eod")),
    "python tools/inspect_data.py /data/tok/fineweb_text_document --tokenizer-type SentencePieceTokenizer "
    "--tokenizer-model tok.model --show 3":
        Run("readme-inspect", replace=(("/data/", "cluster/"),), needs=("readme-merge",),
            check=checks.inspected("cluster/tok/fineweb_text_document")),
    # megalite/training/README.md: train
    "bash scripts/pretrain_gpt.sh --config examples/gpt2_124m.yaml --data-path data/corpus_text_document "
    "--tokenizer-type SentencePieceTokenizer --tokenizer-model tokenizer.model --save checkpoints/gpt2 "
    "--load checkpoints/gpt2":
        Run("readme-train-gpt2", append=TINY_GPT2, needs=("readme-preprocess",),
            check=checks.trained("checkpoints/gpt2", 2, "checkpoints/gpt2_124m/metrics.jsonl")),
    # megalite/config/README.md: coming from Megatron-LM (a TP=1 Megatron `torch` checkpoint of 2 layers, hidden 16)
    "torchrun --nproc-per-node 2 -m megalite.pretrain_gpt --load /megatron/ckpt --auto-detect-ckpt-format "
    "--use-checkpoint-args --tensor-model-parallel-size 2 ...data, batch and LR flags":
        Run("readme-megatron-continue", replace=(
            ("/megatron/", "megatron/"),
            ("...data, batch and LR flags", "--mock-data --tokenizer-type NullTokenizer --vocab-size 63 "
             "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --min-lr 0 --lr-decay-style linear "
             "--lr-decay-iters 10 --weight-decay 0.01 --train-iters 5 --eval-iters 0 --log-interval 1 "
             "--metrics-file checkpoints/from-megatron/metrics.jsonl")),
            needs=("megatron",), slow=True,
            check=checks.all_of(checks.printed("loaded Megatron torch checkpoint"),
                                checks.logged("checkpoints/from-megatron/metrics.jsonl", (4, 5)))),
    "python tools/checkpoint/convert.py --loader megatron --saver hf --load-dir /megatron/ckpt --save-dir hf_out":
        Run("readme-megatron-to-hf", replace=(("/megatron/", "megatron/"),), needs=("megatron",),
            check=checks.megatron_in_transformers("hf_out")),
    "python tools/checkpoint/convert.py --loader megatron --saver megalite --load-dir /megatron/ckpt --save-dir "
    "ml_ckpt --target-tensor-parallel-size 2":
        Run("readme-megatron-to-megalite-tp2", replace=(("/megatron/", "megatron/"),), needs=("megatron",), slow=True,
            check=checks.printed(r"^To train from it \(2 processes")),
    # megalite/parallel/README.md: long context and experts; megalite/dryrun/README.md: dry runs.
    # The 7B file's TP=4 PP=2 with CP=4 is 32 processes: at toy scale TP=1 PP=1 (one chunk), so CP=4
    # a2a+p2p with groups 2 x 2 runs on 4.
    "bash scripts/pretrain_gpt.sh --config examples/llama_7b_3d.yaml --context-parallel-size 4 --cp-comm-type "
    "a2a+p2p --hierarchical-context-parallel-sizes 2 2 --seq-length 32768 --reset-attention-mask "
    "--reset-position-ids ...":
        Run("readme-context-parallel", replace=(("--seq-length 32768", "--seq-length 256"), (
            "--reset-position-ids ...", f"--reset-position-ids {SP_DATA} --num-layers 2 --hidden-size 64 "
            "--ffn-hidden-size 128 --num-attention-heads 4 --tensor-model-parallel-size 1 "
            "--pipeline-model-parallel-size 1 --num-virtual-stages-per-pipeline-rank 1 --micro-batch-size 1 "
            "--global-batch-size 2 --train-iters 2 --lr-warmup-iters 1 --eval-iters 0 --save-interval 2")),
            env=(("NPROC_PER_NODE", "4"),), needs=("readme-preprocess",), slow=True,
            check=checks.all_of(checks.trained("checkpoints/llama_7b", 2),
                                checks.logged("checkpoints/llama_7b/metrics.jsonl", (1, 2)))),
    "bash scripts/pretrain_gpt.sh ... --disable-bias-linear --num-experts 8 --moe-router-topk 2 "
    "--moe-aux-loss-coeff 1e-2 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall":
        Run("readme-moe-ep4", replace=(("pretrain_gpt.sh ...", "pretrain_gpt.sh " + TINY_MOE_BASE
                                         + " --metrics-file checkpoints/moe/metrics.jsonl"),),
            env=(("NPROC_PER_NODE", "4"),), needs=("readme-preprocess",), slow=True,
            check=checks.logged("checkpoints/moe/metrics.jsonl", (1, 2), "load_balancing_loss")),
    # EP=8 over TP x DP = 2 x 4 is 8 processes: at toy scale EP=4 over TP x DP = 2 x 2.
    "bash scripts/pretrain_gpt.sh ... --tensor-model-parallel-size 2 --sequence-parallel "
    "--expert-tensor-parallel-size 1 --expert-model-parallel-size 8 --num-experts 64 ...":
        Run("readme-moe-etp1", replace=(
            ("pretrain_gpt.sh ...",
             f"pretrain_gpt.sh {TINY_MOE_BASE} --metrics-file checkpoints/etp/metrics.jsonl"),
            ("--expert-model-parallel-size 8", "--expert-model-parallel-size 4"),
            ("--num-experts 64 ...", "--num-experts 64 --disable-bias-linear")),
            env=(("NPROC_PER_NODE", "4"),), needs=("readme-preprocess",), slow=True,
            check=checks.logged("checkpoints/etp/metrics.jsonl", (1, 2))),  # no aux-loss coefficient: none logged
    # A dry run is one CPU process on fake tensors: it runs as written, at full size.
    "python -m megalite.pretrain_gpt --dry-run --dry-run-world-size 1024 --tensor-model-parallel-size 8 "
    "--pipeline-model-parallel-size 16 --num-virtual-stages-per-pipeline-rank 2 --decoder-first-pipeline-num-layers 6 "
    "--decoder-last-pipeline-num-layers 8 --sequence-parallel --use-distributed-optimizer --bf16 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128256 --num-layers 126 --hidden-size 16384 --num-attention-heads 128 "
    "--group-query-attention --num-query-groups 8 --ffn-hidden-size 53248 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --rotary-base 500000 --disable-bias-linear --untie-embeddings-and-output-weights "
    "--seq-length 8192 --micro-batch-size 1 --global-batch-size 128 --lr 3e-4 --train-iters 1 --attention-dropout 0 "
    "--hidden-dropout 0":
        Run("readme-dry-run-405b", slow=True, timeout=1800,
            check=checks.printed(r"^dry run: world 1024 = TP 8 x PP 16", r"peak memory per pipeline stage",
                                 r"^\s+512\s+\(0, 0, 8, 0\)", r"^verdict: highest peak")),
    # DeepSeek-V3 671B: every one of its 16 stages differs, about 15 minutes of CPU
    'python -m megalite.pretrain_gpt --dry-run --dry-run-world-size 1024 --mock-data --tokenizer-type '
    'NullTokenizer --vocab-size 129279 --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 '
    '--num-attention-heads 128 --swiglu --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type '
    'rope --rotary-base 10000 --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout '
    '0.0 --hidden-dropout 0.0 --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 '
    '--qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm --rope-type yarn --rotary-scaling-factor 40 '
    '--mscale 1.0 --mscale-all-dim 1.0 --num-experts 256 --moe-ffn-hidden-size 2048 '
    '--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-layer-freq "[0]*3+[1]*58" '
    '--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 8 '
    '--moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 '
    '--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-token-dispatcher-type '
    'alltoall --moe-grouped-gemm --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --tensor-model-parallel-size '
    '2 --sequence-parallel --pipeline-model-parallel-size 16 --decoder-first-pipeline-num-layers 3 '
    '--decoder-last-pipeline-num-layers 2 --expert-model-parallel-size 64 --expert-tensor-parallel-size 1 '
    '--seq-length 4096 --micro-batch-size 1 --global-batch-size 512 --bf16 --use-distributed-optimizer --lr '
    '2.2e-4 --train-iters 1':
        Run("readme-dry-run-deepseek-v3", slow=True, timeout=3000,
            check=checks.printed(r"^dry run: world 1024 = TP 2 x PP 16 \(x1 virtual\) x DP 32; 256 experts top-8, EP 64",
                                 r"^\s+960\s+\(0, 0, 15, 0\)", r"^verdict: highest peak")),
    # megalite/planner/README.md: plan a layout (sizes toy; the finalists' launch lines: test_plan_finalists_run)
    "python tools/plan.py --cluster a100 --num-gpus 1024 -- --num-layers 96 --hidden-size 12288 "
    "--num-attention-heads 96 --seq-length 2048 --global-batch-size 1536 --bf16 --tokenizer-type NullTokenizer "
    "--vocab-size 51199":
        Run("readme-plan-a100", replace=GPT3_AT_TOY_SIZE + (("--seq-length 2048", "--seq-length 64"),),
            check=checks.printed(r"^#1 .*predicted step", r"^   NPROC_PER_NODE=2 bash scripts/pretrain_gpt.sh ")),
    "python tools/plan.py --cluster h100 --num-gpus 64 --hf-config llama3-8b/config.json --seq-length 8192 "
    "--global-batch-size 512 --recompute full --distributed-optimizer off --verify":
        Run("readme-plan-verify", replace=(("--num-gpus 64", "--num-gpus 2"), ("--seq-length 8192", "--seq-length 64"),
                                           ("--global-batch-size 512", "--global-batch-size 8")),
            needs=("llama3-config",), slow=True, timeout=600,
            check=checks.printed(r"^dry runs of the finalists", r"--recompute-granularity full")),
    "python tools/plan.py --cluster h100 --num-gpus 8 --tp 1 --pp 1 --micro-batch-size 2 -- --num-layers 32 "
    "--hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
    "--ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 "
    "--disable-bias-linear --untie-embeddings-and-output-weights --bf16 --attention-backend flash "
    "--tokenizer-type NullTokenizer --vocab-size 128255 --max-position-embeddings 8192 --seq-length 8192 "
    "--global-batch-size 16":
        Run("readme-plan-fsdp2-llama31-8b", check=checks.printed(r"^ 1 TP1 PP1 DP8 mb2 full FSDP2 ")),
    "python tools/plan.py --calibrate cpu8.json --world-size 8":
        Run("readme-calibrate", replace=(("--world-size 8", "--world-size 2"),), slow=True, timeout=600,
            check=checks.files("cpu8.json")),
    "python tools/plan.py --cluster cpu8.json -- --num-layers 8 --hidden-size 256 --num-attention-heads 8 "
    "--seq-length 256 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 4095":
        Run("readme-plan-cpu", needs=("readme-calibrate",), slow=True,
            check=checks.printed(r"^   NPROC_PER_NODE=2 bash scripts/pretrain_gpt.sh ")),
    # megalite/checkpoint/README.md: convert and generate (a random 2-layer Llama; its run: test_convert_hint_runs)
    "python tools/checkpoint/convert.py --loader hf --saver megalite --load-dir llama-hf/ --save-dir checkpoints/llama "
    "--target-tensor-parallel-size 2 --target-pipeline-parallel-size 2":
        Run("readme-convert-to-megalite", needs=("llama-hf",),
            check=checks.all_of(checks.printed(r"^To train from it \(4 processes", r"^  torchrun --nproc-per-node 4 "),
                                checks.trained("checkpoints/llama", 0))),
    "python tools/checkpoint/convert.py --loader megalite --saver hf --load-dir checkpoints/llama "
    "--save-dir llama-out/":
        Run("readme-convert-to-hf", needs=("readme-convert-to-megalite",),
            check=checks.hf_round_trip("llama-hf", "llama-out")),
    'python tools/generate.py --load checkpoints/llama --prompt "def fibonacci(n):" --max-new-tokens 64':
        Run("readme-generate", needs=("readme-convert-to-megalite",), check=checks.generated("def fibonacci(n):")),
    # megalite/checkpoint/README.md: quantized generation
    'pip install -e ".[quantize]"': PIP,
    "pip install --no-deps torchao==0.18.0": PIP,
    # megalite/kernels/README.md and megalite/model/README.md: Gated DeltaNet's fla-core kernels
    'pip install -e ".[gdn]"': PIP,
    'python tools/generate.py --load checkpoints/llama --prompt "def fibonacci(n):" --max-new-tokens 64 '
    "--quantize int8":
        Elsewhere(("tests/generation/test_generate_cli.py::test_quantize_int8_equals_the_library_on_quantized_weights",),
                  "the same tool with --quantize int8 on a converted Llama checkpoint, its tokens checked"),
}

EXAMPLES = {
    "bash scripts/pretrain_gpt.sh --config examples/gpt2_124m.yaml --data-path data/openwebtext_text_document "
    "--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt":
        Run("examples-gpt2-124m", replace=(("data/openwebtext_text_document", "data/corpus_text_document"),),
            append=TINY_GPT2, needs=("readme-preprocess", "bpe"), slow=True,
            check=checks.trained("checkpoints/gpt2_124m", 2)),
    # the trial has its own --save/--load (the file's checkpoints/gpt2_124m holds the entry above's 2-iteration run,
    # whose schedule a run of another length refuses to resume, one line saying so)
    "... --config examples/gpt2_124m.yaml --train-iters 200 --log-interval 1 --save checkpoints/trial "
    "--load checkpoints/trial":
        Run("examples-gpt2-124m-trial", replace=(("... --config", "bash scripts/pretrain_gpt.sh --config"),
                                                 ("--train-iters 200", "--train-iters 3")),
            append="--data-path data/corpus_text_document --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt "
                   f"{TINY_GPT2_MODEL} --eval-interval 3 --eval-iters 1",
            needs=("readme-preprocess", "bpe"), slow=True, check=checks.trained("checkpoints/trial", 3)),
    "bash scripts/pretrain_gpt.sh --config examples/gpt2_350m_tp_pp.yaml --data-path data/openwebtext_text_document "
    "--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt":
        Run("examples-gpt2-350m", replace=(("data/openwebtext_text_document", "data/corpus_text_document"),),
            append="--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                   "--max-position-embeddings 64 "
                   f"--micro-batch-size 1 --global-batch-size 4 {TWO_ITERATIONS}",
            needs=("readme-preprocess", "bpe"), slow=True, check=checks.trained("checkpoints/gpt2_350m", 2)),
    # the tokenizer directory: a byte-level BPE tokenizer.json (the data: the README's SentencePiece ids,
    # all below its 600 entries)
    "bash scripts/pretrain_gpt.sh --config examples/llama_1b.yaml --data-path data/fineweb_text_document "
    "--tokenizer-model /path/to/tokenizer_dir":
        Run("examples-llama-1b", replace=(("data/fineweb_text_document", "data/corpus_text_document"),
                                          ("/path/to/tokenizer_dir", "hf-tokenizer")),
            append="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2 "
                   f"{SIZES} {TWO_ITERATIONS}",
            needs=("readme-preprocess", "bpe"), slow=True, check=checks.trained("checkpoints/llama_1b", 2)),
    "DATA_PATH=data/fineweb_text_document TOKENIZER_MODEL=/path/to/tokenizer.model "
    "sbatch scripts/slurm/pretrain_gpt.sbatch":
        Elsewhere((LAUNCH + "test_sbatch_requeues_itself_after_a_time_limit_stop",),
                  "the job script under bash with stand-ins for srun and scontrol; " + SLURM),
    "srun bash scripts/pretrain_gpt.sh --config examples/llama_7b_3d.yaml ...":
        Elsewhere((LAUNCH + "test_srun_path_two_tasks_form_one_group_and_skip_train_evaluates",),
                  "the script's srun path, two tasks with srun's variables; " + SLURM),
    "python tools/plot_metrics.py checkpoints/<run>/metrics.jsonl --output loss.png":
        Run("examples-plot-metrics", replace=(("<run>", "gpt2_124m"),), needs=("readme-train-gpt2",),
            check=checks.png("loss.png")),
    # the demo's own files are the README's corpus and tokenizer at toy size; its model as written
    "bash scripts/pretrain_gpt.sh --config examples/demo_cpu.yaml "
    "--data-path /tmp/megalite-demo/data/demo_text_document "
    "--tokenizer-model /tmp/megalite-demo/data/tokenizer.model --save /tmp/megalite-demo/checkpoints":
        Run("examples-demo-by-hand", replace=(
            ("/tmp/megalite-demo/data/demo_text_document", "data/corpus_text_document"),
            ("/tmp/megalite-demo/data/tokenizer.model", "tokenizer.model"),
            ("/tmp/megalite-demo/checkpoints", "checkpoints/demo")),
            append=f"--lr-warmup-iters 1 {TWO_ITERATIONS}",
            needs=("readme-preprocess",), slow=True, check=checks.trained("checkpoints/demo", 2)),
}
