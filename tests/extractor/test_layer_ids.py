"""The run's captured layers come from its dumps: the first dump sets them, a dump of other layers is refused with
its sample named, and the drafter's config.json records the layers the server captured, not ingest's default."""

import json

import httpx
import pytest

from eaglet.services.extractor.extract import Extractor
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.train import train
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.config import Settings
from eaglet.shared.layers import default_layer_ids
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.status import read_run
from eaglet.shared.store import drafter_dir

LAYERS = [1, 2, 4]  # the tiny Llama has 6 layers: ingest's default is [3, 4, 5]


class Server:
    def __init__(self, url: str, dump_dir, engine: ReferenceEngine):
        self.url, self.dump_dir, self.engine = url, dump_dir, engine


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, serve_reference):
    """The reference server on the tiny Llama, over real HTTP, capturing ``LAYERS`` (in this process: its engine's
    layers are set here, the reference server having no setting of its own for them)."""
    engine = ReferenceEngine(tiny_model_dir)
    engine.aux_layer_ids = list(LAYERS)
    dump_dir = tmp_path_factory.mktemp("layers-server") / "dump"
    with serve_reference(engine, dump_dir) as url:
        yield Server(url, dump_dir, engine)


@pytest.fixture
def settings(tmp_path, redis_server, server, tiny_model_dir) -> Settings:
    return Settings(redis_url=redis_server.url, data_dir=tmp_path / "data", dump_dir=server.dump_dir,
                    model=str(tiny_model_dir), inference_url=server.url)  # fmt: skip


def ingest(redis, settings: Settings, tmp_path, run_id: str, n: int) -> None:
    rows = [{"id": f"s{i}", "input_ids": [(7 * i + j) % 500 + 30 for j in range(24 + i)],
             "loss_mask": [0] * 6 + [1] * (18 + i)} for i in range(n)]  # fmt: skip
    path = tmp_path / f"{run_id}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_new_run(redis, settings, run_id, path, RunOptions())


def extractor(settings: Settings, redis) -> Extractor:
    http = httpx.Client(base_url=settings.inference_url, timeout=60)
    return Extractor(redis=redis, http=http, data_dir=settings.data_dir, dump_dir=settings.dump_dir, worker="t",
                     backoff_s=(0.01,))  # fmt: skip


def test_the_drafter_records_the_layers_the_server_captured(redis, settings, server, tmp_path):
    n = 8
    ingest(redis, settings, tmp_path, "caught", n)
    state = RunState(redis, "caught")
    assert state.meta().aux_layer_ids == default_layer_ids(6) != LAYERS  # ingest's guess, not what was captured
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


def test_the_first_dump_sets_the_layers_once(redis):
    state = RunState(redis, "race")
    assert state.claim_captured_layers([1, 2, 4]) == [1, 2, 4]
    assert state.claim_captured_layers([2, 3, 5]) == [1, 2, 4]
    assert state.meta().captured_layers == [1, 2, 4]
