"""TensorBoard's 'batch-size' and 'batch-size vs samples': Megatron-LM writes both at every
TensorBoard log step, with or without any flag (megatron/training/training.py, training_log:
writer.add_scalar('batch-size', batch_size, iteration) and ('batch-size vs samples', batch_size,
args.consumed_train_samples)); megalite did only with --log-batch-size-to-tensorboard, which
Megatron-LM no longer has (the flag now gives a start-up line)."""

from types import SimpleNamespace

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megalite.config.run_config import startup_notes
from megalite.training.tensorboard_log import MegatronTensorboard
from tests.config.test_arguments import parsed


def test_batch_size_scalars_at_every_log_step(tmp_path):
    logging = SimpleNamespace(tensorboard_dir=str(tmp_path), tensorboard_queue_size=5, tensorboard_log_interval=2,
                              log_learning_rate_to_tensorboard=True, log_batch_size_to_tensorboard=False,
                              log_loss_scale_to_tensorboard=True, log_world_size_to_tensorboard=False,
                              log_memory_to_tensorboard=False, log_timers_to_tensorboard=False,
                              log_validation_ppl_to_tensorboard=False)
    board = MegatronTensorboard(logging, True)
    consumed = 0
    for iteration, batch in enumerate((4, 4, 8, 8, 16, 16), start=1):  # a ramp-up
        consumed += batch
        board.log_iteration(iteration, consumed_samples=consumed, learning_rate=1e-3, batch_size=batch, loss=2.0,
                            loss_scale=1.0)
    board.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("batch-size")] == [(2, 4), (4, 8), (6, 16)]
    assert [(e.step, e.value) for e in events.Scalars("batch-size vs samples")] == [(8, 4), (24, 8), (56, 16)]


def test_the_old_switch_says_it_changes_nothing():
    notes = [n for n in startup_notes(parsed("--log-batch-size-to-tensorboard --tensorboard-dir /tmp/tb", 1))
             if n.startswith("--log-batch-size-to-tensorboard")]
    assert notes == ["--log-batch-size-to-tensorboard: 'batch-size' and 'batch-size vs samples' are written at every "
                     "TensorBoard log step anyway, as Megatron-LM writes them (it no longer has this flag)"]
