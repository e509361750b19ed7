"""The reference engine captures the layers it is configured with, any number of them (``EAGLET_AUX_LAYER_IDS``),
and refuses to start on layers the model cannot give."""

import pytest
import torch
from pydantic import ValidationError

from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.inference.main import InferenceSettings
from eaglet.shared.layers import default_layer_ids


def test_the_setting_is_comma_separated_and_unset_is_none(monkeypatch):
    monkeypatch.setenv("EAGLET_AUX_LAYER_IDS", "1,2,3,4,5")
    assert InferenceSettings().aux_layer_ids == [1, 2, 3, 4, 5]
    monkeypatch.setenv("EAGLET_AUX_LAYER_IDS", "")
    assert InferenceSettings().aux_layer_ids is None
    monkeypatch.setenv("EAGLET_AUX_LAYER_IDS", "1;2")
    with pytest.raises(ValidationError, match="EAGLET_AUX_LAYER_IDS='1;2': give comma-separated layer ids"):
        InferenceSettings()


def test_the_engine_captures_five_layers_in_order(tiny_model_dir, one_torch_thread):
    engine = ReferenceEngine(tiny_model_dir, device="cpu", aux_layer_ids=[1, 2, 3, 4, 5])
    ids = list(range(40, 57))
    (prefill,) = engine.prefill([ids])
    with torch.inference_mode():
        out = engine.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i][0] for i in (1, 2, 3, 4, 5)], dim=-1)  # [T, 5H]
    assert prefill.states["aux_hidden_states"].shape == (len(ids), 5 * engine.hidden_size)
    torch.testing.assert_close(prefill.states["aux_hidden_states"], expected)
    assert ReferenceEngine(tiny_model_dir, device="cpu").aux_layer_ids == default_layer_ids(6)


@pytest.mark.parametrize(
    ("ids", "problem"),
    [([1, 6], "give ids from 1 to 5"), ([3, 2], "increasing order"), ([0, 2], "start at 1")],
)
def test_the_engine_refuses_layers_the_model_cannot_give(tiny_model_dir, ids, problem):
    with pytest.raises(ValueError, match=f"EAGLET_AUX_LAYER_IDS={','.join(map(str, ids))} .*{problem}"):
        ReferenceEngine(tiny_model_dir, device="cpu", aux_layer_ids=ids)
