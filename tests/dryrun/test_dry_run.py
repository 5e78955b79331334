"""--dry-run: one training iteration of each distinct rank of a TP=2, PP=2 (two virtual stages),
DP=2 layout with the distributed optimizer, sequence parallelism and selective recompute, in
bf16, on fake CUDA with the fake process group; bytes held equal formulas.md's, bytes moved
equal the schedule's; planted device and dtype mismatches stop the run naming module and
tensors."""

import re
import sys

import pytest
import torch

from megalite.data.tokenizers import build_tokenizer
from megalite.dryrun import runner
from megalite.dryrun.cli import run_dry
from megalite.dryrun.probes import MixedTensorsError
from megalite.config.arguments import layout_from_args, parse_args, validate_args
from tests.dryrun.dry_run_json import reports
from tests import program_server
from tests.dryrun.test_fake_cuda import REPO, fake_cuda_env

S, B, H, T, D = 32, 2, 64, 2, 2
SMALL = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 211 --num-layers 4 --hidden-size 64 "
         "--num-attention-heads 4 --group-query-attention --num-query-groups 2 --ffn-hidden-size 96 --swiglu "
         "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
         "--untie-embeddings-and-output-weights --seq-length 32 --micro-batch-size 2 --global-batch-size 8 "
         "--lr 3e-3 --train-iters 1 --bf16 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
         "--num-layers-per-virtual-pipeline-stage 1 --dry-run-world-size 8 --use-distributed-optimizer "
         "--sequence-parallel --recompute-activations --dry-run").split()
MICRO_BATCHES = 8 // (B * D)


