"""Training on hidden states stored as fp8 (e4m3, per-token scales): the loader decodes them, the drafter learns."""

import json

import torch

from eaglet.services.trainer import data
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.train import train
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import checkpoints_dir, read_metadata, sample_path, samples_dir
from tests.trainer.fixtures import make_run
from tests.trainer.test_train import small


def test_training_on_fp8_files_decreases_the_loss(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "f8", store_dtype="fp8")
    sample = SampleSet(samples_dir(tmp_path, "f8"))[0]
    assert read_metadata(sample_path(tmp_path, "f8", sample.sample_id))["storage"] == "fp8_e4m3"
    final = train(
        redis=redis,
        run_id="f8",
        data_dir=tmp_path,
        target_dir=tiny_model_dir,
        cfg=small(epochs=6, heldout_fraction=0.3),
        env=Dist(),
    )
    rows = [json.loads(x) for x in (checkpoints_dir(tmp_path, "f8") / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
    assert "heldout_loss" in final


def test_fp8_and_model_dtype_files_load_to_nearly_the_same_batch(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path / "a", tiny_model_dir, "a", n=4)
    make_run(redis, tmp_path / "b", tiny_model_dir, "b", n=4, store_dtype="fp8")
    sample_id = SampleSet(samples_dir(tmp_path / "a", "a"))[1].sample_id
    exact = data.load_sample(sample_path(tmp_path / "a", "a", sample_id), torch.float32)
    fp8 = data.load_sample(sample_path(tmp_path / "b", "b", sample_id), torch.float32)
    assert exact["input_ids"].tolist() == fp8["input_ids"].tolist()
    for k in ("hidden_states", "aux_hidden_states"):
        err = (exact[k] - fp8[k]).norm(dim=-1) / exact[k].norm(dim=-1)
        assert float(err.max()) < 0.05, (k, float(err.max()))
