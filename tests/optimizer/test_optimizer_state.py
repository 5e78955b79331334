"""Optimizer state in checkpoints: saved as each rank's own shard, resharded on load.

One spawn of 4 gloo processes trains 2 Adam steps at TP = 2, DP = 2 with the distributed
optimizer (GPT-2 with SwiGLU: biases and norms replicated over TP under sequence parallelism,
a stride-2 fc1, tied embeddings, vocabulary padding; small buckets so DP shards cut rows) and
saves asynchronously while training goes on. It checks that no rank hands DCP more optimizer
elements than it owns, then loads at TP = 2 PP = 2 DP = 1 with the plain optimizer, at TP = 1
DP = 4 with the distributed optimizer, and at TP = 2 DP = 2 with FSDP2, whose re-save (model
and optimizer as FSDP2 shards) is loaded at TP = 1 DP = 4. Every load must give back the saved fp32 main parameters, exp_avg and
exp_avg_sq element for element.
"""

import pytest
import torch
import torch.distributed as dist

from megalite.model.gpt import GPTModel
from megalite.model.pipeline_chunks import build_model_chunks
from megalite.model.weights import gather_full_weights
import megalite.optimizer.distributed as distributed_optimizer
import megalite.optimizer.mixed_precision as optimizer_module
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.data.fsdp import apply_fsdp2
from megalite.parallel.sharding import gather_tp_full
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.checkpoint.dcp.format import flat_boxes
import megalite.checkpoint.dcp.checkpoint as checkpointing
from megalite.checkpoint.dcp.checkpoint import load_checkpoint, load_optimizer_state, save_checkpoint
from tests.distributed import run_distributed
from tests.model.test_gpt_tp import make_config
from tests.parallel.data.test_data_parallel import OPTIM, train_step

STATES = ("param", "exp_avg", "exp_avg_sq")


def _config():
    return make_config("gpt2", activation="swiglu", sequence_parallel=True)


def _optimizer(models, pstate, *, dist_opt=False, fsdp=False):
    if fsdp:
        chunks = [apply_fsdp2(m, pstate) for m in models]
    else:
        chunks = [DistributedDataParallel(m, pstate, bucket_size=3000, use_distributed_optimizer=dist_opt)
                  for m in models]
    return chunks, build_optimizer(chunks, pstate, use_distributed_optimizer=dist_opt, **OPTIM)


def _full_state(chunks, optimizer, pstate) -> dict:
    """(name, state) -> the full (TP = 1, unpadded) tensor, gathered over DP and TP."""
    saved = optimizer.state_dict()["params"]
    vocab, out = _config().vocab_size, {}
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            for key in STATES:
                value = gather_tp_full(param, saved[name][key], pstate.tp_group)
                out[(name, key)] = value[:vocab] if name.endswith(("word_embeddings.weight", "output_layer.weight")) \
                    else value
    return {"step": optimizer.num_steps, "state": out}


def _full_model(models) -> dict:
    vocab, out = _config().vocab_size, {}
    for model in models:
        out.update({n: t[:vocab] if "word_embeddings" in n or "output_layer" in n else t
                    for n, t in gather_full_weights(model).items()})
    return out


def _load(root, pstate, **how):
    models = build_model_chunks(_config(), pstate, init_seed=99)
    common = load_checkpoint(root, chunks=models, pstate=pstate)
    model = _full_model(models)
    chunks, optimizer = _optimizer(models, pstate, **how)
    load_optimizer_state(common, chunks=models, optimizer=optimizer, pstate=pstate)
    return chunks, optimizer, {**_full_state(chunks, optimizer, pstate), "model": model}


def _max_boxes(optimizer) -> int:
    """Most boxes of the full tensor one of this rank's shards needs (3: a row cut at both ends)."""
    return max(len(flat_boxes(m.lo, m.hi, m.param.shape)) for m in optimizer.mains)


def _handed_to_dcp(state) -> dict:
    """Elements of this rank's data per optimizer key of a DCP state dict."""
    out = {}
    for key, value in state.items():
        if key.startswith("optimizer/"):
            shards = value.local_shards() if hasattr(value, "local_shards") else None
            out[key] = sum(s.tensor.numel() for s in shards) if shards is not None else value.numel()
    return out


real_gather_full = distributed_optimizer.gather_full


def _forbidden(*args, **kwargs):
    raise AssertionError("gather_full called while saving")


