"""A regenerating run's figures and alerts from its counters (real Redis, the writers' own marks)."""

import time

from eaglet.shared.alerts import StatusConfig
from eaglet.shared.heartbeats import WorkerState, beat
from eaglet.shared.regeneration import Batch, Progress
from eaglet.shared.runoptions import RegenerateOptions, RunOptions
from eaglet.shared.runs import create_run
from eaglet.shared.status import read_run
from tests.regenerate.conftest import write_jsonl


def test_figures_and_alerts_of_a_regenerating_run(redis, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i}"} for i in range(20)])
    create_run(redis, "rg", source, RunOptions(regenerate=RegenerateOptions()))
    progress = Progress(redis, "rg")
    progress.plan([Batch(offset=0, line=1, prompt=0, count=20)], 20)
    beat(redis, "w0", state=WorkerState.busy, host="h", pid=1, inference_url="")
    for i in range(8):
        assert progress.mark(i, "done", tokens_in=10, tokens_out=30, retries=i % 2) == 1
    assert progress.mark(8, "failed") == 1 and progress.mark(8, "failed") == 0 and progress.mark(3, "done") == 0
    config = StatusConfig(stall_min_s=60, error_rate_min_attempts=5, error_rate_threshold=0.05)
    run = read_run(redis, "rg", config=config).run
    rg = run.regeneration
    assert (rg.total, rg.done, rg.failed, rg.remaining, rg.retries) == (20, 8, 1, 11, 4)
    assert (rg.tokens_in, rg.tokens_out) == (80, 240) and rg.percent == 45.0
    assert rg.prompts_per_s > 0 and rg.eta_s == 11 / rg.prompts_per_s
    assert run.extraction.total is None and run.extraction.eta_s is None
    assert [a.kind for a in run.alerts] == ["error_rate"] and "regeneration" in run.alerts[0].message
    later = read_run(redis, "rg", config=config, now=time.time() + 3600).run
    stalled = [a.message for a in later.alerts if a.kind == "stalled"]
    assert len(stalled) == 1 and stalled[0].startswith("no prompt regenerated for")
