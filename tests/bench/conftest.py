"""The GPU bench's pure parts (bench/gpu/*.py) import each other as top-level modules, as they run there."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
