"""What a dry run's pipeline stage holds on the fake CUDA device does not grow with the
micro-batches: neither the received activations (torch's module tracker once kept each one,
and its gradient, alive to the end of the step) nor the sends (the fake process group's works
never complete; the dry run frees a send when the simulated schedule's peer has received it,
as NCCL does)."""

import gc
import json
import sys
import weakref

import pytest
import torch

from megalite.dryrun.pipeline_sends import send_completion_times
from megalite.dryrun.step_tracker import AcyclicModTracker, StepMemTracker
from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.pipeline.schedules import schedule_actions
from tests import program_server
from tests.dryrun.test_fake_cuda import REPO, fake_cuda_env

PP2_V2 = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 211 --num-layers 4 --hidden-size 64 "
          "--num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --lr 1e-3 --train-iters 1 "
          "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --recompute-granularity full "
          "--recompute-method uniform --recompute-num-layers 1 --dry-run --dry-run-device cuda "
          "--dry-run-world-size 2").split()


@pytest.mark.parametrize("tracker", [StepMemTracker, AcyclicModTracker])
@pytest.mark.parametrize("recompute", [None, "full"])
def test_tracker_keeps_no_input_of_a_stage_alive(tracker, recompute):
    kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                               max_position_embeddings=16, **kw), pre_process=False, post_process=False)
    seen_in_backward = set()
    with tracker() as t:
        mods = t._mod_tracker if isinstance(t, StepMemTracker) else t
        model.layers["0"].register_full_backward_hook(lambda *_: seen_in_backward.update(mods.parents))
        received = torch.randn(8, 2, 32, requires_grad=True)  # a pipeline stage's received activation
        out = model(hidden_states=received)
        torch.autograd.backward(out, torch.ones_like(out))
        alive = weakref.ref(received)
        del received, out
        gc.collect()
        assert alive() is None
    assert any(name.endswith("layers.0") for name in seen_in_backward), seen_in_backward


@pytest.mark.slow
def test_interleaved_stage_holds_the_same_activations_for_any_number_of_micro_batches():
    peaks = {}
    for m in (4, 8, 16):
        out = program_server.run([sys.executable, "-m", "tests.dryrun.dry_run_json", *PP2_V2, "--global-batch-size",
                                  str(m)], env=fake_cuda_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
        assert out.returncode == 0, out.stderr[-3000:]
        peaks[m] = [r["activation_peak"] for r in json.loads(out.stdout)]
    message = 32 * 64 * 4  # one activation message [s, b, h] in fp32
    assert all(peak > 2 * message for peak in peaks[4])
    # the last stage keeps each micro-batch's scalar loss for the step's mean (a 512-byte CUDA block each)
    for m in (8, 16):
        assert all(0 <= a - b <= 512 * (m - 4) for a, b in zip(peaks[m], peaks[4])), peaks


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)])
def test_a_send_is_done_once_the_peer_receives_it(schedule, v):
    p = 4
    held_most = {}
    for m in (8, 32):
        for rank in range(p):
            done, starts = send_completion_times(schedule, p, m, v, None, False, rank)
            sends = [a for a in schedule_actions(schedule, p, rank, m, v) if a.is_send]
            assert set(done) == set(sends)
            # a send posted before the k-th compute and not yet received is held at that compute
            order = schedule_actions(schedule, p, rank, m, v)
            posted_before, held, count = [], [], 0
            for action in order:
                if action.is_compute:
                    held.append(sum(done[s] > starts[count] for s in posted_before))
                    count += 1
                elif action.is_send:
                    posted_before.append(action)
            held_most[(m, rank)] = max(held)
    assert all(held_most[(8, r)] == held_most[(32, r)] for r in range(p)), held_most
    assert max(held_most.values()) <= 2 * v
