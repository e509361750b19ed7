"""A CPU bench's result file names the checkout's files as the repo's own, never by this machine's folders."""

import json

from bench import common


def test_paths_inside_the_checkout_are_written_relative(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    figures = {"drafter": str(common.ROOT / "var" / "drafters" / "qwen3"), "elsewhere": "/opt/models/x"}
    out = common.save_result("paths", "python -m bench.x", figures, [0.0, 0.0, 0.0])
    saved = json.loads(out.read_text())["figures"]
    assert saved == {"drafter": "var/drafters/qwen3", "elsewhere": "/opt/models/x"}
