"""The status figures, read from what the writers keep, at a fixed ``now``."""

import time
from dataclasses import asdict

import pytest

from eaglet.shared.alerts import StatusConfig
from eaglet.shared.heartbeats import beat, report_inference
from eaglet.shared.layout import bytes_per_token
from eaglet.shared.records import EvalResult, RunMeta, TrainProgress, WorkerRole, WorkerState
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import EARLIER_EVALS, RunState, Stage
from eaglet.shared.status import read_run, read_status

CONFIG = StatusConfig(lost_after_s=10.0)


def extracting_run(redis, run_id: str = "r1", total: int = 4) -> RunState:
    state = RunState(redis, run_id)
    state.create(dataset="/d/data.jsonl", model="tiny", hidden_size=8)
    state.start_extraction()
    state.set_total(total, total * 10)
    return state


def test_unknown_run_is_none(redis):
    assert read_run(redis, "nope", config=CONFIG) is None


def test_extraction_and_storage_figures(redis):
    state = extracting_run(redis)
    state.mark_done(0, 10, 400)
    state.mark_failed(1, "s1", "bad dump")
    run = read_run(redis, "r1", config=CONFIG).run
    ex, st = run.extraction, run.storage
    assert (run.stage, run.dataset, run.model, run.error) == (Stage.extracting, "/d/data.jsonl", "tiny", None)
    assert (ex.total, ex.done, ex.failed, ex.remaining, ex.percent) == (4, 1, 1, 2, 50.0)
    assert ex.error_rate == 0.5 and [e.reason for e in ex.last_errors] == ["bad dump"]
    assert (st.bytes_written, st.tokens_written, st.bytes_per_token, st.total_tokens) == (400, 10, 40.0, 40)
    assert st.projected_total_bytes == 1600 and st.projected_remaining_bytes == 1200


def test_the_storage_projection_counts_the_runs_layout_before_its_first_sample(redis):
    state = RunState(redis, "top")
    options = RunOptions(store_dtype="bf16", store_final="topk", store_topk=32, store_aux="fp4")
    state.create(dataset="/d/data.jsonl", model="kimi", hidden_size=7168, options=asdict(options))
    state.start_extraction()
    state.set_total(4, 1000)
    st = read_run(redis, "top", config=CONFIG).run.storage
    expected = bytes_per_token(7168, options.layout(), "bf16")  # 12,293 B: 0.21 of bf16's 57,349
    assert st.bytes_per_token is None and st.layout == "top32+fp4"
    assert st.expected_bytes_per_token == expected and st.projected_total_bytes == round(1000 * expected)
    state.update_meta(RunMeta(aux_layer_ids=[2, 9, 15, 21, 28]))  # a DFlash run's five layers
    five = read_run(redis, "top", config=CONFIG).run.storage
    assert five.expected_bytes_per_token == bytes_per_token(7168, options.layout(), "bf16", num_aux=5)


def test_workers_lost_after_their_heartbeats_age(redis):
    extracting_run(redis)
    beat(redis, "w1", state=WorkerState.busy, host="h", pid=1, inference_url="u", run="r1", disk_free=5, disk_total=9)
    beat(redis, "w2", state=WorkerState.stopped, host="h", pid=2, inference_url="u")
    report_inference(redis, "u", ok=True, model="tiny")
    later = read_run(redis, "r1", config=CONFIG).generated_at + 11
    report = read_run(redis, "r1", config=CONFIG, now=later)
    workers = {w.name: w for w in report.cluster.workers}
    assert workers["w1"].lost and not workers["w2"].lost  # a stopped worker is gone, not lost
    assert (report.cluster.workers_live, report.cluster.workers_lost) == (1, 1)
    assert not report.cluster.inference and not report.cluster.inference_gone[0].healthy  # no worker reports it
    assert "workers_lost" in {a.kind for a in report.run.alerts}
    fresh = read_run(redis, "r1", config=CONFIG)
    assert fresh.cluster.disk_free == 5 and fresh.cluster.inference[0].healthy and fresh.cluster.workers_lost == 0


def test_a_live_ingest_worker_does_not_stand_in_for_extractors(redis):
    extracting_run(redis)
    beat(redis, "ingest-0", state=WorkerState.idle, host="h", pid=1, inference_url="", role=WorkerRole.ingest)
    report = read_run(redis, "r1", config=CONFIG)
    assert [w.role for w in report.cluster.workers] == [WorkerRole.ingest]
    assert "no live worker: start extractor workers" in [a.message for a in report.run.alerts]
    beat(redis, "w1", state=WorkerState.idle, host="h", pid=2, inference_url="u")
    assert "workers_lost" not in {a.kind for a in read_run(redis, "r1", config=CONFIG).run.alerts}


def test_trainer_state_comes_from_the_stage(redis):
    state = extracting_run(redis, total=1)
    assert read_run(redis, "r1", config=CONFIG).run.training.state is None
    state.mark_done(0, 10, 400)
    state.wait_for_gpus()
    training = read_run(redis, "r1", config=CONFIG).run.training
    assert training.state == "waiting"
    state.start_training()
    state.update_train(TrainProgress(step=5, total_steps=10, acc=[0.5, 0.25], beat_at=1.0))
    run = read_run(redis, "r1", config=CONFIG, now=100.0).run
    assert (run.training.state, run.training.percent, run.training.accuracy) == ("training", 50.0, 0.5)
    assert "trainer_lost" in {a.kind for a in run.alerts}  # its heartbeat is 99 s old
    state.fail("CUDA out of memory")
    run = read_run(redis, "r1", config=CONFIG).run
    assert (run.training.state, run.training.error, run.error) == ("failed", "CUDA out of memory", "CUDA out of memory")


