"""Heartbeats as the workers write them, read back as records."""

import time

from eaglet.shared import heartbeats, keys
from eaglet.shared.records import WorkerState


def test_beat_is_read_back(redis):
    before = time.time()
    heartbeats.beat(
        redis,
        "w1",
        state=WorkerState.busy,
        host="h",
        pid=3,
        inference_url="http://inf:1",
        run="r",
        sample="s7",
        disk_free=10,
        disk_total=20,
        instance="i1",
        stage_seconds={"prefill": 0.2},
    )
    beat = heartbeats.workers(redis)["w1"]
    assert (beat.worker, beat.state, beat.run, beat.sample, beat.instance) == ("w1", "busy", "r", "s7", "i1")
    assert (beat.disk_free, beat.disk_total, beat.stage_seconds) == (10, 20, {"prefill": 0.2})
    assert before <= beat.ts <= time.time()


def test_a_new_beat_replaces_the_old_and_forget_removes_it(redis):
    heartbeats.beat(redis, "w1", state=WorkerState.busy, host="h", pid=3, inference_url="")
    heartbeats.beat(redis, "w1", state=WorkerState.idle, host="h", pid=3, inference_url="")
    assert redis.hlen(keys.WORKERS) == 1 and heartbeats.workers(redis)["w1"].state == WorkerState.idle
    heartbeats.forget(redis, "w1")
    assert heartbeats.workers(redis) == {}


def test_inference_report(redis):
    heartbeats.report_inference(redis, "http://inf:1", ok=False, detail="connection refused")
    report = heartbeats.inference_servers(redis)["http://inf:1"]
    assert (report.ok, report.detail, report.model) == (False, "connection refused", "")
