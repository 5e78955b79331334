"""Pipeline-parallel reads of Megatron-Core checkpoints, on CPU.

Megatron-Core's side (write_megatron_vp_checkpoints): its GPTModel at TP=1 PP=2 with 2 virtual
stages per rank (initialize_model_parallel(virtual_pipeline_model_parallel_size=2); chunk c of
pipeline rank p holds layer 2c + p of 4), the logits it computes through the interleaved chunks,
saved as megatron/training/checkpointing.py's save_checkpoint writes them:

    torch       iter_0000007/mp_rank_00_00P/model_optim_rng.pt with 'model0' and 'model1'
    torch_dist  iter_0000007/ with the chunks' sharded state dicts under 'model0' and 'model1'
    release     release/mp_rank_00_00P/model_optim_rng.pt, the tracker saying 'release'

megalite's side (megalite_pipeline_logits): a checkpoint loaded at PP = world size (and virtual
stages) and the logits of the interleaved chunks, passed stage to stage.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from tests.checkpoint.megatron_core_fixture import ITERATION, SEQ, VOCAB, build_model, cpu_shims, megatron_args, tokens

VP, PP = 2, 2


def _interleaved(chunks, pp_rank: int, pp_size: int, run, hidden_size: int, rank_of=lambda p: p):
    """Run `run(chunk, hidden or None)` over the chunks in pipeline order (chunk 0 of every
    stage, then chunk 1, ...), the hidden states [s, b, h] sent from stage to stage; the last
    chunk's output on the rank holding it, None elsewhere."""
    order = [(c, p) for c in range(len(chunks)) for p in range(pp_size)]
    out = None
    for i, (c, p) in enumerate(order):
        if p != pp_rank:
            continue
        hidden = None
        if i > 0:
            hidden = torch.empty(SEQ, tokens().shape[0], hidden_size)
            dist.recv(hidden, src=rank_of(order[i - 1][1]))
        out = run(chunks[c], hidden)
        if i < len(order) - 1:
            dist.send(out.contiguous(), dst=rank_of(order[i + 1][1]))
            out = None
    return out


def _megatron_run(model, hidden):
    ids = tokens()
    if hidden is not None:
        model.set_input_tensor(hidden)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return model(ids, torch.arange(SEQ).expand_as(ids), causal)


def _save_torch(chunks, root: Path, args, folder: str, tracker: str) -> None:
    from megatron.core import parallel_state

    path = root / folder / f"mp_rank_00_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    path.mkdir(parents=True, exist_ok=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 0 if folder == "release" else ITERATION,
             **{f"model{c}": chunk.state_dict_for_save_checkpoint() for c, chunk in enumerate(chunks)},
             "num_floating_point_operations_so_far": 0}
    torch.save(state, path / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(tracker)


def _save_torch_dist(chunks, root: Path, args) -> None:
    from megatron.core import dist_checkpointing

    folder = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
             **{f"model{c}": chunk.sharded_state_dict() for c, chunk in enumerate(chunks)}}
    dist_checkpointing.save(state, str(folder))
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def write_megatron_vp_checkpoints(rank: int, world: int, out: str, family: str) -> None:
    """Spawned worker (2 ranks): see the module docstring; logits.pt from the last stage."""
    from megatron.core import parallel_state

    cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=PP,
                                             virtual_pipeline_model_parallel_size=VP)
    try:
        chunks = [build_model(family, seed=1234, tp=1, pp=PP, vp=VP, vp_stage=c) for c in range(VP)]
        with torch.no_grad():
            logits = _interleaved(chunks, rank, PP, _megatron_run, chunks[0].config.hidden_size)
        args = megatron_args(family, tensor_model_parallel_size=1, pipeline_model_parallel_size=PP,
                             virtual_pipeline_model_parallel_size=VP, num_layers_per_virtual_pipeline_stage=1)
        _save_torch(chunks, Path(out) / "torch", args, f"iter_{ITERATION:07d}", str(ITERATION))
        _save_torch(chunks, Path(out) / "release", args, "release", "release")
        args.ckpt_format = "torch_dist"
        _save_torch_dist(chunks, Path(out) / "torch_dist", args)
        if logits is not None:
            torch.save(logits[..., :VOCAB], Path(out) / "logits.pt")
    finally:
        parallel_state.destroy_model_parallel()


def megalite_pipeline_logits(rank: int, world: int, load_dirs: list[str], vp: int) -> list:
    """Spawned worker: each checkpoint of `load_dirs` loaded at PP = world (x `vp` virtual
    stages); for each, (logits [b, s, VOCAB] on the last stage or None, the iteration loaded)."""
    return [_pipeline_logits(world, load_dir, vp) for load_dir in load_dirs]


def _pipeline_logits(world: int, load_dir: str, vp: int):
    from megalite.checkpoint.megatron.reader import MegatronCheckpoint
    from megalite.model.pipeline_chunks import build_model_chunks
    from megalite.parallel.state import ParallelLayout, ParallelState
    from megalite.config.arguments import parse_args
    from megalite.checkpoint.run_load import load_for_run
    from megalite.config.run_config import CheckpointConfig

    pstate = ParallelState.create(ParallelLayout(world, pipeline=world, virtual_pipeline=vp))
    config = MegatronCheckpoint(load_dir).config
    chunks = build_model_chunks(config, pstate, init_seed=5)
    ckpt = CheckpointConfig.from_args(parse_args(["--load", load_dir, "--finetune", "--auto-detect-ckpt-format"]))
    common = load_for_run(ckpt, chunks, pstate, None)
    for chunk in chunks:
        chunk.eval()

    def run(chunk, hidden):
        return chunk(tokens=tokens() if hidden is None else None, hidden_states=hidden)

    with torch.no_grad():
        logits = _interleaved(chunks, pstate.pp_rank, world, run, config.hidden_size,
                              rank_of=lambda p: dist.get_global_rank(pstate.pp_group, p))
    return (logits[..., :VOCAB] if logits is not None else None), common["iteration"]

