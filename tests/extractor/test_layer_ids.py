"""The run names the layers it stores, the worker takes them out of what the server captures: a dump of more layers
is cut to the run's, one without them fails its sample naming the layers and the server setting, the first dump
stored sets the run's captured layers, and the drafter's config.json records them."""

import json

import httpx
import pytest
import torch

from eaglet.services.extractor.extract import Extractor
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.train import train
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.config import Settings
from eaglet.shared.fp4 import encode_fp4
from eaglet.shared.layers import default_layer_ids
from eaglet.shared.runoptions import EVERY_STATE, RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.status import read_run
from eaglet.shared.store import FP4_AUX_TENSORS, decode_states, drafter_dir, open_sample, read_metadata, sample_path

LAYERS = [1, 2, 4]  # the tiny Llama has 6 layers: ingest's default is [3, 4, 5]


class Server:
    def __init__(self, url: str, dump_dir, engine: ReferenceEngine):
        self.url, self.dump_dir, self.engine = url, dump_dir, engine


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, serve_reference):
    """The reference server on the tiny Llama, over real HTTP, capturing ``LAYERS`` (in this process: a test may
    change the layers its engine captures, as a restarted server with another ``EAGLET_AUX_LAYER_IDS``)."""
    engine = ReferenceEngine(tiny_model_dir, aux_layer_ids=LAYERS)
    dump_dir = tmp_path_factory.mktemp("layers-server") / "dump"
    with serve_reference(engine, dump_dir) as url:
        yield Server(url, dump_dir, engine)


@pytest.fixture
def settings(tmp_path, redis_server, server, tiny_model_dir) -> Settings:
    return Settings(redis_url=redis_server.url, data_dir=tmp_path / "data", dump_dir=server.dump_dir,
                    model=str(tiny_model_dir), inference_url=server.url)  # fmt: skip


def ingest(redis, settings: Settings, tmp_path, run_id: str, n: int, options: RunOptions | None = None) -> None:
    rows = [{"id": f"s{i}", "input_ids": [(7 * i + j) % 500 + 30 for j in range(24 + i)],
             "loss_mask": [0] * 6 + [1] * (18 + i)} for i in range(n)]  # fmt: skip
    path = tmp_path / f"{run_id}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_new_run(redis, settings, run_id, path, options or RunOptions(aux_layer_ids=LAYERS))


def extractor(settings: Settings, redis) -> Extractor:
    http = httpx.Client(base_url=settings.inference_url, timeout=60)
    return Extractor(redis=redis, http=http, data_dir=settings.data_dir, dump_dir=settings.dump_dir, worker="t",
                     backoff_s=(0.01,))  # fmt: skip


