"""The plugin against the model families users serve, with each SGLang version's real classes.

Real: the served classes and their ``set_eagle3_layers_to_capture`` (Llama, Qwen3 dense and MoE,
DeepSeek-V3, GPT-OSS, and Kimi-K2.5, whose ``.model`` is a property returning ``language_model``),
``LogitsProcessor``. Laid out by hand on bare modules, as each ``__init__`` does: the decoder layers
(they need a GPU and an initialized process group). Cases: test_sglang_models_cases.py, run with the
SGLang venv's Python; 0.5.17 from its own dir, first on PYTHONPATH (scripts/install-sglang-cpu.sh).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
CASES = Path(__file__).with_name("test_sglang_models_cases.py")
PATHS = {"0.5.23": [], "0.5.17": [ROOT / ".venv-sglang" / "sglang-0.5.17"]}
ASKED = {"default": [2, 6, 9], "low": [1, 2, 3], "spread": [3, 7, 10], "last": [9, 10, 11]}
NO_LAYER_1_FIRST = {"DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"}  # +1 only when the first id is 1
FAMILIES = {
    "LlamaForCausalLM": ("LlamaModel", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("Qwen3Model", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("Qwen3MoeModel", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("DeepseekV2Model", "DeepseekV3ForCausalLM"),
    "GptOssForCausalLM": ("GptOssModel", "GptOssForCausalLM"),
    "Gemma3ForCausalLM": ("Gemma3TextModel", "Gemma3ForCausalLM"),
    "KimiK25ForConditionalGeneration": ("DeepseekV2Model", "DeepseekV3ForCausalLM"),
}


@pytest.fixture(scope="module", params=list(PATHS))
def results(request, tmp_path_factory) -> dict:
    if not SGLANG_PY.exists():
        pytest.fail(f"{SGLANG_PY.relative_to(ROOT)} is missing: run `make install` (scripts/install-sglang-cpu.sh)")
    missing = [p for p in PATHS[request.param] if not p.exists()]
    if missing:
        pytest.fail(f"{missing[0].relative_to(ROOT)} is missing: run scripts/install-sglang-cpu.sh")
    out = tmp_path_factory.mktemp(f"sglang-{request.param}")
    proc = subprocess.run(
        [str(SGLANG_PY), str(CASES), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*PATHS[request.param], ROOT]))},
    )
    assert proc.returncode == 0, f"cases failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    found = json.loads((out / "results.json").read_text())
    assert found["version"] == request.param
    return found


@pytest.mark.parametrize("family", list(FAMILIES))
def test_capture_list_and_final_states_found_through_wrappers(results, family):
    row = results[family]
    assert (row["layers_owner"], row["logits_owner"]) == FAMILIES[family]
    assert row["num_layers"] == 12
    assert row["model_property_is_language_model"] == (family == "KimiK25ForConditionalGeneration")


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("label", list(ASKED))
def test_asked_layers_are_captured_or_refused(results, family, label):
    """After SGLang's own default call, the plugin's translated call captures exactly what was asked."""
    got = results[family]["asked"][label]
    if label == "low" and family in NO_LAYER_1_FIRST:
        assert "cannot capture layers [1, 2, 3]" in got["refused"] and family in got["refused"]
        return
    assert got["captured"] == ASKED[label]
    assert got["flag_on"]
    if family == "Qwen3MoeForCausalLM":  # per-layer marks from SGLang's first call are cleared
        assert got["marked"] == ASKED[label]


def test_default_rule_never_repeats_a_layer(results):
    rule = {int(k): v for k, v in results["default_rule"].items()}
    assert rule == {4: [1, 2, 3], 5: [2, 3, 4], 6: [3, 4, 5], 7: [2, 3, 4], 8: [2, 4, 5]}
    assert results["small"] == [1, 2, 3]


def test_bad_models_and_ids_refused_at_start(results):
    assert "give ids from 1 to 11" in results["out_of_range"]
    assert results["opaque"].startswith("Opaque: found no module with layers_to_capture")


def test_logits_processor_inside_prefill_graph_refused_where_it_matters(results):
    if results["version"] == "0.5.17":  # final states come from the logits processor's input
        assert "--cuda-graph-backend-prefill disabled" in results["tc_piecewise"]
    else:
        assert results["tc_piecewise"] is None
