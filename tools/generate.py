"""Generate text from a megalite checkpoint with a KV cache (greedy, temperature, top-k, top-p).

    python tools/generate.py --load CKPT --prompt "Once upon a time" --max-new-tokens 32 --temperature 0
    torchrun --nproc-per-node 2 tools/generate.py --load CKPT --tensor-model-parallel-size 2 --prompt-file P.txt

See megalite/inference/cli.py for every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megalite.inference.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
