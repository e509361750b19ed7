"""The capped series: fixed memory whatever the run's length, the whole run still visible."""

import pytest

from eaglet.shared.records import WorkerRole, WorkerState
from eaglet.shared.runstate import RunState
from eaglet.shared.series import (
    ExtractionPoint,
    TrainPoint,
    extraction_series,
    mean_stage_seconds,
    read_series,
    train_series,
)
from eaglet.shared.statusreport import WorkerStatus


def point(t: float, done: int = 0) -> ExtractionPoint:
    return ExtractionPoint(t=t, done=done, failed=0, total=None, samples_per_s=1.0, tokens_per_s=10.0,
                           bytes_written=done * 100, projected_total_bytes=None, stage_seconds={})  # fmt: skip


def registered(redis, run_id: str = "r1") -> RunState:
    state = RunState(redis, run_id)
    state.create(dataset="/d/data.jsonl", model="tiny")
    return state


def test_a_long_run_stays_within_the_cap_and_covers_the_whole_run(redis):
    registered(redis)
    cap, start, ticks = 64, 1_700_000_000.0, 6_000  # a tick a second: 100 minutes at a 1 s base interval
    series = extraction_series(redis, "r1", interval_s=1.0, cap=cap)
    longest = 0
    for i in range(ticks):
        series.append(start + i, point(start + i, done=i))
        longest = max(longest, redis.llen(series.points_key))
    got = read_series(redis, "r1").extraction
    times = [p.t for p in got.points]
    assert longest <= cap and cap // 2 <= len(times) <= cap
    assert times[0] == start and times[-1] >= start + ticks - 1 - got.interval  # the first point and a recent one
    assert times == sorted(times) and [p.done for p in got.points] == [int(t - start) for t in times]
    # Halved six times (64 -> 6,000 ticks), and the points evenly spread: no gap wider than the interval plus a tick.
    assert got.interval == 128.0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert max(gaps) <= got.interval + 1 and min(gaps) >= got.interval / 4
    assert redis.memory_usage(series.points_key) < 64 * 400  # a point is ~220 bytes of JSON


def test_sparse_reports_widen_the_interval_to_their_spacing(redis):
    """The trainer reports every 10 steps at an interval of 1 step: a halving must thin the writes all the same."""
    registered(redis)
    series = train_series(redis, "r1", cap=16)
    for step in range(10, 2_010, 10):
        series.append(step, TrainPoint(step=step, t=step, loss=1 / step, acc=[0.5, 0.25], tokens_per_s=100.0))
        assert redis.llen(series.points_key) <= 16
    got = read_series(redis, "r1").training
    steps = [p.step for p in got.points]
    assert steps[0] == 10 and steps[-1] >= 2_000 - got.interval and len(steps) >= 8
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    assert got.interval >= 100 and max(gaps) <= got.interval + 10  # 2,000 steps over 8-16 points, evenly
    assert got.points[-1].acc == [0.5, 0.25]


def test_the_final_point_is_written_once_whatever_the_interval(redis):
    registered(redis)
    series = extraction_series(redis, "r1", interval_s=10.0)
    assert series.append(100.0, point(100.0))
    assert not series.append(101.0, point(101.0))  # same 10 s bucket
    assert series.append(102.0, point(102.0, done=5), close=True)
    assert not series.append(103.0, point(103.0), close=True)  # closed: once
    got = read_series(redis, "r1").extraction
    assert got.closed and [p.t for p in got.points] == [100.0, 102.0]
    assert series.append(115.0, point(115.0))  # extraction reopened: the series goes on
    assert not read_series(redis, "r1").extraction.closed


def test_an_unknown_run_has_no_series_and_a_bad_cap_is_refused(redis):
    assert read_series(redis, "nope") is None
    with pytest.raises(ValueError, match="even"):
        extraction_series(redis, "r1", interval_s=1.0, cap=7)


def worker(name: str, run: str, stages: dict, lost: bool = False, role=WorkerRole.extractor) -> WorkerStatus:
    return WorkerStatus(name=name, state=WorkerState.busy, role=role, host="h", pid=1, inference_url="u", run=run,
                        sample="", detail="", seconds_since_heartbeat=0.0, lost=lost, stage_seconds=stages)  # fmt: skip


def test_stage_seconds_are_the_mean_over_the_runs_live_workers():
    workers = [
        worker("a", "r1", {"prefill": 1.0, "check": 0.1, "store": 0.2}),
        worker("b", "", {"prefill": 3.0, "check": 0.3, "store": 0.4}),  # idle between samples: counted
        worker("c", "r2", {"prefill": 100.0, "check": 1, "store": 1}),  # another run's
        worker("d", "r1", {"prefill": 100.0, "check": 1, "store": 1}, lost=True),
        worker("e", "r1", {}),  # has stored nothing yet
    ]
    assert mean_stage_seconds("r1", workers) == pytest.approx({"prefill": 2.0, "check": 0.2, "store": 0.3})
    assert mean_stage_seconds("r3", workers[2:]) == {}