def _worker(rank, world_size, root):
    save_state = ParallelState.create(ParallelLayout(world_size, tensor=2))
    model = GPTModel(_config(), save_state, init_seed=7)
    (chunk,), optimizer = _optimizer([model], save_state, dist_opt=True)
    for step in range(2):
        train_step(chunk, optimizer, save_state, step, 4)
    out = {"saved": {**_full_state([chunk], optimizer, save_state), "model": _full_model([model])}}
    owned = {m.name: m.hi - m.lo for m in optimizer.mains}
    out["boxes"] = _max_boxes(optimizer)

    handed, real_async_save = {}, checkpointing.dcp.async_save

    def recording_async_save(state, **kwargs):
        handed.update(_handed_to_dcp(state))
        return real_async_save(state, **kwargs)

    checkpointing.dcp.async_save = recording_async_save
    optimizer_module.gather_full = distributed_optimizer.gather_full = _forbidden
    try:
        pending = save_checkpoint(root, 2, chunks=[model], optimizer=optimizer, pstate=save_state,
                                  common={"model_config": _config().to_dict()},
                                  async_save=True, group=dist.new_group(backend="gloo"))
    finally:
        checkpointing.dcp.async_save = real_async_save
        optimizer_module.gather_full = distributed_optimizer.gather_full = real_gather_full
    train_step(chunk, optimizer, save_state, 2, 4)  # changes every state while the save is written
    pending.finalize()
    out["handed"] = {k: (n, owned.get(k.split("/", 2)[2], 0)) for k, n in handed.items()}
    out["owned"], out["local_numel"] = sum(owned.values()), sum(p.numel() for p in model.parameters())
    out["num_params"] = len(list(model.parameters()))

    layouts = {"tp2_pp2_plain": (dict(tensor=2, pipeline=2), {}),
               "tp1_dp4_distopt": ({}, dict(dist_opt=True)),
               "tp2_dp2_fsdp": (dict(tensor=2), dict(fsdp=True))}
    for label, (layout, how) in layouts.items():
        pstate = ParallelState.create(ParallelLayout(world_size, **layout))
        chunks, loaded_optimizer, out[label] = _load(root, pstate, **how)
        out[label]["boxes"] = _max_boxes(loaded_optimizer)
        if label == "tp2_dp2_fsdp":  # FSDP2 saves its own shards (model too); load them at TP = 1 DP = 4
            save_checkpoint(f"{root}/from_fsdp", 2, chunks=[c.module for c in chunks], optimizer=loaded_optimizer,
                            pstate=pstate, common={})
            out["fsdp_resaved_tp1_dp4"] = _load(f"{root}/from_fsdp", ParallelState.create(
                ParallelLayout(world_size)), dist_opt=True)[2]
    return out


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizer_state")
    return root, run_distributed(_worker, 4, str(root))


@pytest.fixture(scope="module")
def results(spawned):
    return spawned[1]


def test_shards_cut_rows(results):
    """The layouts exercise every box shape: shards that end mid-row when saving, and at DP = 4
    shards with a partial first row, whole rows and a partial last row."""
    assert all(r["boxes"] >= 2 for r in results)
    assert max(r["tp1_dp4_distopt"]["boxes"] for r in results) == 3


def test_save_hands_dcp_only_each_ranks_own_shard(results):
    for rank, result in enumerate(results):
        assert len(result["handed"]) == len(STATES) * result["num_params"]
        assert all(n <= owned for n, owned in result["handed"].values()), result["handed"]
        # every rank owns about half of its TP-local elements (DP = 2), none owns all of them
        assert result["owned"] <= 0.55 * result["local_numel"], rank


@pytest.mark.parametrize("label", ["tp2_pp2_plain", "tp1_dp4_distopt", "tp2_dp2_fsdp", "fsdp_resaved_tp1_dp4"])
def test_loaded_optimizer_state_equals_the_saved_one(results, label):
    saved = results[0]["saved"]
    tied = {("output_layer.weight", k): ("embedding.word_embeddings.weight", k) for k in STATES}
    covered = set()
    for rank, result in enumerate(results):
        loaded = result[label]
        assert loaded["step"] == saved["step"] == 2
        for key, value in loaded["state"].items():
            expected = saved["state"][tied.get(key, key)]
            assert torch.equal(value, expected), f"{label}, rank {rank}: {key} differs from the saved state"
            covered.add(tied.get(key, key))
        for name, value in loaded["model"].items():
            assert torch.equal(value, saved["model"][name]), f"{label}, rank {rank}: model {name} differs"
    assert covered == set(saved["state"])


def test_converter_reads_the_sharded_optimizer_state(spawned):
    from megalite.checkpoint.megalite_reader import MegaliteCheckpoint

    root, results = spawned
    checkpoint, saved = MegaliteCheckpoint(root), results[0]["saved"]
    for (name, key), expected in saved["state"].items():
        assert torch.equal(checkpoint.get(f"optimizer/{key}/{name}"), expected), (name, key)
