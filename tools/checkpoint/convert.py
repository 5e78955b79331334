"""Convert GPT checkpoints: Hugging Face <-> megalite, and megalite between layouts (CPU).

    python tools/checkpoint/convert.py --loader hf --saver megalite --load-dir HF_DIR --save-dir OUT \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    python tools/checkpoint/convert.py --loader megalite --saver hf --load-dir CKPT --save-dir HF_OUT

See megalite/convert/cli.py for every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megalite.convert.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
