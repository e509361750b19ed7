"""Broken dumps from a real (broken) inference server: each is rejected with its reason, retried, never stored."""

import json
import logging

import pytest
import torch

from eaglet.cli.stack import LocalStack
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared.runoptions import EVERY_STATE, RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import open_sample, sample_path, samples_dir
from tests.reliability.faulty_server import FAULTS, FaultyServer
from tests.reliability.helpers import check_outcome, env_of, free_port, wait_for, write_dataset

log = logging.getLogger(__name__)
pytestmark = pytest.mark.slow
KINDS = sorted(FAULTS)
ALWAYS_BAD = "b-2"  # every attempt of this sample gets a dump with a NaN row


def plan(sample_id: str, attempt: int) -> str | None:
    """Sample i's first attempt gets fault i (mod the kinds), its second fault i+1; the third is good."""
    if sample_id == ALWAYS_BAD:
        return "nan"
    i = int(sample_id.split("-")[1])
    return KINDS[(i + attempt - 1) % len(KINDS)] if attempt <= 2 else None


def test_broken_dumps_are_rejected_retried_and_never_stored(redis, settings, tmp_path, tiny_model_dir, events):
    engine = ReferenceEngine(tiny_model_dir, device="cpu")
    server = FaultyServer(engine, tmp_path / "dump", plan)
    port = free_port()
    stop = server.serve(port)
    n, run_id = 2 * len(KINDS), "dumps"
    settings = settings.model_copy(
        update={"inference_url": f"http://127.0.0.1:{port}", "dump_dir": tmp_path / "dump", "dump_wait_s": 1}
    )
    write_dataset(tmp_path / "data.jsonl", n, prefix="b")
    try:
        with LocalStack(tmp_path / "logs", env=env_of(settings)) as stack:
            for i in range(2):
                stack.start(f"w{i}", "eaglet.services.extractor.worker", "--name", f"w{i}")
            ingest_new_run(redis, settings, run_id, tmp_path / "data.jsonl", RunOptions(**EVERY_STATE))
            state = RunState(redis, run_id)
            wait_for("the run to complete", state.extraction_complete, 180)
    finally:
        stop()
    counts = check_outcome(redis, settings, run_id, n)
    assert (counts.done, counts.failed) == (n - 1, 1), counts
    # The failed sample: its reason, and no file.
    failure = json.loads(redis.hget(state.keys.failures, ALWAYS_BAD.split("-")[1]))
    assert "NaN/Inf" in failure["reason"], failure
    # Every fault was rejected with its own reason.
    reasons = [json.loads(e)["reason"] for e in redis.lrange(state.keys.errors, 0, -1)]
    for kind, why in FAULTS.items():
        assert any(why in r for r in reasons), f"no rejection saying {why!r} for {kind}: {reasons[:5]}"
    # What was stored is the model's own states, never a broken dump's.
    samples = SampleSet(samples_dir(settings.data_dir, run_id))
    for i in range(n):
        sample = samples[i]
        if sample.sample_id == ALWAYS_BAD:
            continue
        stored = open_sample(sample_path(settings.data_dir, run_id, sample.sample_id))
        [expected] = engine.prefill([sample.input_ids.tolist()])
        torch.testing.assert_close(stored["hidden_states"], expected.states["hidden_states"], rtol=0, atol=0)
        torch.testing.assert_close(stored["aux_hidden_states"], expected.states["aux_hidden_states"], rtol=0, atol=0)
    leftover = [p.name for p in (tmp_path / "dump").iterdir()]
    assert not leftover, f"dumps left behind: {leftover}"
    injected = sum(server.injected.values())
    log.warning("bad dumps: %d injected (%s); %d rejections recorded; done %d, failed %d", injected,
                dict(sorted(server.injected.items())), len(reasons), counts.done, counts.failed)  # fmt: skip
    assert events.count(run_id, "extraction_complete") == 1
