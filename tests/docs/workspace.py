"""Where the documented commands run: one directory per test session that looks like a checkout
to them (tools/, scripts/, examples/ and megalite/ are links to this repository), so a command's
relative paths (`data/corpus`, `llama-hf/`, `checkpoints/llama`) are files of that directory,
built by the test or written by an earlier command. Each command runs through `bash -c`, as a
user's shell runs it (globs, quotes, `VAR=value cmd`), with this Python first on PATH.

The inputs are tiny and made here, nothing downloaded: a corpus from the standard library
(tools/make_demo_corpus.py), gzip and Parquet shards of it, byte-level BPE files trained with
`tokenizers`, a random Llama from transformers (with the SentencePiece model a documented
command trained), a Megatron `torch` checkpoint (tests/checkpoint/megatron_files.py).
"""

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tests.distributed import free_port
from tests.docs.commands import REPO

LINKED = ("tools", "scripts", "examples", "megalite")
CORPUS_MB = 0.3

# A stand-in for Slurm's sbatch: an --array job's tasks run one after another under bash, with
# the variables Slurm gives an array task (not modelled: Slurm opening #SBATCH --output first).
# Real sbatch: the real-Slurm test (issue 22 item 6, tests/slurm/test_slurm_cluster.py).
FAKE_SBATCH = """#!/usr/bin/env bash
set -euo pipefail
array=""; args=()
for a in "$@"; do case $a in --array=*) array=${a#--array=} ;; *) args+=("$a") ;; esac; done
[[ -n $array ]] || { echo "stand-in sbatch: only --array jobs" >&2; exit 2; }
first=${array%-*}; last=${array#*-}
for ((i = first; i <= last; i++)); do
    SLURM_ARRAY_TASK_ID=$i SLURM_ARRAY_TASK_MIN=$first SLURM_ARRAY_TASK_MAX=$last SLURM_SUBMIT_DIR=$PWD \\
        SLURM_CPUS_PER_TASK=1 bash "${args[@]}"
done
"""


@dataclass(frozen=True)
class Run:
    """A documented command run at toy scale: `replace` pairs (as written -> toy), applied in
    order, each of which must occur; `append`, flags added at the end (sizes, or what the
    command leaves to the user: `...`); `needs`, the inputs and earlier runs it reads; `array`,
    run once per task of a Slurm array of that size (SLURM_ARRAY_TASK_ID=0, 1, ...); `requires`,
    a reason it cannot run on this machine, or None; `status`, the exit statuses that mean it ran
    (benchmarks exit 0 whenever they measured, a missed target being a line of their output)."""
    name: str
    replace: tuple = ()
    append: str = ""
    env: tuple = ()
    needs: tuple = ()
    check: Callable | None = None
    slow: bool = False
    timeout: int = 300
    array: int = 0
    requires: Callable | None = None
    status: tuple = (0,)


@dataclass(frozen=True)
class SameAs:
    """At toy scale this command is another entry's run, word for word (the test checks it)."""
    run: str
    replace: tuple = ()


@dataclass(frozen=True)
class Elsewhere:
    """Run by other tests ("tests/x.py::test_y", or "run:<name>" of this table)."""
    tests: tuple
    why: str


@dataclass(frozen=True)
class CannotRun:
    """Not runnable here, and why; `tests` cover what of it can run."""
    why: str
    tests: tuple = ()


@dataclass(frozen=True)
class Checked:
    """Not run (it would change this environment), but what it names is checked: check(command)."""
    why: str
    check: Callable


@dataclass(frozen=True)
class Prose:
    """A code span naming a program or a form of command, not one to run."""
    why: str


def toy_command(text: str, run: Run | SameAs) -> str:
    for old, new in run.replace:
        assert old in text, f"{old!r} is no longer in {text!r}: update the entry"
        text = text.replace(old, new)
    return f"{text} {run.append}".strip() if isinstance(run, Run) else text


