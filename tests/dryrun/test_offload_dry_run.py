"""The dry run accounts for --fine-grained-activation-offloading: it runs the offload hooks on
the fake CUDA device, where an offloaded tensor's bytes move to the (fake) CPU, so the measured
activation peak falls, less with a smaller --activation-offload-fraction (the measured step is the
one after Megatron's warm-up step, which offloads every group); the Korthikanti formula, which
does not model offloading, gives none."""

import json
import sys

from tests import program_server
from tests.dryrun.test_fake_cuda import REPO, fake_cuda_env


def test_offloading_lowers_the_measured_activation_peak():
    out = program_server.run([sys.executable, "-m", "tests.dryrun.offload_dry_runs"], env=fake_cuda_env(),
                             capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(out.stdout)
    kept, all_, half, none = (runs[label]["activation_peak"] for label in ("none", "1", "0.5", "0"))
    # one micro-batch, a dense then an MoE layer: the MoE layer's groups (the last of each name)
    # stay, as in Megatron; at 0.5, 2 of the dense layer's 5 too; at 0 all (the warm-up step made
    # the rotary tables the run without offloading makes in its measured step: a little less)
    assert all_ < half < none <= kept and all_ < 0.9 * kept and none > 0.99 * kept, runs
    assert runs["1"]["korthikanti"] is None
