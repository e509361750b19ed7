"""A batch given up (its worker kept dying) records each prompt under its own id, a bad line with its own reason;
a run whose regeneration gave up every prompt ends ``failed`` with the reason, not ``done`` with nothing."""

import json

from eaglet.services.regenerate.jobs import regenerate_batch
from eaglet.shared.keys import RunKeys
from eaglet.shared.records import Stage
from tests.regenerate.conftest import env_of, start_run, write_jsonl

WHY = "its worker died, 3 times: given up"


def test_a_given_up_batch_keeps_ids_and_reasons_and_fails_the_run(redis, settings, tmp_path, monkeypatch):
    for name, value in env_of(settings).items():
        monkeypatch.setenv(name, value)
    source = write_jsonl(
        tmp_path / "in.jsonl", [{"id": "q0", "prompt": "Hi"}, "{not json", {"id": "q1", "prompt": "?"}]
    )
    state = start_run(redis, settings.redis_url, "gave-up", source, stop_after=True)
    regenerate_batch("gave-up", 0, give_up=WHY)
    errors = {e["sample_id"]: e["reason"] for e in map(json.loads, redis.lrange(RunKeys("gave-up").errors, 0, -1))}
    assert errors == {
        "in.jsonl:1": f"prompt q0: {WHY}",
        "in.jsonl:2": errors["in.jsonl:2"],
        "in.jsonl:3": f"prompt q1: {WHY}",
    }, errors
    assert errors["in.jsonl:2"].startswith("malformed JSON"), errors
    meta = state.meta()
    assert meta.stage == Stage.failed and "gave up all 3 prompts" in (meta.error or ""), meta
