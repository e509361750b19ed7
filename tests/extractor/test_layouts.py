"""Each storage layout extracted through the real reference server: what the run's layout asks for is what is
stored, equal to the store's own encoders applied to a full-width extraction of the same prompt; a k the server
cannot serve is refused with the reason."""

from pathlib import Path

import httpx
import pytest
import torch

from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared.fp4 import encode_fp4
from eaglet.shared.layout import Layout
from eaglet.shared.runoptions import EVERY_STATE, RunOptions
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import (
    loss_rows,
    open_sample,
    read_metadata,
    sample_is_complete,
    sample_path,
    samples_dir,
)
from eaglet.shared.targettensors import load_target_tensors
from eaglet.shared.topk import encode_topk
from tests.extractor.test_pipeline import extractor_for, settings, write_dataset  # noqa: F401 (a fixture)


@pytest.mark.parametrize(
    "options",
    [
        dict(store_final="loss", store_aux="full"),
        dict(store_final="topk", store_topk=8, store_aux="full"),
        dict(store_final="topk", store_topk=8, store_aux="full", store_topk_rows="all"),
        dict(store_final="all", store_aux="fp4"),
        dict(store_final="topk", store_topk=8, store_aux="fp4", store_dtype="fp8"),
        dict(),
    ],  # fmt: skip
    ids=["loss", "top8", "top8@all", "fp4", "top8+fp4-fp8", "default"],
)
def test_each_layout_stores_what_the_run_asks_for(redis, settings, tmp_path, options):  # noqa: F811
    write_dataset(tmp_path / "data.jsonl", 2)
    ingest_new_run(redis, settings, "wide", tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
    ingest_new_run(redis, settings, "narrow", tmp_path / "data.jsonl", RunOptions(**options))
    for run in ("wide", "narrow"):
        assert extractor_for(settings, redis).extract(run, 1).startswith("done"), run
    layout = RunOptions(**options).layout()
    sample = SampleSet(samples_dir(settings.data_dir, "narrow"))[1]
    wide = open_sample(sample_path(settings.data_dir, "wide", sample.sample_id))
    path = sample_path(settings.data_dir, "narrow", sample.sample_id)
    narrow, metadata = open_sample(path), read_metadata(path)
    assert Layout.from_metadata(metadata) == layout
    rows = loss_rows(torch.from_numpy(sample.loss_mask))
    assert sample_is_complete(path, len(sample.input_ids), len(rows))
    if layout.final == "loss":
        assert torch.equal(narrow["hidden_states"], wide["hidden_states"][rows])
    if layout.final == "topk":
        assert "hidden_states" not in narrow
        head = load_target_tensors(Path(settings.model))["lm_head"]
        # the server scored the loss positions only (the default), or every one
        scored = wide["hidden_states"][rows] if layout.topk_rows == "loss" else wide["hidden_states"]
        ids, logp = encode_topk(scored, head, layout.topk)
        assert torch.equal(narrow["topk_ids"], ids)
        torch.testing.assert_close(narrow["topk_logp"], logp, atol=2e-3, rtol=1e-3)
    if layout.aux == "fp4":
        codes, scales = encode_fp4(wide["aux_hidden_states"])
        assert torch.equal(narrow["aux_hidden_states_e2m1"], codes)
        assert torch.equal(narrow["aux_hidden_states_block_scale"], scales)


def test_the_server_refuses_a_k_it_cannot_serve_with_the_reason(settings):  # noqa: F811
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "custom_params": {"eaglet_topk": 10**6}}}
    response = httpx.post(f"{settings.inference_url}/generate", json=body, timeout=30)
    assert response.status_code == 400
    assert "custom_params.eaglet_topk=1000000: top-k k=1000000: give 1 to 1024" in response.text