def test_a_run_that_failed_in_ingest_has_no_trainer_state(redis):
    state = extracting_run(redis)
    state.fail("ingest stopped")
    run = read_run(redis, "r1", config=CONFIG).run
    assert (run.training.state, run.training.error, run.error) == (None, None, "ingest stopped")


def test_status_pages_newest_first(redis):
    for n in range(3):
        extracting_run(redis, f"run{n}")
    report = read_status(redis, config=CONFIG, offset=1, limit=1)
    assert report.runs_total == 3 and [r.run_id for r in report.runs] == ["run1"]


def test_the_eta_is_withheld_while_nothing_completes_and_measured_again_after(redis):
    config = StatusConfig(lost_after_s=10.0, stall_min_s=60, eta_hold_min_s=0.5)
    state = extracting_run(redis, total=100)
    for i in range(20):
        state.mark_done(i, 10, 400)
    run = read_run(redis, "r1", config=config).run
    assert run.extraction.eta_s is not None and run.verdict == "running"
    time.sleep(1.0)  # no sample for longer than the usual interval allows (its floor here: 0.5 s)
    run = read_run(redis, "r1", config=config).run
    ex = run.extraction
    assert ex.eta_s is None and ex.stalled_since == ex.last_done_at
    assert run.verdict.startswith("stalled for 1.") and "nothing finished since" in run.verdict
    assert "ETA withheld (stalled)" in run.brief and "ETA withheld (stalled)" in run.lines["extraction"]
    assert "stalled" not in {a.kind for a in run.alerts}  # the alert waits for stall_min_s
    later = read_run(redis, "r1", config=config, now=ex.last_done_at + 61).run
    assert [a.message for a in later.alerts if a.kind == "stalled"] == [
        "no sample completed for 1 min 1 s (limit 1 min 0 s)"
    ]
    for i in range(20, 31):
        state.mark_done(i, 10, 400)
        time.sleep(0.01)
    report = read_run(redis, "r1", config=config)
    ex = report.run.extraction
    assert ex.stalled_since is None and ex.eta_s is not None
    # The rate is measured since the stall ended: the 10 samples after the first one past the gap, over the time
    # since that one, not the 31 over a span that holds the gap.
    first_after = float(redis.lindex(state.keys.recent, 10).split()[0])
    assert ex.samples_per_s == pytest.approx(10 / (report.generated_at - first_after))


def test_an_evaluating_run_says_how_far_its_evaluation_is(redis):
    state = extracting_run(redis, total=1)
    state.mark_done(0, 10, 400)
    state.start_training()
    state.update_train(TrainProgress(step=99, total_steps=99, loss=5.45, beat_at=time.time()))
    state.start_evaluating()
    state.update_eval(EvalResult(state="running", prompts=10, k=2, prompts_done=4, accept_length=1.3012))
    run = read_run(redis, "r1", config=CONFIG).run
    assert run.brief == (
        "r1: 99 steps trained; evaluating at k 2 on 10 held-out prompts: 4 / 10 prompts, accept length 1.30 so far "
        "· GPUs: no report · evaluating"
    )
    assert (
        run.lines["evaluation"] == "evaluating at k 2 on 10 held-out prompts: 4 / 10 prompts, accept length 1.30 so far"
    )
    state.update_eval(EvalResult(engine="sglang", target_quantization="fp8"))
    run = read_run(redis, "r1", config=CONFIG).run
    assert run.lines["evaluation"].startswith("evaluating at k 2 on 10 held-out prompts in sglang (fp8 target): 4 / 10")
    assert run.evaluation["engine"] == "sglang" and run.evaluation["target_quantization"] == "fp8"


def test_earlier_evaluations_are_kept_capped_and_shown_beside_the_latest(redis):
    state = extracting_run(redis, total=1)
    state.mark_done(0, 10, 400)
    done = dict(state="done", prompts=10, k=3, mismatches=0, speedup=0.9)
    state.replace_eval(EvalResult(**done, engine="sglang", accept_length=1.284))
    state.replace_eval(EvalResult(**done, engine="sglang", target_quantization="fp8", accept_length=1.276))
    run = read_run(redis, "r1", config=CONFIG).run
    assert run.evaluation["accept_length"] == 1.276 and run.earlier_evaluations[0]["accept_length"] == 1.284
    assert run.lines["evaluation"].endswith("· earlier: 1.28 (sglang)")
    for i in range(EARLIER_EVALS + 3):
        state.replace_eval(EvalResult(**done, engine="reference", accept_length=1.0 + i / 100))
    earlier = read_run(redis, "r1", config=CONFIG).run.earlier_evaluations
    assert len(earlier) == EARLIER_EVALS and earlier[0]["accept_length"] == 1.0 + (EARLIER_EVALS + 1) / 100
    state.replace_eval(EvalResult(state="running", prompts=10, k=3))  # a failed or running one is listed, not lined
    line = read_run(redis, "r1", config=CONFIG).run.lines["evaluation"]
    assert line.endswith("· earlier: 1.10 (reference), 1.09 (reference), 1.08 (reference) and 5 more")
