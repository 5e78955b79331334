"""The dry run accounts for --fine-grained-activation-offloading: it runs the offload hooks on
the fake CUDA device, where an offloaded tensor's bytes move to the (fake) CPU, so the measured
activation peak falls; the Korthikanti formula, which does not model offloading, gives none."""

import json
import sys

from tests import program_server
from tests.dryrun.test_fake_cuda import REPO, fake_cuda_env


def test_offloading_lowers_the_measured_activation_peak():
    out = program_server.run([sys.executable, "-m", "tests.dryrun.offload_dry_runs"], env=fake_cuda_env(),
                             capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(out.stdout)
    kept, offloaded = runs["none"]["activation_peak"], runs["all"]["activation_peak"]
    assert offloaded < 0.7 * kept, runs
    assert runs["all"]["korthikanti"] is None
