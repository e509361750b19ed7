"""A run's options: one shape from the request or the command line to the ingest."""

import json

import pytest

from eaglet.shared.runoptions import RunOptions


def test_run_options_round_trip_and_check_their_limits():
    options = RunOptions(max_tokens=512, overlong="truncate", limit=3)
    assert RunOptions(**json.loads(options.to_json())) == options
    assert RunOptions(**{}) == RunOptions()
    for bad in ({"max_tokens": 1}, {"overlong": "chop"}, {"limit": 0}):
        with pytest.raises(ValueError):
            RunOptions(**bad)


def test_a_storage_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="store_dtype='fp4'"):
        RunOptions(store_dtype="fp4")


def test_the_method_and_its_layers_are_checked_and_resolved_for_the_target():
    from pydantic import TypeAdapter, ValidationError

    assert RunOptions().layer_ids(30) == [2, 15, 27]  # EAGLE-3's default
    assert RunOptions(method="dflash").layer_ids(30) == [2, 9, 15, 21, 28]  # DFlash's five, as SGLang picks them
    assert RunOptions(method="dflash", aux_layer_ids=[1, 9]).layer_ids(30) == [1, 9]
    dflash = RunOptions(method="dflash", aux_layer_ids=[2, 9, 15, 21, 28])
    assert RunOptions.from_json(dflash.to_json()) == dflash
    with pytest.raises(ValueError, match=r"aux_layer_ids=\[1, 9\] \(method eagle3\): give 3 layer ids, not 2"):
        RunOptions(aux_layer_ids=[1, 9])
    with pytest.raises(ValueError, match="increasing order"):
        RunOptions(method="dflash", aux_layer_ids=[9, 1])
    with pytest.raises(ValueError, match="method='medusa'"):
        RunOptions(method="medusa")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"aux_layer_ids \[2, 15, 31\] \(method eagle3\): the model has 30 layers"):
        RunOptions(aux_layer_ids=[2, 15, 31]).layer_ids(30)
    body = TypeAdapter(RunOptions).validate_python({"method": "dflash", "aux_layer_ids": [1, 9, 17, 25]})
    assert body.method == "dflash" and body.aux_layer_ids == [1, 9, 17, 25]  # what POST /runs options take
    with pytest.raises(ValidationError, match="give 3 layer ids"):
        TypeAdapter(RunOptions).validate_python({"aux_layer_ids": [1, 9]})
