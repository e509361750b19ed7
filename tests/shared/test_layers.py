"""Layer ids: any number captured, EAGLE-3's three checked where EAGLE-3 reads them, and DFlash's default set as
SGLang resolves it.

``build_target_layer_ids`` is the same rule in SGLang 0.5.17 (the GPU servers' version) and 0.5.23 (the version the
CPU tests import): ``test_build_target_layer_ids_is_one_rule`` compares its source in both released wheels, so the
comparison with 0.5.23's function, run in the SGLang venv, holds for 0.5.17 too.
"""

import ast
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from eaglet.shared.layers import dflash_layer_ids, layer_ids_problem, parse_layer_ids

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
WHEELS = ROOT / ".venv-sglang" / "wheels"
TARGET_LAYERS = range(1, 130)
DRAFT_LAYERS = range(1, 13)
SGLANG_IDS = """
import json, sys
from sglang.srt.speculative.dflash_utils import build_target_layer_ids
out = {}
for L in range(1, 130):
    for K in range(1, 13):
        try:
            out[f"{L},{K}"] = build_target_layer_ids(L, K)
        except ValueError:
            out[f"{L},{K}"] = None
json.dump(out, sys.stdout)
"""


def test_dflash_layer_ids_match_sglang():
    if not SGLANG_PY.exists():
        pytest.fail(f"{SGLANG_PY.relative_to(ROOT)} is missing: run `make install` (scripts/install-sglang-cpu.sh)")
    proc = subprocess.run([str(SGLANG_PY), "-c", SGLANG_IDS], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = json.loads(proc.stdout)
    compared = 0
    for L in TARGET_LAYERS:
        for K in DRAFT_LAYERS:
            outputs = theirs[f"{L},{K}"]  # 0-based layer outputs; SGLang captures the input of the next layer
            if outputs is None or len(set(outputs)) < K:
                # SGLang refuses the target, or its rule repeats layers (a capture would give fewer states)
                with pytest.raises(ValueError):
                    dflash_layer_ids(L, K)
                continue
            assert dflash_layer_ids(L, K) == [i + 1 for i in outputs], (L, K)
            compared += 1
    assert compared > 1000
    assert dflash_layer_ids(30, 5) == [2, 9, 15, 21, 28]  # SmolLM2 (7.5 rounds to 8, as SGLang rounds it)


def test_build_target_layer_ids_is_one_rule():
    def rule(version: str) -> str:
        (wheel,) = WHEELS.glob(f"sglang-{version}-*.whl")
        tree = ast.parse(zipfile.ZipFile(wheel).read("sglang/srt/speculative/dflash_utils.py"))
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_target_layer_ids")
        fn.body = fn.body[1:]  # the docstring
        return ast.dump(fn)

    assert rule("0.5.17") == rule("0.5.23")


def test_any_number_of_layers_captured_eagle3_reads_three():
    assert layer_ids_problem([2, 8, 15, 21, 28], 30) is None
    assert layer_ids_problem([5], 30) is None
    assert layer_ids_problem([2, 8, 15, 21, 28], 30, count=3) == "give 3 layer ids, not 5"
    assert layer_ids_problem([2, 15, 27], 30, count=3) is None
    assert layer_ids_problem([], 30) == "give at least one layer id"
    assert "increasing" in layer_ids_problem([2, 15, 15], 30)
    assert "start at 1" in layer_ids_problem([0, 15], 30)
    assert layer_ids_problem([1, 2, 6], 5) == "the model has 5 layers: give ids from 1 to 4"
    assert layer_ids_problem([1, 2, 3, 4, 5], 5) == "the model has 5 layers: 5 distinct capture points need at least 6"


def test_parse_layer_ids():
    assert parse_layer_ids("1,9,17", "--aux-layer-ids") == [1, 9, 17]
    with pytest.raises(ValueError, match=r"--aux-layer-ids='1,x': give comma-separated layer ids"):
        parse_layer_ids("1,x", "--aux-layer-ids")
