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
