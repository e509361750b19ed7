"""The status in words, as people read it: the brief line's fields, each stage's line, and no raw float or unix
time anywhere in ``eaglet status``'s or the page's text. Runs written through the real writers, into real Redis."""

import re
import time

import pytest

from eaglet.cli.status import main
from eaglet.shared import gpustats, keys
from eaglet.shared.heartbeats import WorkerState, beat, report_inference
from eaglet.shared.records import EvalResult, GpuRole, InferenceBeat, TrainProgress, WorkerBeat
from eaglet.shared.regeneration import Batch, Progress
from eaglet.shared.runoptions import RegenerateOptions, RunOptions
from eaglet.shared.runs import create_run
from eaglet.shared.runstate import RunState
from tests.gateway.test_gateway_page import Collect, chromium

RAW_FLOAT = re.compile(r"\d\.\d{4,}")  # 5.449093341827393: more digits than anyone reads
UNIX_TIME = re.compile(r"\b1[6-9]\d{8}\b|\b1,[6-9]\d{2},\d{3},\d{3}\b")  # 1796141884 or 1,796,141,884
BRIEF = re.compile(
    r"^active: 30 / 100 samples — 30\.0 % done · [\d.,]+ samples/s, [\d.,]+ tok/s · 3 errors \([\d.]+ %\) · "
    r"disk [\d.]+ [KMGT]?B used, [\d.]+ [KMGT]B free · ETA ~[\d.]+ (min|s|h)[\w ]* · "
    r"GPUs unknown \(no NVML here\) · running$"
)


@pytest.fixture
def runs(redis, tmp_path):
    """A run that is done (extracted, trained, evaluated; its server silent for 80 minutes), a run that only
    regenerated, and a run 30 % through extraction with live, recently lost and long-dead workers."""
    now = time.time()
    done = RunState(redis, "finished")
    done.create(dataset="/d/chat.jsonl", model="tiny")
    done.start_extraction()
    done.set_total(10, 10 * 200)
    for i in range(10):
        done.mark_done(i, 200, 200 * 9216)
    done.start_training()
    done.update_train(TrainProgress(step=99, total_steps=99, loss=5.449093341827393, acc=[0.1234567, 0.05],
                                    tokens_per_s=1234.5678, started_at=now - 95.3, finished_at=now - 20.1,
                                    updated_at=now - 20.1, beat_at=now - 20))  # fmt: skip
    done.start_evaluating()
    done.update_eval(EvalResult(state="done", prompts=10, k=2, max_new_tokens=48, prompts_done=10,
                                accept_length=1.2712, accept_rate=[0.2012, 0.0701], speedup=0.6312, mismatches=0,
                                started_at=now - 19.0, finished_at=now - 2.5))  # fmt: skip
    done.finish()
    old_server = InferenceBeat(url="http://old:30000", ok=True, ts=now - 4805, host="h0", model="tiny")
    redis.hset(keys.INFERENCE, "h0 http://old:30000", old_server.to_redis())

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(f'{{"id": "p{i}", "prompt": "say {i}"}}\n' for i in range(4)))
    create_run(redis, "regen-only", source, RunOptions(regenerate=RegenerateOptions(stop_after=True)))
    progress = Progress(redis, "regen-only")
    progress.plan([Batch(offset=0, line=1, prompt=0, count=4)], 4)
    for i in range(4):
        progress.mark(i, "done", tokens_in=12, tokens_out=31)
    RunState(redis, "regen-only").finish_regeneration(str(tmp_path / "regenerated.jsonl"), stop=True)

    active = RunState(redis, "active")
    active.create(dataset="/d/chat.jsonl", model="tiny")
    active.start_extraction()
    active.set_total(100, 100 * 300)
    for i in range(30):
        active.start_attempt(i, "w-live")
        if i % 10 == 4:
            active.record_error(i, f"s{i}", "inference timeout", "w-live")
        active.mark_done(i, 300, 300 * 9216)
    beat(redis, "w-live", state=WorkerState.busy, host="h1", pid=1, inference_url="http://inf:1", run="active",
         sample="s30", disk_free=9 * 10**12, disk_total=11 * 10**12)  # fmt: skip
    recent = WorkerBeat(worker="w-recent", state=WorkerState.busy, ts=now - 40, run="active", sample="s31")
    redis.hset(keys.WORKERS, "w-recent", recent.to_redis())
    for n in range(16):  # every worker that ever died in the run, an hour ago
        dead = WorkerBeat(worker=f"vm:{22151 + n}", state=WorkerState.busy, ts=now - 3600, run="active")
        redis.hset(keys.WORKERS, dead.worker, dead.to_redis())
    report_inference(redis, "http://released:1", ok=False, detail="ConnectError", host="h2")  # stopped, workers on
    reader = gpustats.GpuReader({})  # this machine's NVML: none here, so the GPUs read as unknown
    gpustats.publish(redis, reader, role=GpuRole.inference, host="h1")
    return now


@pytest.fixture
def gateway(start_gateway):
    # the workers' and the GPUs' reports stay live through the test, and a run is not called stalled while it runs
    # (the gateway tests' 0.3 s floor is for the stall tests; a loaded machine takes longer than that between steps)
    return start_gateway(heartbeat_interval_s=5, stall_min_s=60)


