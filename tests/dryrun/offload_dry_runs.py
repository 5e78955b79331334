"""`python -m tests.dryrun.offload_dry_runs`: a dry run's activation peak and the formula's
activation bytes on the fake CUDA device, without offloading and with every --offload-modules
name offloaded at --activation-offload-fraction 1, 0.5 and 0, as JSON on stdout (for
tests/dryrun/test_offload_dry_run.py; run under the fake CUDA shim)."""

import json
import sys

from megalite.dryrun.fake_cuda import exit_now
from tests.dryrun.dry_run_json import reports

MOE = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-layers 2 --hidden-size 64 "
       "--num-attention-heads 4 --ffn-hidden-size 128 --swiglu --normalization RMSNorm --position-embedding-type rope "
       "--disable-bias-linear --seq-length 64 --micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --train-iters 1 "
       "--attention-dropout 0 --hidden-dropout 0 --bf16 --num-experts 4 --moe-ffn-hidden-size 96 --moe-router-topk 2 "
       "--moe-layer-freq [0,1] --moe-grouped-gemm --dry-run --dry-run-device cuda --dry-run-world-size 1").split()
ALL = "attn_norm qkv_linear core_attn attn_proj mlp_norm expert_fc1 moe_act".split()
FRACTIONS = ("1", "0.5", "0")

if __name__ == "__main__":
    peaks = {}
    for label in ("none",) + FRACTIONS:
        extra = (["--fine-grained-activation-offloading", "--min-offloaded-tensor-size", "0", "--offload-modules",
                  *ALL, "--activation-offload-fraction", label] if label != "none" else [])
        report = reports(MOE + extra)[0]
        peaks[label] = {"activation_peak": report.activation_peak, "korthikanti": report.korthikanti}
    json.dump(peaks, sys.stdout)
    exit_now(0)
