"""Command line of tools/generate.py: continue prompts with a megalite checkpoint.

    python tools/generate.py --load CKPT --prompt "def main(" --max-new-tokens 64 --temperature 0
    torchrun --nproc-per-node 2 tools/generate.py --load CKPT --tensor-model-parallel-size 2 \\
        --prompt-file prompts.txt --top-p 0.9 --seed 7

The tokenizer is the checkpoint's (common.json) unless tokenizer flags are given. Exit status
2 with one line on stderr for bad input.
"""

import argparse
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megalite.checkpoint.megalite_reader import read_common
from megalite.convert.tokenizer_files import resolved_entry
from megalite.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from megalite.inference.generate import generate_tokens, load_model
from megalite.inference.quantize import QUANTIZE_CHOICES, check_quantize, quantize_weights, weight_bytes
from megalite.config.optional_packages import check_optional_packages
from megalite.inference.sampling import SamplingParams
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.config.arguments import accept_negative_numbers
from megalite.config.megatron.model import tokenizer_options
from megalite.checkpoint.dcp.format import CheckpointError


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        accept_negative_numbers(self)

    def error(self, message):
        raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tools/generate.py", description="Generate text from a megalite checkpoint (KV cache).")
    p.add_argument("--load", required=True, help="megalite checkpoint directory (a run's --save)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompt-file", help="a file of prompts, one per line")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--greedy", action="store_true", help="same as --temperature 0")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling mass (0: off)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the sampling generator")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence at each step")
    p.add_argument("--tensor-model-parallel-size", type=int, help="TP size (default: the world size)")
    p.add_argument("--expert-tensor-parallel-size", type=int,
                   help="MoE checkpoints: ranks each expert's weights are split over (default: the TP size; "
                        "every rank holds every expert)")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="default: the checkpoint's")
    p.add_argument("--tokenizer-model")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size")
    p.add_argument("--vocab-extra-ids", type=int, help="SentencePieceTokenizer sentinel tokens (default: the checkpoint's)")
    p.add_argument("--tiktoken-pattern", choices=("v1", "v2"), help="TikTokenizer pattern (default: the checkpoint's)")
    p.add_argument("--tiktoken-num-special-tokens", type=int, help="TikTokenizer special ids (default: the checkpoint's)")
    p.add_argument("--iteration", type=int, help="load this iteration instead of the latest")
    p.add_argument("--output-file", help="also write one JSON line per prompt (prompt, tokens, text)")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                   help="weight-only INT8 (CPU, CUDA) or INT4 (CUDA) attention and MLP weights (torchao; TP = 1)")
    p.add_argument("--distributed-backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    return p


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"--prompt-file {args.prompt_file}: cannot read it ({e.strerror})") from None
    if not prompts:
        raise ValueError("give --prompt TEXT or --prompt-file FILE")
    return prompts


def tokenizer_for(args, common: dict):
    """The tokenizer the flags name, else the one the checkpoint's common.json names."""
    if args.tokenizer_type:
        entry = {"type": args.tokenizer_type, "model": args.tokenizer_model, "vocab_file": args.vocab_file,
                 "merge_file": args.merge_file}
        vocab_size = args.vocab_size
    else:
        entry = resolved_entry(common.get("tokenizer"), Path(args.load))
        if not entry["type"]:
            raise ValueError(f"{args.load}: the checkpoint names no tokenizer; give --tokenizer-type and its files")
        vocab_size = args.vocab_size or (common.get("args") or {}).get("vocab_size")
    return build_tokenizer(entry["type"], tokenizer_model=entry["model"], vocab_file=entry["vocab_file"],
                           merge_file=entry["merge_file"], vocab_size=vocab_size,
                           **_tokenizer_options(args, entry["type"], common.get("args") or {}))


def _tokenizer_options(args, tokenizer_type: str, trained: dict) -> dict:
    """--vocab-extra-ids and the TikTokenizer flags: this command line's, else the training run's."""
    def pick(name, default):
        for value in (getattr(args, name), trained.get(name)):
            if value is not None:
                return value
        return default
    values = SimpleNamespace(tokenizer_type=tokenizer_type, vocab_extra_ids=pick("vocab_extra_ids", 0),
                             tiktoken_pattern=pick("tiktoken_pattern", None),
                             tiktoken_num_special_tokens=pick("tiktoken_num_special_tokens", 1000),
                             tokenizer_special_tokens=trained.get("tokenizer_special_tokens"))
    return tokenizer_options(values)


def _parallel_state(args) -> tuple[ParallelState, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = args.tensor_model_parallel_size or world
    layout = ParallelLayout(world, tensor=tp)
    use_cuda = torch.cuda.is_available() and args.distributed_backend != "gloo"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world == 1:
        return ParallelState.single(), device
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(args.distributed_backend or ("nccl" if use_cuda else "gloo"),
                            rank=int(os.environ["RANK"]), world_size=world, timeout=timedelta(minutes=10))
    return ParallelState.create(layout), device


def run(args) -> list[dict]:
    params = SamplingParams(temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    check_optional_packages(args)
    prompts = read_prompts(args)
    common, _ = read_common(args.load, args.iteration)
    tokenizer = tokenizer_for(args, common)
    pstate, device = _parallel_state(args)
    check_quantize(args.quantize, device, pstate.tp_size,
                   has_experts=(common.get("model_config") or {}).get("moe") is not None)
    model, _ = load_model(args.load, pstate, iteration=args.iteration, device=device,
                          expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    if args.quantize:
        before = weight_bytes(model)
        quantize_weights(model, args.quantize)
        print(f"--quantize {args.quantize}: weights {before / 2**20:.2f} MiB -> {weight_bytes(model) / 2**20:.2f} MiB",
              file=sys.stderr)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    results, start, produced = [], time.time(), 0
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        new = generate_tokens(model, ids, args.max_new_tokens, params, eod=tokenizer.eod, generator=generator,
                              use_cache=not args.no_kv_cache)
        produced += len(new)
        at_eod = bool(new) and new[-1] == tokenizer.eod
        text = tokenizer.decode(ids + (new[:-1] if at_eod else new))
        results.append({"prompt": prompt, "prompt_tokens": ids, "tokens": new, "text": text, "stopped_at_eod": at_eod})
    if pstate.rank == 0:
        for r in results:
            print(r["text"], flush=True)
            print("-" * 40, flush=True)
        seconds = time.time() - start
        print(f"generated {produced} tokens for {len(prompts)} prompt(s) in {seconds:.2f} s "
              f"({produced / max(seconds, 1e-9):.1f} tokens/s, TP={pstate.tp_size})", file=sys.stderr)
        if args.output_file:
            Path(args.output_file).write_text("".join(json.dumps(r) + "\n" for r in results))
    return results


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
    try:
        args = build_parser().parse_args(argv)
        run(args)
    except (ValueError, CheckpointError, FileNotFoundError) as error:
        print(f"generate: error: {error}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
