"""Extraction's ETA on a run whose sample lengths are deliberately uneven (blocks of ~100-token and ~1,000-token
samples): the tokens left over the recent token rate stays within +-10 % of the time that was really left, once
10 % of the run is done, where the samples left over the sample rate is off by far more.

The run is real run state in a real Redis, marked through ``RunState`` as workers mark it; only the clock is the
test's: each sample takes the time a server that prefills a fixed number of tokens a second (plus a small cost per
request) would take, so the true end of the run is known in advance and every ETA can be checked against it.
"""

import random
import statistics

import pytest

from eaglet.shared import runstate as runstate_module
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.runstate import RunState
from eaglet.shared.status import read_run

TOKENS_PER_S = 400.0
PER_SAMPLE_S = 0.02


class Clock:
    def __init__(self, start: float):
        self.now = start

    def time(self) -> float:
        return self.now


def uneven_lengths(n: int, seed: int = 5) -> list[int]:
    """Blocks of 40 short samples, then 40 long ones (10x), and so on: what a dataset sorted by source looks like."""
    rng = random.Random(seed)
    return [rng.randint(80, 120) if (i // 40) % 2 == 0 else rng.randint(800, 1200) for i in range(n)]


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock(1_800_000_000.0)
    monkeypatch.setattr(runstate_module, "time", clock)  # the marks' timestamps come from the test's clock
    return clock


def test_eta_from_tokens_is_within_ten_percent_after_ten_percent(redis, clock):
    lengths = uneven_lengths(400)
    durations = [PER_SAMPLE_S + t / TOKENS_PER_S for t in lengths]
    end = clock.now + sum(durations)
    state = RunState(redis, "uneven")
    state.create(dataset="uneven.jsonl")
    state.start_extraction()
    state.set_total(len(lengths), sum(lengths))
    config = StatusConfig()
    token_errors, count_errors = [], []
    for i, (tokens, seconds) in enumerate(zip(lengths, durations, strict=True)):
        clock.now += seconds
        state.mark_done(i, tokens, tokens * 100)
        if (i + 1) / len(lengths) < 0.10 or i + 1 == len(lengths):
            continue
        ex = read_run(redis, "uneven", config=config, now=clock.now).run.extraction
        left = end - clock.now
        token_errors.append(abs(ex.eta_s - left) / left)
        count_errors.append(abs(ex.remaining / ex.samples_per_s - left) / left)
        assert ex.tokens_remaining == sum(lengths[i + 1 :])
    assert max(token_errors) <= 0.10, f"worst {max(token_errors):.1%}, median {statistics.median(token_errors):.1%}"
    # The same run by sample counts: the check above would fail on it.
    assert max(count_errors) > 0.5 and statistics.median(count_errors) > 0.2


def test_failed_samples_leave_no_tokens_to_wait_for(redis, clock):
    state = RunState(redis, "with-failures")
    state.create(dataset="d.jsonl")
    state.start_extraction()
    state.set_total(4, 400)
    for i in range(2):
        clock.now += 1
        state.mark_done(i, 100, 1)
    clock.now += 1
    state.mark_failed(2, "s2", "bad dump")
    ex = read_run(redis, "with-failures", config=StatusConfig(), now=clock.now).run.extraction
    assert ex.tokens_remaining == 100 and ex.eta_s == pytest.approx(100 / ex.tokens_per_s)
    state.mark_done(3, 100, 1)
    ex = read_run(redis, "with-failures", config=StatusConfig(), now=clock.now).run.extraction
    assert ex.tokens_remaining == 0 and ex.eta_s == 0