@dataclass
class Workspace:
    root: Path
    builders: dict
    runs: dict                                  # name -> (command as written, Run)
    results: dict = field(default_factory=dict)  # name -> CompletedProcess
    failed: dict = field(default_factory=dict)   # name -> why

    def env(self, extra=()) -> dict:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "MASTER_", "PET_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(PATH=f"{self.root / 'bin'}:{Path(sys.executable).parent}:{env.get('PATH', '')}",
                   PYTHONPATH=str(REPO), TRITON_INTERPRET="1", PET_MASTER_PORT=str(free_port()))
        env.update(dict(extra))
        return env

    def shell(self, text: str, env=(), timeout=300) -> subprocess.CompletedProcess:
        """`bash -c text` in the workspace; past `timeout` its whole process group is killed
        (torchrun's workers too) and the test fails."""
        proc = subprocess.Popen(["bash", "-c", text], cwd=self.root, env=self.env(env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"still running after {timeout} s: {text}\n{out[-3000:]}\n{err[-3000:]}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def ensure(self, name: str):
        """Build input `name` or run entry `name` (and what it needs) once."""
        if name in self.results:
            return self.results[name]
        if name in self.failed:
            raise AssertionError(f"{name} failed earlier: {self.failed[name]}")
        try:
            self.results[name] = self.builders[name](self) if name in self.builders else self._run(name)
        except BaseException as e:
            self.failed[name] = str(e)[:300]
            raise
        return self.results[name]

    def _run(self, name: str) -> subprocess.CompletedProcess:
        text, run = self.runs[name]
        for need in run.needs:
            self.ensure(need)
        toy = toy_command(text, run)
        for task in range(run.array) if run.array else [None]:
            task_env = () if task is None else (("SLURM_ARRAY_TASK_ID", str(task)),)
            proc = self.shell(toy, run.env + task_env, run.timeout)
            output = f"$ {toy}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
            assert proc.returncode in run.status, f"exit status {proc.returncode} (task {task})\n{output}"
        if run.check is not None:
            run.check(self, proc)
        return proc

    def path(self, relative: str) -> Path:
        return self.root / relative


def make_workspace(root: Path, runs: dict) -> Workspace:
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    (root / "bin").mkdir()
    sbatch = root / "bin" / "sbatch"
    sbatch.write_text(FAKE_SBATCH)
    sbatch.chmod(0o755)
    return Workspace(root, BUILDERS, runs)


def corpus_texts(ws) -> list[str]:
    ws.ensure("corpus")
    return [json.loads(line)["text"] for line in ws.path("corpus.jsonl").read_text().splitlines()]


def _corpus(ws):
    from tests.data.conftest import load_tool

    assert load_tool("make_demo_corpus").main(["--output", str(ws.path("corpus.jsonl")), "--max-mb",
                                               str(CORPUS_MB)]) in (0, None)


def _thirds(items):
    n = len(items)
    return [items[i * n // 3:(i + 1) * n // 3] for i in range(3)]


def _shards(ws):
    """shards/*.jsonl.gz: the corpus in three consecutive parts, so that the sorted shards hold
    the documents in the corpus's order."""
    ws.ensure("corpus")
    lines = ws.path("corpus.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    ws.path("shards").mkdir()
    for i, part in enumerate(_thirds(lines)):
        with gzip.open(ws.path(f"shards/part-{i}.jsonl.gz"), "wt", encoding="utf-8") as f:
            f.writelines(part)


def _fineweb(ws):
    """cluster/fineweb/*.parquet: the corpus as three Parquet files with a `text` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = ws.path("cluster/fineweb")
    folder.mkdir(parents=True)
    for i, part in enumerate(_thirds(corpus_texts(ws))):
        pq.write_table(pa.table({"text": part}), folder / f"part-{i}.parquet", row_group_size=8)


def _bpe(ws):
    """gpt2-vocab.json and gpt2-merges.txt (GPT-2's file names), and hf-tokenizer/tokenizer.json:
    a 600-entry byte-level BPE with <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_texts(ws), trainer)
    vocab, merges = tok.model.save(str(ws.root))
    os.rename(vocab, ws.path("gpt2-vocab.json"))
    os.rename(merges, ws.path("gpt2-merges.txt"))
    ws.path("hf-tokenizer").mkdir()
    tok.save(str(ws.path("hf-tokenizer/tokenizer.json")))


TINY_LLAMA = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=96, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _llama_hf(ws):
    """llama-hf/: a random LlamaForCausalLM (2 layers, hidden 64, 8 heads in 4 groups) with the
    SentencePiece model README's train_tokenizer command wrote (vocabulary 500)."""
    import torch
    import transformers

    ws.ensure("readme-train-tokenizer")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=500, **TINY_LLAMA))
    model.save_pretrained(ws.path("llama-hf"))
    shutil.copy(ws.path("tokenizer.model"), ws.path("llama-hf/tokenizer.model"))


def _llama3_config(ws):
    """llama3-8b/config.json: a Llama config of toy size (the planner reads only the config)."""
    import transformers

    transformers.LlamaConfig(vocab_size=500, **TINY_LLAMA).save_pretrained(ws.path("llama3-8b"))


def _megatron(ws):
    """megatron/ckpt: a Megatron-LM `torch` checkpoint at iteration 3 with Adam state and its
    schedule (2 layers, hidden 16, vocabulary 64; TP=1)."""
    from megalite.model.gpt import GPTModel
    from tests.checkpoint.megatron_files import (
        CONFIG, megatron_adam_state, megatron_scheduler, megatron_state_dict, write_megatron_torch,
    )

    optimizer, _ = megatron_adam_state(megatron_state_dict(GPTModel(CONFIG, init_seed=0)))
    write_megatron_torch(ws.path("megatron/ckpt"), iteration=3, seed=0, optimizer=optimizer,
                         opt_param_scheduler=megatron_scheduler())


def _model_yaml(ws):
    ws.path("model.yaml").write_text("num-layers: 4\nhidden-size: 64\nnum-attention-heads: 4\nseq-length: 64\n"
                                     "max-position-embeddings: 64\nglobal-batch-size: 8\n"
                                     "tokenizer-type: NullTokenizer\nvocab-size: 511\n")


def _prompts(ws):
    for name in ("P.txt", "prompts.txt"):
        ws.path(name).write_text("def fibonacci(n):\nimport os\n")


BUILDERS = {"corpus": _corpus, "shards": _shards, "fineweb": _fineweb, "bpe": _bpe, "llama-hf": _llama_hf,
            "llama3-config": _llama3_config, "megatron": _megatron, "model-yaml": _model_yaml, "prompts": _prompts}
