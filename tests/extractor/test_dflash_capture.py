"""DFlash's capture end to end on the bundled model: the reference server in its own process captures DFlash's five
layers (``EAGLET_AUX_LAYER_IDS``), a ``method="dflash"`` run is ingested, a real worker process extracts it into the
default layout (top-k + 4-bit aux states), and the stored aux states decode to [T, 5H]: what the engine captures,
within 4 bits' error."""

import json
import time

import pytest
import torch

from eaglet.cli.stack import LocalStack
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared.config import Settings
from eaglet.shared.layers import DFLASH_DEFAULT_DRAFT_LAYERS, dflash_layer_ids
from eaglet.shared.layout import DEFAULT_LAYOUT, Layout
from eaglet.shared.redisserver import free_port
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import decode_states, open_sample, read_metadata, sample_path, samples_dir

LAYERS = dflash_layer_ids(30, DFLASH_DEFAULT_DRAFT_LAYERS)  # SmolLM2's 30 layers: [2, 9, 15, 21, 28]


@pytest.fixture
def stack(tmp_path, redis_server, smollm2_dir):
    port = free_port()
    settings = Settings(redis_url=redis_server.url, data_dir=tmp_path / "data", dump_dir=tmp_path / "dump",
                        model=str(smollm2_dir), inference_url=f"http://127.0.0.1:{port}")  # fmt: skip
    env = {f"EAGLET_{k.upper()}": str(getattr(settings, k)) for k in ("redis_url", "data_dir", "dump_dir", "model")}
    env |= {"EAGLET_INFERENCE_URL": settings.inference_url, "EAGLET_AUX_LAYER_IDS": ",".join(map(str, LAYERS))}
    with LocalStack(tmp_path / "logs", env=env) as processes:
        processes.start("inference", "eaglet.services.inference.main", "--port", str(port))
        processes.wait_http("inference", f"{settings.inference_url}/health", timeout=300)
        processes.start("worker", "eaglet.services.extractor.worker", "--name", "w0")
        yield settings


def test_a_dflash_run_stores_the_five_layers_the_server_captures(redis, stack, tmp_path, smollm2_dir):
    rows = [{"id": f"s{i}", "input_ids": [(37 * i + 11 * j) % 4000 + 100 for j in range(20 + 7 * i)],
             "loss_mask": [0] * 8 + [1] * (12 + 7 * i)} for i in range(4)]  # fmt: skip
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ingest_new_run(redis, stack, "dflash", tmp_path / "d.jsonl", RunOptions(method="dflash"))
    state = RunState(redis, "dflash")
    assert state.meta().aux_layer_ids == LAYERS  # DFlash's default for the target, fixed at ingest
    deadline = time.monotonic() + 300
    while not state.extraction_complete():
        assert time.monotonic() < deadline, f"not complete: {state.counts()}"
        time.sleep(0.2)
    assert state.counts().done == len(rows) and state.meta().captured_layers == LAYERS
    engine = ReferenceEngine(smollm2_dir, device="cpu", aux_layer_ids=LAYERS)
    samples = SampleSet(samples_dir(stack.data_dir, "dflash"))
    for sample in (samples[i] for i in range(len(samples))):
        path = sample_path(stack.data_dir, "dflash", sample.sample_id)
        metadata = read_metadata(path)
        assert Layout.from_metadata(metadata) == DEFAULT_LAYOUT and json.loads(metadata["aux_layer_ids"]) == LAYERS
        aux = decode_states(open_sample(path), metadata, torch.float32)["aux_hidden_states"]
        (captured,) = engine.prefill([sample.input_ids.tolist()])
        expected = captured.states["aux_hidden_states"]  # [T, 5H], at full width
        assert aux.shape == expected.shape == (len(sample.input_ids), 5 * engine.hidden_size)
        for k in range(len(LAYERS)):  # each layer within 4 bits' error (tests/shared/test_layouts.py: 0.12)
            block = slice(k * engine.hidden_size, (k + 1) * engine.hidden_size)
            err = (aux[:, block] - expected[:, block]).norm() / expected[:, block].norm()
            assert float(err) < 0.12, (sample.sample_id, LAYERS[k], float(err))
