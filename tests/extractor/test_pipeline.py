"""The extraction spine end to end: real Redis, real server, real RQ workers in their own processes."""

import json
import time

import httpx
import pytest
import torch
from redis import Redis

from eaglet.cli.stack import LocalStack
from eaglet.services.extractor.extract import Extractor
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared import heartbeats, keys
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.config import Settings
from eaglet.shared.dumpwriter import DEFAULT_CAP_BYTES
from eaglet.shared.jobqueue import run_queue
from eaglet.shared.runoptions import EVERY_STATE, RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.status import read_status
from eaglet.shared.store import (
    FP8_STORAGE,
    encode_fp8,
    open_sample,
    read_metadata,
    sample_is_complete,
    sample_path,
    samples_dir,
)


def write_dataset(path, n: int) -> None:
    lines = []
    for i in range(n):
        if i % 2:
            ids = [(13 * i + j) % 800 + 20 for j in range(8 + i % 23)]
            lines.append({"id": f"tok-{i}", "input_ids": ids, "loss_mask": [0] * 4 + [1] * (len(ids) - 4)})
        else:
            turns = [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": "Answer " * (i % 7 + 1)},
            ]
            lines.append({"id": f"conv-{i}", "messages": turns})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture
def settings(tmp_path, redis_server, reference_server):
    return Settings(
        redis_url=redis_server.url,
        data_dir=tmp_path / "data",
        dump_dir=reference_server.dump_dir,
        model=str(reference_server.model_dir),
        inference_url=reference_server.url,
    )


def env_of(settings: Settings) -> dict[str, str]:
    fields = ("redis_url", "data_dir", "dump_dir", "model", "inference_url")
    return {f"EAGLET_{name.upper()}": str(getattr(settings, name)) for name in fields}


