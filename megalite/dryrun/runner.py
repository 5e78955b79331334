"""One rank's complete training iteration on fake tensors (FakeTensorMode) with the fake process
group: the model built on the meta device and materialised on the fake device, wrapped for
data parallelism, its optimizer, the pipeline executor running the real schedule over every
micro-batch, the gradient reduction and the optimizer step, under MemTracker (peak memory by
category), a communication counter and a device/dtype mix check.
"""

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.testing._internal.distributed.fake_pg import FakeStore

from megalite.dryrun.balanced_routing import alltoall_formula_bytes, assume_balanced_routing
from megalite.dryrun.fake_cuda import CpuStreamsAsCuda
from megalite.dryrun.formulas import expected_bytes, korthikanti_activation_bytes
from megalite.dryrun.gpu_attention import GpuAttention
from megalite.dryrun.pipeline_sends import ScheduledSendsP2P, send_completion_times
from megalite.dryrun.probes import CommCounter, MixCheck, ScalarReads
from megalite.dryrun.step_tracker import AcyclicModTracker, StepMemTracker
from megalite.model.fp8 import enable_fp8_chunks
from megalite.model.meta_init import materialize_
from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.model.moe import moe_layers
from megalite.model.offload import end_offload_step
from megalite.parallel.context import local_positions
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads
from megalite.parallel.data.fsdp import FSDPChunk
from megalite.parallel.expert.dispatch import AllToAllDispatcher
from megalite.parallel.expert.groups import ExpertLayout, ExpertState
from megalite.parallel.pipeline.executor import PipelineExecutor
from megalite.parallel.state import ParallelState
from megalite.config.arguments import layout_from_args, model_config_from_args
from megalite.config.fp8 import fp8_recipe_from_args
from megalite.config.megatron.training import interleaved_group_size, split_accounting
from megalite.config.run_config import OptimizerConfig, ParallelConfig, compute_dtype
from megalite.training.setup_run import build_optimizer_and_schedule, wrap_chunks

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")
_FROM_MEMTRACKER = {_MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "parameters",
                    _MemRefType.GRAD: "gradients", _MemRefType.OPT: "optimizer",
                    _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporaries",
                    _MemRefType.OTH: "temporaries"}


@dataclass
class RankReport:
    rank: int
    coords: tuple  # (tp, dp, pp, cp)
    chunks: list  # per chunk: (layers, pre_process, post_process)
    peak: dict = field(default_factory=dict)  # category -> bytes at the peak
    peak_total: int = 0
    activation_peak: int = 0  # the most activation bytes held at any moment (the peak's may be fewer)
    resident: dict = field(default_factory=dict)  # parameters / gradients / optimizer after the step
    num_params: int = 0  # parameters this rank holds (its chunks' numel)
    num_buffer: int = 0  # the same padded as in the contiguous gradient buffers
    formula: dict = field(default_factory=dict)  # formulas.md's bytes held (formulas.expected_bytes)
    comm: dict = field(default_factory=dict)  # (group, kind) -> bytes
    calls: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)  # name -> (bytes counted, formula's bytes)
    korthikanti: int | None = None  # formulas.md's activation bytes for this rank (formulas.py)
    ep_coords: tuple | None = None  # (ep, edp) with experts


def _own_group(lists, rank: int):
    ranks = next((r for r in lists if rank in r), None)  # middle stages hold no embedding
    return None if ranks is None else dist.new_group(ranks, use_local_synchronization=True)


def _state(layout, rank: int, args) -> ParallelState:
    """This rank's groups only (the fake group needs no peers to agree on the others)."""
    groups = {"world": dist.group.WORLD}
    for name, lists in (("tp", layout.tp_groups()), ("dp", layout.dp_groups()), ("pp", layout.pp_groups()),
                        ("mp", layout.mp_groups()), ("embedding", layout.embedding_groups()),
                        *((("cp", layout.cp_groups()), ("dp_cp", layout.dp_cp_groups())) if layout.context > 1
                          else ()),
                        *((("dp_cp_instance", layout.dp_cp_instance_groups()),
                           ("dp_cp_replica", layout.dp_cp_replica_groups()),
                           ("instance", layout.optimizer_instance_groups())) if layout.optimizer_instances > 1
                          else ())):
        groups[name] = _own_group(lists, rank)
    pstate = ParallelState(layout, rank, {n: g for n, g in groups.items() if g is not None})
    if args.num_experts is not None:
        expert = ExpertLayout(layout, args.expert_model_parallel_size, args.num_experts,
                              args.expert_tensor_parallel_size)
        pstate.expert = ExpertState(expert, rank, {name: _own_group(lists, rank)
                                                   for name, lists in ExpertState.group_lists(expert).items()})
    return pstate


