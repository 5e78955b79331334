"""Plan a layout: which TP x PP x DP x ... fits and which is fastest (megalite.planner.cli)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megalite.planner.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
