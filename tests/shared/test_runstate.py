import json
import threading

import pytest

from eaglet.shared import keys
from eaglet.shared.records import EvalResult, RunMeta, TrainProgress
from eaglet.shared.runstate import RunState, Stage, StageRefused


def new_run(redis, total=10, run_id="r1"):
    state = RunState(redis, run_id)
    state.create(model="m", hidden_size=8)
    state.set_total(total, total * 5)
    return state


def test_done_counts_once_and_completes_once(redis):
    state = new_run(redis, total=3)
    assert state.mark_done(0, 5, 100) == 1
    assert state.mark_done(0, 5, 100) == 0  # a duplicated job never counts twice
    assert state.mark_failed(0, "s0", "late failure") == 0  # a done sample stays done
    assert state.mark_failed(1, "s1", "bad dump") == 1
    assert state.mark_done(2, 5, 100) == 2
    assert state.mark_done(2, 5, 100) == 0
    counts = state.counts()
    assert (counts.done, counts.failed, counts.tokens, counts.bytes) == (2, 1, 10, 200)
    assert state.extraction_complete() and state.stage() == Stage.extracted


def test_retry_of_a_failed_sample_moves_it_to_done(redis):
    state = new_run(redis, total=2)
    state.mark_failed(0, "s0", "boom")
    assert state.mark_done(0, 5, 1) == 1
    assert state.counts().failed == 0 and state.counts().done == 1
    assert redis.hlen(state.keys.failures) == 0


def test_flag_set_exactly_once_under_concurrent_marks(redis, redis_server):
    total = 400
    state = new_run(redis, total=total)
    pubsub = redis.pubsub()
    pubsub.subscribe(keys.EVENTS)
    pubsub.get_message(timeout=1)

    def mark(indexes):
        own = RunState(type(redis).from_url(redis_server.url, decode_responses=True), "r1")
        for i in indexes:
            own.mark_done(i, 1, 1)
            own.mark_done(i, 1, 1)  # every job delivered twice

    threads = [threading.Thread(target=mark, args=(range(k, total, 4),)) for k in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert state.counts().done == total
    events = []
    while (message := pubsub.get_message(timeout=0.5)) is not None:
        events.append(json.loads(message["data"]))
    assert [e["event"] for e in events].count("extraction_complete") == 1


def test_total_set_after_the_last_sample_still_completes(redis):
    state = RunState(redis, "r2")
    state.create()
    state.start_extraction()
    state.mark_done(0, 3, 30)
    state.mark_done(1, 3, 30)
    assert not state.extraction_complete()
    assert state.set_total(2, 6) == 2
    assert state.extraction_complete()


def test_errors_are_capped_and_newest_first(redis):
    state = new_run(redis)
    for i in range(150):
        state.record_error(i, f"s{i}", f"reason {i}")
    errors = redis.lrange(state.keys.errors, 0, -1)
    assert len(errors) == 100 and json.loads(errors[0])["reason"] == "reason 149"


def test_stage_machine_of_a_trained_run(redis):
    state = new_run(redis, total=1)
    state.mark_done(0, 5, 1)
    state.wait_for_gpus()
    assert state.stage() == Stage.waiting_for_gpus and not state.gpus_released()
    state.release_gpus(now=12.5)
    state.release_gpus(now=99.0)  # set once: the first release stands
    assert state.gpus_released() and state.meta().gpus_released == 12.5
    state.start_training()
    state.start_evaluating()
    state.finish()
    assert state.stage() == Stage.done
    assert state.fail("too late") is None and state.cancel() is None  # a finished run stays as it ended
    assert state.stage() == Stage.done and state.meta().error is None


def test_a_cancelled_run_is_never_trained(redis):
    state = new_run(redis, total=4)
    assert state.cancel() == Stage.extracting
    with pytest.raises(StageRefused) as refused:
        state.start_training()
    assert refused.value.stage == Stage.cancelled
    assert not state.start_extraction() and state.stage() == Stage.cancelled


def test_finish_needs_a_training(redis):
    state = new_run(redis, total=4)
    with pytest.raises(StageRefused):
        state.finish()
    with pytest.raises(StageRefused):
        state.start_evaluating()


def test_fail_keeps_the_reason_and_announces_the_stage(redis):
    state = new_run(redis, total=4)
    pubsub = redis.pubsub()
    pubsub.subscribe(keys.EVENTS)
    pubsub.get_message(timeout=1)
    assert state.fail("ingest stopped") == Stage.extracting
    assert state.meta().error == "ingest stopped" and state.stage() == Stage.failed
    assert json.loads(pubsub.get_message(timeout=1)["data"])["event"] == "stage:failed"


def test_meta_train_and_eval_records(redis):
    state = new_run(redis, total=4)
    state.update_meta(RunMeta(bad_lines=2, ingest_cursor={"lines": 9}))
    meta = state.meta()
    assert (meta.run_id, meta.model, meta.hidden_size, meta.total, meta.bad_lines) == ("r1", "m", 8, 4, 2)
    assert meta.ingest_cursor == {"lines": 9} and meta.stage == Stage.extracting
    with pytest.raises(ValueError):
        state.update_meta(RunMeta(stage=Stage.done))  # the stage moves through the transitions only
    state.update_train(TrainProgress(step=1, acc=[0.5]))
    state.update_train(TrainProgress(step=2, beat_at=3.0))
    assert (state.train().step, state.train().accuracy, state.train().beat_at) == (2, 0.5, 3.0)
    assert state.add_train_attempt() == 1 and state.add_train_attempt(-1) == 0
    assert state.record_ingest_death() == 1 and state.meta().ingest_deaths == 1
    state.update_eval(EvalResult(state="running", prompts_done=3))
    state.replace_eval(EvalResult(state="running", prompts=5))
    assert state.eval() == EvalResult(state="running", prompts=5)
