import json
import threading

from eaglet.shared import keys
from eaglet.shared.runstate import RunState, Stage


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
    assert (counts["done"], counts["failed"], counts["tokens"], counts["bytes"]) == (2, 1, 10, 200)
    assert state.extraction_complete() and state.stage() == Stage.extracted


def test_retry_of_a_failed_sample_moves_it_to_done(redis):
    state = new_run(redis, total=2)
    state.mark_failed(0, "s0", "boom")
    assert state.mark_done(0, 5, 1) == 1
    assert state.counts()["failed"] == 0 and state.counts()["done"] == 1
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
    assert state.counts()["done"] == total
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