def test_the_drafter_records_the_layers_the_server_captured(redis, settings, server, tmp_path):
    n = 8
    ingest(redis, settings, tmp_path, "caught", n)
    state = RunState(redis, "caught")
    assert state.meta().aux_layer_ids == LAYERS == state.meta().options.aux_layer_ids
    work = extractor(settings, redis)
    for i in range(n):
        assert work.extract("caught", i).startswith("done"), i
    assert state.meta().captured_layers == LAYERS
    cfg = TrainConfig(ttt_steps=2, draft_vocab_size=256, tokens_per_batch=128, max_steps=1, loader_workers=0,
                      heldout_fraction=0.0)  # fmt: skip
    train(redis=redis, run_id="caught", data_dir=settings.data_dir, target_dir=server.engine.model_dir, cfg=cfg,
          env=Dist())  # fmt: skip
    config = json.loads((drafter_dir(settings.data_dir, "caught") / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYERS  # vLLM: the input of layer i
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in LAYERS]  # SGLang adds 1
    assert config["eaglet"]["aux_layer_ids_captured"] == LAYERS


def test_a_dump_of_other_layers_is_refused_naming_its_sample(redis, settings, server, tmp_path):
    ingest(redis, settings, tmp_path, "mixed", 2)
    work = extractor(settings, redis)
    assert work.extract("mixed", 0).startswith("done")
    state = RunState(redis, "mixed")
    other = [2, 3, 5]
    server.engine.aux_layer_ids = other  # the server restarted with other capture layers
    try:
        assert work.extract("mixed", 1) == "failed"
    finally:
        server.engine.aux_layer_ids = list(LAYERS)
    assert state.meta().captured_layers == LAYERS  # the first dump's stand
    assert state.counts().done == 1 and state.counts().failed == 1
    assert state.counts().retries == 0  # refused at once: a retry on that server captures the same
    (error,) = read_run(redis, "mixed", config=StatusConfig()).run.extraction.last_errors
    assert error.final and error.sample_id == "s1"
    assert "sample s1" in error.reason and str(other) in error.reason and str(LAYERS) in error.reason


def test_a_run_of_layers_the_server_does_not_capture_fails_naming_them_and_the_setting(
    redis, settings, server, tmp_path
):
    ingest(redis, settings, tmp_path, "default", 1, RunOptions())  # EAGLE-3's default for 6 layers: [3, 4, 5]
    state = RunState(redis, "default")
    assert state.meta().aux_layer_ids == default_layer_ids(6) == [3, 4, 5]
    assert extractor(settings, redis).extract("default", 0) == "failed"
    assert state.counts().failed == 1 and state.counts().retries == 0  # the same server gives the same every time
    (error,) = read_run(redis, "default", config=StatusConfig()).run.extraction.last_errors
    assert error.final and error.sample_id == "s0"
    assert "the run stores layers [3, 4, 5]" in error.reason and f"holds layers {LAYERS}" in error.reason
    assert "without [3, 5]" in error.reason and "EAGLET_AUX_LAYER_IDS=1,2,3,4,5" in error.reason


@pytest.mark.parametrize("layout", [EVERY_STATE, {}], ids=["full", "default"])
def test_a_run_stores_its_layers_out_of_a_server_capturing_more(redis, settings, server, tmp_path, layout):
    """A server capturing five layers (EAGLE-3's and more): an EAGLE-3 run stores its three, in its order, exactly
    the states of those layers (and in 4 bits, exactly their codes: blocks never span two layers)."""
    run = f"subset-{len(layout)}"
    ingest(redis, settings, tmp_path, run, 2, RunOptions(**layout))
    server.engine.aux_layer_ids = [1, 2, 3, 4, 5]
    try:
        work = extractor(settings, redis)
        assert all(work.extract(run, i).startswith("done") for i in range(2))
    finally:
        server.engine.aux_layer_ids = list(LAYERS)
    assert RunState(redis, run).meta().captured_layers == [3, 4, 5]
    sample = work.sample_set(run)[1]
    path = sample_path(settings.data_dir, run, sample.sample_id)
    assert json.loads(read_metadata(path)["aux_layer_ids"]) == [3, 4, 5]
    with torch.inference_mode():
        out = server.engine.model.model(input_ids=torch.tensor([sample.input_ids.tolist()]), output_hidden_states=True)
    direct = torch.cat([out.hidden_states[i][0] for i in (3, 4, 5)], dim=-1)  # [T, 3H]
    stored = open_sample(path)
    if layout:
        torch.testing.assert_close(stored["aux_hidden_states"], direct, atol=1e-5, rtol=1e-4)
    else:
        codes, scales = encode_fp4(direct)
        assert (stored[FP4_AUX_TENSORS[0]] != codes).float().mean() < 0.01  # a rounding tie at most, here and there
        torch.testing.assert_close(stored[FP4_AUX_TENSORS[1]].float(), scales.float(), atol=1e-2, rtol=1e-2)
        aux = decode_states(stored, read_metadata(path), torch.float32)["aux_hidden_states"]
        assert aux.shape == direct.shape and float((aux - direct).norm() / direct.norm()) < 0.12


def test_the_first_dump_sets_the_layers_once(redis):
    state = RunState(redis, "race")
    assert state.claim_captured_layers([1, 2, 4]) == [1, 2, 4]
    assert state.claim_captured_layers([2, 3, 5]) == [1, 2, 4]
    assert state.meta().captured_layers == [1, 2, 4]