def test_dry_run_on_fake_cuda_prints_formula_bytes_per_rank():
    out = program_server.run([sys.executable, "-m", "megalite.pretrain_gpt", *SMALL], env=fake_cuda_env(),
                             capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "device cuda (fake)" in out.stdout
    assert "a pipeline send is held until its peer receives it" in out.stdout  # PP=2: how sends are modelled
    held = re.findall(r"^\s+(\d+)\s+\((\d), (\d), (\d), (\d)\)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+formula\s+([\d,]+)\s+"
                      r"([\d,]+)\s+([\d,]+)", out.stdout, re.M)
    assert [int(h[0]) for h in held] == [0, 4], out.stdout
    for h in held:
        numbers = [int(x.replace(",", "")) for x in h[5:]]
        assert numbers[:3] == numbers[3:] and min(numbers) > 0, h
    # one row per pipeline stage: stage, measured rank, layers per chunk, peak by category, total
    peaks = re.findall(r"^\s+(\d)\s+(\d)\s+1\+1\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                       r"\s+yes$", out.stdout, re.M)
    assert [p[:2] for p in peaks] == [("0", "0"), ("1", "4")], out.stdout
    assert all(float(p[5]) > 0 for p in peaks), out.stdout  # activations
    assert out.stdout.strip().splitlines()[-1].startswith("verdict: highest peak "), out.stdout


def test_dry_run_bytes_held_and_moved_on_fake_cpu():
    got = reports(SMALL + ["--dry-run-device", "cpu"])
    assert [r.rank for r in got] == [0, 4]
    for r in got:
        assert r.resident == r.formula
        assert 0 <= r.num_buffer - r.num_params < 2 * 64  # gradient buffers padded for the DP shards
        assert r.peak["activations"] > 0 and r.peak_total == sum(r.peak.values())
        # the distributed optimizer reduce-scatters the fp32 gradient buffer once and all-gathers
        # this rank's bf16 parameter shard
        assert r.comm[("dp", "reduce-scatter")] == r.formula["gradients"]
        assert r.comm[("dp", "all-gather")] == r.formula["parameters"] // D
        assert r.comm[("tp", "all-gather")] > 0 and r.comm[("tp", "reduce-scatter")] > 0
    # pipeline rank 0 sends activations of virtual stages 0 and 2 and the gradient of stage 2's
    # input, once per micro-batch: [s/t, b, h] bf16 each
    assert got[0].comm[("pp", "send")] == 3 * MICRO_BATCHES * (S // T) * B * H * 2
    assert got[0].calls[("pp", "send")] == 3 * MICRO_BATCHES


@pytest.mark.parametrize("tp, dp", [(2, 1), (1, 2)])
def test_held_bytes_equal_formula_on_the_rank_holding_bucket_padding(tp, dp):
    """The last stage's buckets are padded (to 128 elements under the distributed optimizer, even
    at DP = 1); the padding lies in the last DP rank's shard, whose fp32 main copy covers it and
    whose Adam moments do not: formulas.md's bytes applied to what each state covers."""
    from tests.dryrun.test_real_vs_dry import _layout

    args = parse_args(_layout(tp, 2, dp))
    world = args.dry_run_world_size
    validate_args(args, world)
    layout = layout_from_args(args, world)
    rank = layout.rank_of(0, dp - 1, 1)
    vocab = build_tokenizer(args.tokenizer_type, vocab_size=args.vocab_size).vocab_size
    r = runner.run_rank(args, vocab, rank, world, torch.device("cpu"))
    assert r.num_buffer > r.num_params  # padding, in this rank's shard
    assert r.resident == r.formula


@pytest.mark.parametrize("scalar, rank", [("adam", 7), ("lion", 0)])
def test_held_bytes_equal_formula_under_muon(scalar, rank):
    """Muon keeps one fp32 momentum per weight element; the embedding, output layer and norms go
    to the scalar optimizer (Adam: two moments and a step; Lion: one moment). Rank 0 holds the
    embedding, rank 7 the output layer and the padded last bucket."""
    args = parse_args(list(SMALL) + ["--optimizer", "muon", "--muon-scalar-optimizer", scalar,
                                     "--dry-run-device", "cpu"])
    world = args.dry_run_world_size
    validate_args(args, world)
    vocab = build_tokenizer(args.tokenizer_type, vocab_size=args.vocab_size).vocab_size
    r = runner.run_rank(args, vocab, rank, world, torch.device("cpu"))
    assert r.resident == r.formula

def test_fp16_gradient_copies_are_optimizer_state_at_the_peak():
    # fp16 gradients (Megatron's fp16 default) step from an fp32 copy the optimizer holds for
    # the whole run: at the peak it is optimizer state, not activations first touched in the step
    argv = [a for a in SMALL if a not in ("--bf16", "--use-distributed-optimizer")] + ["--fp16", "--dry-run-device",
                                                                                         "cpu"]
    for r in reports(argv):
        assert r.resident == r.formula
        assert r.peak["optimizer"] == r.resident["optimizer"], (r.rank, r.peak, r.resident)


def test_peaks_do_not_depend_on_the_garbage_collector():
    """With full recompute the backward rebuilds each layer's graph; once its activations are
    taken, nothing may keep that graph alive (the module tracker's backward hooks once did, in
    reference cycles only the cyclic garbage collector freed). Peaks with it off equal peaks with
    it on."""
    import gc

    from tests.dryrun.test_real_vs_dry import _layout

    argv = [a for a in _layout(1, 1, 1) if a != "--recompute-activations"] + \
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
    collected = reports(argv)[0].peak
    gc.disable()
    try:
        uncollected = reports(argv)[0].peak
    finally:
        gc.enable()
    assert uncollected == collected


def _run_cpu(monkeypatch, capsys):
    args = parse_args(SMALL + ["--dry-run-device", "cpu"])
    status = run_dry(args, [])
    return status, capsys.readouterr().err


def test_planted_device_mismatch_is_named(monkeypatch, capsys):
    import megalite.model.gpt as gpt

    real = gpt.rotary_cos_sin_for
    monkeypatch.setattr(gpt, "rotary_cos_sin_for", lambda *a, **k: tuple(t.to("meta") for t in real(*a, **k)))
    status, err = _run_cpu(monkeypatch, capsys)
    assert status == 1
    assert "rank 0" in err and "self_attention" in err and "meta" in err and "cpu" in err, err


def test_planted_dtype_mismatch_is_named(monkeypatch, capsys):
    real = runner.PipelineExecutor

    def fp32_fc2(chunks, *args, **kwargs):
        """An fp32 weight left in a bf16 model after the optimizer was built."""
        for name, module in chunks[-1].named_modules():
            if name.endswith("mlp.linear_fc2"):
                module.weight.data = module.weight.data.float()
        return real(chunks, *args, **kwargs)

    monkeypatch.setattr(runner, "PipelineExecutor", fp32_fc2)
    status, err = _run_cpu(monkeypatch, capsys)
    assert status == 1
    assert "mlp.linear_fc2" in err and "torch.bfloat16" in err and "torch.float32" in err, err


@pytest.mark.parametrize("flag", [["--dry-run-world-size", "8"], ["--dry-run-device", "cpu"], ["--dry-run-all-stages"],
                                  ["--dry-run-gpu-memory-gib", "40"]])
def test_dry_run_flags_need_dry_run(flag):
    from megalite.config.arguments import validate_args

    base = " ".join(SMALL).replace(" --dry-run-world-size 8", "").replace(" --dry-run", "").split()
    args = parse_args(base + flag)
    with pytest.raises(ValueError, match=re.escape(flag[0]) + ".*needs --dry-run"):
        validate_args(args, 8)


@pytest.mark.parametrize("gib", ["0", "-1", "nan"])
def test_gpu_memory_must_be_positive(gib):
    from megalite.config.arguments import validate_args

    with pytest.raises(ValueError, match=f"--dry-run-gpu-memory-gib must be positive, got {gib}"):
        validate_args(parse_args(SMALL + ["--dry-run-gpu-memory-gib", gib]), 8)


@pytest.mark.slow
def test_all_stages_runs_every_pipeline_rank():
    argv = (" ".join(SMALL).replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 1")
            .replace("--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 4")
            .replace("--num-layers 4", "--num-layers 8").replace(" --sequence-parallel", "")
            .replace("--global-batch-size 8", "--global-batch-size 16").split())
    got = reports(argv + ["--dry-run-device", "cpu", "--dry-run-all-stages"])
    assert [r.coords[2] for r in got] == [0, 1, 2, 3]
    assert all(r.resident == r.formula for r in got)
    # 1F1B-interleaved: the first stage holds the most micro-batches' activations at its peak
    assert got[0].peak["activations"] > got[-1].peak["activations"]


def test_the_fused_weight_gradient_gemm_may_mix_16_bit_operands_with_its_fp32_result():
    """Gradient accumulation fusion's torch.addmm(main_grad, dy^T, x, out_dtype=fp32, out=main_grad):
    allowed; operands of two dtypes, or an accumulator not of out_dtype, still named."""
    from megalite.dryrun.probes import MixCheck

    main = torch.zeros(4, 3, device="meta")
    dy, x = torch.zeros(5, 4, dtype=torch.bfloat16, device="meta"), torch.zeros(5, 3, dtype=torch.bfloat16, device="meta")
    with MixCheck(lambda: "fc"):
        torch.addmm(main, dy.t(), x, out_dtype=torch.float32, out=main)
        torch.mm(dy.t(), x, out_dtype=torch.float32)
    for bad in ((main, dy.t(), x.float()), (main.bfloat16(), dy.t(), x)):
        with pytest.raises(MixedTensorsError, match="addmm.dtype_out in module fc mixes dtypes"):
            with MixCheck(lambda: "fc"):
                torch.addmm(bad[0], bad[1], bad[2], out_dtype=torch.float32, out=bad[0])