def test_the_brief_line_has_every_field(runs, gateway):
    status = gateway.client().get("/status").json()
    by_id = {r["run_id"]: r for r in status["runs"]}
    assert BRIEF.match(by_id["active"]["brief"]), by_id["active"]["brief"]
    assert by_id["active"]["verdict"] == "running"
    finished = by_id["finished"]["brief"]
    assert finished.startswith("finished: 10 samples extracted in ") and finished.endswith(" · done")
    assert "99 steps trained in 1 min 15 s, accept length 1.27" in finished
    assert by_id["regen-only"]["brief"].startswith("regen-only: 4 prompts regenerated in ")


def test_the_brief_line_of_a_run_whose_total_is_not_counted_yet(redis, gateway):
    counting = RunState(redis, "counting")  # the ingest streams samples to the workers before it has counted them
    counting.create(dataset="/d/chat.jsonl", model="tiny")
    counting.start_extraction()
    for i in range(3):
        counting.mark_done(i, 300, 300 * 9216)
    by_id = {r["run_id"]: r for r in gateway.client().get("/status").json()["runs"]}
    brief = by_id["counting"]["brief"]
    assert brief.startswith("counting: 3 samples so far, the total still being ingested · "), brief
    assert "?" not in brief and "– done" not in brief


def test_each_stage_in_words_and_only_the_stages_a_run_has(runs, gateway):
    by_id = {r["run_id"]: r for r in gateway.client().get("/status").json()["runs"]}
    finished = by_id["finished"]["lines"]
    assert finished["evaluation"] == (
        "accept length 1.27 at k 2 on 10 held-out prompts, outputs equal to plain greedy, 0.63× the target's speed here"
    )
    assert finished["training"] == "99 steps in 1 min 15 s · final loss 5.45 · accuracy 12.3 % (first position)"
    assert re.match(r"10 done, 0 failed of 10 in [\d.]+ s \([\d.,]+ samples/s, [\d.,]+ tokens/s on average\) · "
                    r"no errors, 0 retries · finished \d\d:\d\d:\d\d$", finished["extraction"])  # fmt: skip
    assert list(by_id["regen-only"]["lines"]) == ["regeneration"]  # no extraction, no storage: it has none
    assert "4 prompts regenerated in" in by_id["regen-only"]["lines"]["regeneration"]
    assert list(by_id["active"]["lines"]) == ["extraction", "storage"]


def test_dead_workers_and_finished_servers_leave_the_tables(runs, gateway):
    report = gateway.client().get("/runs/active").json()
    cluster, run = report["cluster"], report["run"]
    assert [w["name"] for w in cluster["workers"]] == ["w-live", "w-recent"]
    assert (cluster["workers_lost"], cluster["workers_gone"]) == (1, 16)
    [lost] = [a["message"] for a in run["alerts"] if a["kind"] == "workers_lost"]
    assert lost == "1 worker(s) lost: w-recent"  # not every worker that ever died
    assert [s["url"] for s in cluster["inference"]] == ["http://released:1"]  # down while a run extracts: a worry
    assert [s["url"] for s in cluster["inference_gone"]] == ["http://old:30000"]  # no worker reports it any more
    finished = gateway.client().get("/runs/finished").json()["cluster"]
    assert finished["inference"] == []  # for a finished run a stopped server is no worry
    assert [s["url"] for s in finished["inference_gone"]] == ["http://released:1", "http://old:30000"]
    [gpus] = cluster["gpus"]
    assert (gpus["role"], gpus["host"], gpus["gpus"], gpus["live"]) == ("inference", "h1", None, True)
    assert gpus["detail"].startswith("no NVML here (")


def check_words(text: str) -> None:
    assert not RAW_FLOAT.search(text), RAW_FLOAT.search(text)
    assert not UNIX_TIME.search(text), UNIX_TIME.search(text)


def test_cli_text_has_words_not_raw_figures(runs, redis_server, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["--redis-url", redis_server.url]) == 0
    out = capsys.readouterr().out
    check_words(out)
    assert "loss 5.45" in out and "accept length 1.27 at k 2" in out and "lost: 16 more" in out
    assert "out of service (no worker uses it, or no run needs it): h0 http://old:30000" in out
    assert "unknown:" in out  # the GPUs' row
    assert main(["--brief", "--redis-url", redis_server.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and BRIEF.match(lines[0]), lines  # only the active run; a finished one is history
    assert main(["finished", "--brief", "--redis-url", redis_server.url]) == 0
    assert capsys.readouterr().out.strip().endswith("accept length 1.27 · done")


def test_page_text_has_words_not_raw_figures(runs, gateway, tmp_path):
    page = Collect()
    page.feed(chromium(f"{gateway.url}/?interval=0.5", tmp_path / "profile", "--dump-dom").stdout)
    body = " ".join(page.text)
    text = body[body.index("run(s), updated") :]  # what the page shows, after the header (not its script)
    check_words(text[: text.index('"use strict"')] if '"use strict"' in text else text)
    briefs = [a["data-run"] for a in page.attrs if a.get("class") == "line"]
    assert briefs == ["active"]  # the header: the run that is not finished
    assert "accept length 1.27 at k 2 on 10 held-out prompts" in text and "lost: 16 more" in text
