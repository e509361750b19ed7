"""The target's tensors read alone from its safetensors files: only the parts asked for, each tensor once, and a
missing one named with the folder."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglet.shared import targettensors
from eaglet.shared.targettensors import TargetTensorsError, load_target_tensors

V, H = 48, 16


def write_target(folder, *, tied: bool) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        "model.embed_tokens.weight": torch.randn(V, H),
        "model.norm.weight": torch.rand(H),
        "model.layers.0.input_layernorm.weight": torch.rand(H),
    }
    if not tied:
        tensors["lm_head.weight"] = torch.randn(V, H)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(f'{{"model_type": "llama", "tie_word_embeddings": {str(tied).lower()}}}')
    return tensors


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The tensor names read from the files (a spy around safetensors' own reader)."""
    names: list[str] = []

    class Spy:
        def __init__(self, path: str, framework: str):
            self.file = safe_open(path, framework=framework)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            names.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(targettensors, "safe_open", Spy)
    return names


def test_the_head_alone_reads_the_head_alone(tmp_path, reads):
    stored = write_target(tmp_path, tied=False)
    out = load_target_tensors(tmp_path, ("lm_head",))
    assert list(out) == ["lm_head"] and torch.equal(out["lm_head"], stored["lm_head.weight"])
    assert reads == ["lm_head.weight"]


def test_a_tied_head_is_the_embedding_read_once(tmp_path, reads):
    stored = write_target(tmp_path, tied=True)
    out = load_target_tensors(tmp_path)
    assert out["lm_head"] is out["embed"] and torch.equal(out["embed"], stored["model.embed_tokens.weight"])
    assert torch.equal(out["norm"], stored["model.norm.weight"])  # the model's final norm, not a layer's
    assert sorted(reads) == ["model.embed_tokens.weight", "model.norm.weight"]


def test_an_untied_target_without_a_head_is_refused_naming_the_folder(tmp_path):
    write_target(tmp_path / "headless", tied=True)
    (tmp_path / "headless" / "config.json").write_text('{"model_type": "llama", "tie_word_embeddings": false}')
    with pytest.raises(TargetTensorsError, match=r"headless: no lm_head.weight"):
        load_target_tensors(tmp_path / "headless", ("lm_head",))
    assert list(load_target_tensors(tmp_path / "headless", ("embed",))) == ["embed"]  # what is there still reads


def test_an_unknown_part_is_refused():
    with pytest.raises(ValueError, match=r"unknown parts \['head'\]"):
        load_target_tensors("anywhere", ("head",))