def test_two_workers_extract_every_sample_exactly_once(redis, settings, tmp_path):
    n = 40
    write_dataset(tmp_path / "data.jsonl", n)
    pubsub = redis.pubsub()
    pubsub.subscribe(keys.EVENTS)
    with LocalStack(tmp_path / "logs", env=env_of(settings)) as stack:
        for i in range(2):
            stack.start(f"worker-{i}", "eaglet.services.extractor.worker", "--name", f"w{i}")
        ingest_new_run(redis, settings, "e2e", tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
        state = RunState(redis, "e2e")
        deadline = time.monotonic() + 180
        while not state.extraction_complete():
            assert time.monotonic() < deadline, f"not complete: {state.counts()}"
            time.sleep(0.2)
        workers_seen = {b.worker for b in heartbeats.workers(redis).values()}
        # Where each worker's time went, as /status shows it: every stage of a stored sample, prefill the longest.
        deadline = time.monotonic() + 30
        while not all((report := read_status(redis, config=StatusConfig())).cluster.workers[i].stage_seconds
                      for i in range(2)):  # fmt: skip
            assert time.monotonic() < deadline, "no stage times in the heartbeats"
            time.sleep(0.2)
    [server] = report.cluster.inference
    assert server.dump_cap_bytes == DEFAULT_CAP_BYTES and 0 <= server.dump_backpressure <= 1, server
    for worker in report.cluster.workers:
        assert set(worker.stage_seconds) == {"prefill", "dump_wait", "check", "store"}, worker.stage_seconds
        assert worker.stage_seconds["prefill"] > 0 and min(worker.stage_seconds.values()) >= 0
    counts = state.counts()
    assert (counts.done, counts.failed) == (n, 0), counts
    samples = SampleSet(samples_dir(settings.data_dir, "e2e"))
    stored_bytes = 0
    for i in range(n):
        sample = samples[i]
        path = sample_path(settings.data_dir, "e2e", sample.sample_id)
        assert sample_is_complete(path, len(sample.input_ids))
        stored = open_sample(path)
        assert stored["input_ids"].tolist() == sample.input_ids.tolist()
        assert stored["loss_mask"].tolist() == sample.loss_mask.tolist()
        stored_bytes += path.stat().st_size
    assert counts.bytes == stored_bytes and counts.tokens == len(samples._ids)
    assert workers_seen == {"w0", "w1"}
    assert not [p for p in settings.dump_dir.iterdir() if ":e2e:" in p.name]  # every dump taken and deleted
    assert not list((settings.data_dir / "runs" / "e2e" / "hidden").rglob(".*.tmp"))
    events = []
    while (message := pubsub.get_message(timeout=0.5)) is not None:
        if message["type"] == "message":
            events.append(json.loads(message["data"]))
    assert [e for e in events if e["run"] == "e2e" and e["event"] == "extraction_complete"].__len__() == 1
    assert run_queue(redis, "e2e").count == 0


def extractor_for(settings: Settings, redis: Redis, **kw) -> Extractor:
    return Extractor(
        redis=redis,
        http=httpx.Client(base_url=settings.inference_url, timeout=60),
        data_dir=settings.data_dir,
        dump_dir=settings.dump_dir,
        worker="test",
        **kw,
    )


def test_a_stored_sample_is_never_extracted_twice(redis, settings, tmp_path):
    write_dataset(tmp_path / "data.jsonl", 3)
    ingest_new_run(redis, settings, "idem", tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
    extractor = extractor_for(settings, redis)
    assert extractor.extract("idem", 1).startswith("done (prefill ")
    assert extractor.extract("idem", 1) == "already done"
    state = RunState(redis, "idem")
    redis.setbit(state.keys.done, 1, 0)  # the mark lost after the file was stored (a crash in between)
    redis.hincrby(state.keys.counts, "done", -1)
    offline = extractor_for(settings.model_copy(update={"inference_url": "http://127.0.0.1:9"}), redis)
    assert offline.extract("idem", 1) == "found stored"  # no request needed: the server is not even there
    assert state.counts().done == 1 and state.is_done(1)


def test_hidden_states_stored_are_the_models(redis, settings, tmp_path):
    write_dataset(tmp_path / "data.jsonl", 2)
    ingest_new_run(redis, settings, "exact", tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
    extractor_for(settings, redis).extract("exact", 1)
    sample = SampleSet(samples_dir(settings.data_dir, "exact"))[1]
    stored = open_sample(sample_path(settings.data_dir, "exact", sample.sample_id))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(settings.model).eval()
    with torch.inference_mode():
        out = model.model(input_ids=torch.from_numpy(sample.input_ids).long()[None])
    torch.testing.assert_close(stored["hidden_states"], out.last_hidden_state[0], atol=1e-5, rtol=1e-4)


def test_an_fp8_run_has_the_server_encode_and_stores_its_bits_as_they_came(redis, settings, tmp_path):
    """The run stores fp8 (whatever a worker's own setting), so the worker asks for fp8, the reference server
    encodes before the copy to the host, the store keeps the bytes: the sample equals the workers' own encoder
    applied to a full-width extraction of the same prompt."""
    write_dataset(tmp_path / "data.jsonl", 2)
    ingest_new_run(redis, settings, "wide", tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
    ingest_new_run(redis, settings, "narrow", tmp_path / "data.jsonl", RunOptions(**EVERY_STATE, store_dtype="fp8"))
    extractor_for(settings, redis).extract("wide", 1)
    extractor_for(settings, redis, store_dtype="bf16").extract("narrow", 1)  # the run's storage, not the worker's
    assert RunState(redis, "wide").meta().options.store_dtype == settings.store_dtype  # fixed at ingest
    sample = SampleSet(samples_dir(settings.data_dir, "wide"))[1]
    wide = open_sample(sample_path(settings.data_dir, "wide", sample.sample_id))
    narrow_path = sample_path(settings.data_dir, "narrow", sample.sample_id)
    narrow = open_sample(narrow_path)
    assert read_metadata(narrow_path)["storage"] == FP8_STORAGE
    for name in ("hidden_states", "aux_hidden_states"):
        values, scale = encode_fp8(wide[name])
        assert torch.equal(narrow[name].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(narrow[f"{name}_scale"], scale)


def test_unreachable_server_backs_off_then_records_the_reason(redis, settings, tmp_path):
    write_dataset(tmp_path / "data.jsonl", 1)
    ingest_new_run(redis, settings, "down", tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
    offline = settings.model_copy(update={"inference_url": "http://127.0.0.1:9"})
    extractor = extractor_for(offline, redis, backoff_s=(0.05,), max_transient_s=0.3)
    assert extractor.extract("down", 0) == "failed"
    state = RunState(redis, "down")
    [failure] = [json.loads(v) for v in redis.hvals(state.keys.failures)]
    assert failure["sample_id"] == "conv-0" and "unreachable" in failure["reason"]
    assert state.counts().retries >= 3 and state.extraction_complete()