def _microbatches(args, device, count: int, vocab: int, pstate):
    """Micro-batches as the loader gives them: this context-parallel rank's two chunks."""
    for _ in range(count):
        shape = (args.micro_batch_size, args.seq_length // pstate.cp_size)
        yield {"tokens": torch.randint(0, vocab, shape, device=device),
               "labels": torch.randint(0, vocab, shape, device=device),
               "loss_mask": torch.ones(shape, device=device),
               "position_ids": local_positions(args.seq_length, pstate.cp_size, pstate.cp_rank, device).expand(shape),
               "attention_mask": None}


def _track_megalite_state(mt: MemTracker, chunks, optimizer, fp8_scaling=None) -> None:
    """Tell MemTracker what megalite holds outside .grad and optimizer.state: the contiguous
    parameter and main-gradient buffers of DDP, the fp32 main parameters and, with fp16
    gradients, their fp32 copies, and FP8 delayed scaling's amax histories and scales (filed
    with the parameters, as buffers are; else filed as activations when first used)."""
    for state in (fp8_scaling.states.values() if fp8_scaling is not None else ()):
        for tensor in (state.amax_history, state.scales):
            mt._update_and_maybe_create_winfos(tensor, _MemRefType.BUFFER)
    for chunk in chunks:
        mt.track_external(chunk.module)
        if isinstance(chunk, DistributedDataParallel):
            for buffer in chunk.buffers_:
                mt._update_and_maybe_create_winfos(buffer.grad_data, _MemRefType.GRAD)
                if buffer.param_data is not None:
                    mt._update_and_maybe_create_winfos(buffer.param_data, _MemRefType.PARAM)
    for group in optimizer.inner.param_groups:
        for p in group["params"]:
            mt._update_and_maybe_create_winfos(p, _MemRefType.OPT)
    for shard in getattr(optimizer, "bucket_shards", []):
        if shard.grad_flat is not None:  # fp16 gradients' fp32 copy (formulas.md counts it as optimizer state)
            mt._update_and_maybe_create_winfos(shard.grad_flat, _MemRefType.OPT)
    mt.track_external(optimizer.inner)


def comm_checks(args, config, pstate, models, counted: dict) -> dict:
    """Bytes a formula predicts beside what was counted: MoE all-to-all (the dispatchers' count
    of rows sent to other ranks) and all_gather context parallelism."""
    checks = {}
    layers = sum(config.cp_comm_type_for(int(n)) == "all_gather" for m in models for n in m.layers)
    if pstate.cp_size > 1 and layers and not args.recompute_activations and args.recompute_granularity is None:
        checks["cp all-gather K,V"] = (
            counted.get(("cp", "all-gather"), 0), all_gather_cp_bytes(args, config, pstate.tp_size, pstate.cp_size, layers))
    moe = moe_layers(models)
    if moe and isinstance(moe[0].dispatcher, AllToAllDispatcher) and pstate.expert.ep_size > 1:
        tokens = args.seq_length // pstate.cp_size * args.micro_batch_size // pstate.tp_size  # this rank's share
        element = 2 if args.bf16 or args.fp16 else 4
        checks["ep all-to-all tokens to other ranks"] = (
            sum(layer.dispatcher.traffic[0] for layer in moe),
            alltoall_formula_bytes(args.num_micro_batches, len(moe), tokens, config.moe.router_topk,
                                   pstate.expert.ep_size, config.hidden_size, element))
    return checks


def all_gather_cp_bytes(args, config, tp: int, cp: int, layers: int) -> int:
    """Bytes this rank hands the CP all-gather per iteration with --cp-comm-type all_gather: its
    K and V ([b, groups/tp, s/cp, head dim] each) per layer, forward and again in backward, so
    that each rank receives (CP-1)/CP of every layer's K,V twice per micro-batch."""
    groups = config.num_query_groups or config.num_attention_heads
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    element = 2 if args.bf16 or args.fp16 else 4
    local_kv = 2 * args.micro_batch_size * (groups // tp) * (args.seq_length // cp) * head_dim * element
    return 2 * args.num_micro_batches * layers * local_kv


def run_rank(args, vocab_size: int, rank: int, world_size: int, device: torch.device,
             strict: bool = True, real: bool = False) -> RankReport:
    """One training iteration of global rank `rank` of a `world_size`-process run of `args`
    (validated; `vocab_size` the tokenizer's), on fake tensors on `device`. Raises
    MixedTensorsError naming the op, module and tensors when an op mixes devices (or matmul
    dtypes). With `real` the same iteration runs on real tensors in a process group already
    initialised (every rank calls it): the measurement a dry run is checked against."""
    if not real:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        layout = layout_from_args(args, world_size)
        pstate = ParallelState.create(layout) if real else _state(layout, rank, args)
        if real and args.num_experts is not None:
            pstate.expert = ExpertState.create(pstate, args.expert_model_parallel_size, args.num_experts,
                                               expert_tensor_size=args.expert_tensor_parallel_size)
        config = model_config_from_args(args, vocab_size)
        parallel = ParallelConfig.from_args(args, world_size)
        if parallel.use_torch_fsdp2:
            config = config.replace(params_dtype="float32")  # FSDP2 keeps fp32 shards, as run_config builds it
        fake = contextlib.nullcontext() if real else FakeTensorMode()
        # The module running now, for MixCheck's errors: ModTracker (MemTracker's own tracker, here
        # without its leak, step_tracker.py) adds no backward hooks while backward runs.
        # torch.utils.module_tracker.ModuleTracker does, on the graph that activation recompute
        # builds in backward, and its multi-grad hooks form reference cycles with those graph
        # nodes: the recomputed activations then lived until the cyclic garbage collector ran, so
        # peaks depended on when it ran.
        modules = AcyclicModTracker()
        expert = pstate.expert
        # without CP, dp_cp_group is dp_group: the later "dp" names it (and with one optimizer
        # instance, its groups are dp_cp / world: the later names win)
        counter = CommCounter({pstate.instance_group: "instance", pstate.dp_cp_replica_group: "dp_cp_replica",
                               pstate.dp_cp_instance_group: "dp_cp_instance", pstate.dp_cp_group: "dp_cp", pstate.tp_group: "tp", pstate.cp_group: "cp",
                               pstate.dp_group: "dp", pstate.pp_group: "pp", pstate.mp_group: "mp", pstate.embedding_group: "embedding",
                               pstate.world_group: "world", **({expert.etp_ep_group: "etp_ep", expert.etp_group: "etp",
                                                                 expert.ep_group: "ep", expert.edp_group: "edp"}
                                                               if expert is not None else {})})
        models = build_model_chunks(config, pstate, num_layers_first=args.decoder_first_pipeline_num_layers,
                                    num_layers_last=args.decoder_last_pipeline_num_layers, init_seed=args.seed,
                                    device="meta", **split_accounting(args))
        if not real:
            assume_balanced_routing(models)
        with fake, contextlib.nullcontext() if real else ScalarReads(), GpuAttention(), CpuStreamsAsCuda():
            for m in models:
                materialize_(m, device, init=real)
            # FP8 linears' GEMMs and delayed-scaling states, as setup_run gives them (on the materialised device)
            fp8_scaling = enable_fp8_chunks(models, fp8_recipe_from_args(args), config.num_layers, pstate)
            chunks = wrap_chunks(models, parallel, pstate)
            optimizer, _ = build_optimizer_and_schedule(chunks, OptimizerConfig.from_args(args), pstate)
            if optimizer.loss_scaler is not None and not real:  # fp16: run the inf check, take its answer as "none"
                find_inf = optimizer._unscale_and_find_inf
                optimizer._unscale_and_find_inf = lambda: find_inf() and False
            executor = PipelineExecutor(
                chunks, pstate, args.pipeline_schedule, num_microbatches=args.num_micro_batches,
                seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, hidden_size=config.hidden_size,
                sequence_parallel=config.sequence_parallel, dtype=compute_dtype(args), device=device,
                forward_step=gpt_forward_step, microbatch_group_size=interleaved_group_size(args),
                eager_sends=None if real else device.type == "cpu")  # a CPU run's gloo posts eagerly
            if config.offload_modules:  # the offload plan's warm-up step: the measured step keeps what Megatron's does
                executor.loss_scale = optimizer.loss_scale
                executor.run(_microbatches(args, device, args.num_micro_batches, config.vocab_size, pstate))
                end_offload_step(models)
                optimizer.zero_grad()
            # NCCL reports a send complete once the peer has received it; gloo only when waited on
            # (p2p.py), so a CPU run holds its sends to the step's end, as the fake works do
            if executor.p2p is not None and not real and device.type != "cpu":
                executor.p2p = ScheduledSendsP2P(executor.p2p, *send_completion_times(
                    args.pipeline_schedule, pstate.pp_size, args.num_micro_batches, pstate.vp_size,
                    interleaved_group_size(args), args.recompute_granularity == "full", pstate.pp_rank))
            # A steady iteration: the optimizer state every step but the first starts with (Adam's
            # moments, made by its first step: here one on the zero gradients).
            # (FSDP2's sharded parameters are the main parameters: without a gradient Adam makes no
            # moments for them, so they get zero gradients for this step)
            for chunk in chunks:
                if isinstance(chunk, FSDPChunk):
                    for param in chunk.module.parameters():
                        param.grad = torch.zeros_like(param)
            optimizer.inner.step()
            mt = StepMemTracker()
            _track_megalite_state(mt, chunks, optimizer, fp8_scaling)
            checks = MixCheck(lambda: max(modules.parents, key=len, default="")) if strict else None
            with mt, counter, modules:
                if checks is not None:
                    checks.__enter__()
                try:
                    optimizer.zero_grad()
                    executor.loss_scale = optimizer.loss_scale
                    executor.run(_microbatches(args, device, args.num_micro_batches, config.vocab_size, pstate))
                    finalize_model_grads(chunks, pstate)
                    optimizer.step(iteration=1)
                    if fp8_scaling is not None:
                        fp8_scaling.after_optimizer_step()
                finally:
                    if checks is not None:
                        checks.__exit__(None, None, None)
            snap = mt.get_tracker_snapshot("peak")
            # held after the step, in exact bytes (MemTracker rounds CUDA storages up to the
            # caching allocator's 512-byte blocks)
            held = {}
            for storage, (info, _) in list(mt._WINFO.items()):
                category = _FROM_MEMTRACKER[info.reftype]
                if info.device.type == device.type and category in ("parameters", "gradients", "optimizer"):
                    held[category] = held.get(category, 0) + storage.nbytes()
        report = RankReport(rank, (*layout.coords(rank), layout.cp_rank_of(rank)),
                            [(list(m.layers), m.pre_process, m.post_process) for m in models],
                            ep_coords=(expert.ep_rank, expert.edp_rank) if expert is not None else None)
        dev_snap = next((v for d, v in snap.items() if torch.device(d).type == device.type), {})
        for ref, category in _FROM_MEMTRACKER.items():
            report.peak[category] = report.peak.get(category, 0) + dev_snap.get(ref, 0)
        report.resident = {c: held.get(c, 0) for c in ("parameters", "gradients", "optimizer")}
        report.peak_total = sum(report.peak.values())
        report.activation_peak = next((v for d, v in mt.activation_peak.items()
                                       if torch.device(d).type == device.type), 0)
        report.comm, report.calls = dict(counter.bytes), dict(counter.calls)
        report.num_params = sum(p.numel() for m in models for p in m.parameters())
        report.num_buffer = sum(b.grad_data.numel() for c in chunks for b in getattr(c, "buffers_", []))
        shards = sum(p.to_local().untyped_storage().nbytes() // 4 for c in chunks if isinstance(c, FSDPChunk)
                     for p in c.module.parameters())
        report.formula = expected_bytes(args, [b for c in chunks for b in getattr(c, "buffers_", [])], optimizer,
                                        models, shards, len(fp8_scaling.states) if fp8_scaling is not None else 0)
        report.checks = comm_checks(args, config, pstate, models, report.comm)
        report.korthikanti = korthikanti_activation_bytes(args, config, pstate.tp_size, pstate.cp_size,
                                                          layout.coords(rank)[2],
                                                          [[int(n) for n in m.layers] for m in models])
        return report
    finally:
        if not real:
            dist.destroy_process_group()
