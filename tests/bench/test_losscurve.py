"""The loss-curve phases (bench/gpu/losscurve.py) run whole on CPU at a tiny shape, and their comparison
(bench/gpu/comparecurves.py): the same trainer agrees with itself step by step, a changed one is caught at the
first step it changes, and records of other settings do not compare."""

import importlib
import json
import sys

import pytest

TINY_ENV = {"LOSSCURVE_SHAPE": "tiny", "LOSSCURVE_T": "64", "LOSSCURVE_STEPS": "5", "LOSSCURVE_SAMPLES": "4"}
FLAGS = "--ttt-steps 2 --loader-workers 0 --compile off"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def curves(tmp_path, monkeypatch, flags_b: str) -> tuple[dict, dict]:
    """Both phases run in one call, as on the GPU; their records."""
    env = {"OUT": str(tmp_path / "out"), "GPUBENCH_ROOT": str(tmp_path / "root"), "LOSSCURVE_FLAGS": FLAGS,
           "LOSSCURVE_FLAGS_B": flags_b, **TINY_ENV}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from bench.gpu import harness, losscurve, trainspeed

    importlib.reload(harness)
    importlib.reload(trainspeed)
    lc = importlib.reload(losscurve)
    monkeypatch.setattr(sys, "argv", ["losscurve.py", "losscurve", "losscurve-b"])
    assert lc.P.main(lc.PHASES, {}) == 0
    return tuple(json.loads((lc.P.OUT / f"{p}.json").read_text()) for p in ("losscurve", "losscurve-b"))


def compare(tmp_path, a: dict, b: dict, *flags: str) -> tuple[int, dict]:
    from bench.gpu import comparecurves

    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = tmp_path / "cmp.json"
    rc = comparecurves.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(out), *flags])
    return rc, json.loads(out.read_text())


def test_the_same_trainer_agrees_with_itself_and_a_change_is_caught_where_it_starts(tmp_path, monkeypatch):
    a, same = curves(tmp_path, monkeypatch, FLAGS)
    assert a["done"] and [s["step"] for s in a["steps"]] == [1, 2, 3, 4, 5]
    assert all(len(s["step_losses"]) == 2 and len(s["acc"]) == 2 for s in a["steps"])
    assert a["steps"][0]["loss"] != a["steps"][-1]["loss"] and a["compiled_graphs"] == 0
    rc, result = compare(tmp_path, a, same, "--rtol", "1e-6", "--atol", "0")
    assert rc == 0 and result["agree"] and result["max_abs_diff"] == 0.0  # deterministic on the CPU
    # a longer warm-up halves the first update: the first step (before any update) agrees, the second does not
    _, slower = curves(tmp_path / "2", monkeypatch, FLAGS + " --warmup-ratio 0.5")
    rc, result = compare(tmp_path, a, slower, "--rtol", "1e-6", "--atol", "0")
    assert rc == 1 and not result["agree"] and result["first_disagreeing_step"] == 2
    assert result["per_step"][0]["abs_diff"] == 0.0


def test_records_of_other_settings_do_not_compare(tmp_path, monkeypatch):
    a, b = curves(tmp_path, monkeypatch, FLAGS + " --lr 3e-4")
    rc, result = compare(tmp_path, a, b)
    assert rc == 2 and result == {"comparable": False, "why": "config lr: 0.001 against 0.0003"}
