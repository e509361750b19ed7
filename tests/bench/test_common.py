"""A CPU bench's result file names the checkout's files as the repo's own, never by this machine's folders."""

import importlib.util
import json
from pathlib import Path

# by file: the CPU benches' folder on the import path would put its pipeline.py, storage.py... before others
_spec = importlib.util.spec_from_file_location("bench_common", Path(__file__).resolve().parents[2] / "bench/common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def test_paths_inside_the_checkout_are_written_relative(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    figures = {"drafter": str(common.ROOT / "var" / "drafters" / "qwen3"), "elsewhere": "/opt/models/x"}
    out = common.save_result("paths", "python bench/x.py", figures, [0.0, 0.0, 0.0])
    saved = json.loads(out.read_text())["figures"]
    assert saved == {"drafter": "var/drafters/qwen3", "elsewhere": "/opt/models/x"}
