"""Regeneration as the first stage of a run, with real workers and the reference server's chat endpoint: every
assistant turn is the target's greedy answer after its own earlier answers; bad lines are reported with file:line
and the rest goes on; the final file is in the input's order; the run then ingests and extracts what was written."""

import json

from eaglet.cli.stack import LocalStack
from eaglet.services.regenerate.results import output_path
from eaglet.shared.config import StatusSettings
from eaglet.shared.records import Stage
from eaglet.shared.runstate import RunState
from eaglet.shared.status import read_run
from tests.regenerate.conftest import start_run, start_workers, wait_regenerated, write_jsonl
from tests.reliability.helpers import env_of, wait_for

MAX_NEW = 10

GOOD = [
    {"id": "p-single", "prompt": "Say something about the sea."},
    {
        "id": "p-openai",
        "messages": [
            {"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": "What is a prime number?"},
            {"role": "assistant", "content": "An answer the target never wrote."},
            {"role": "user", "content": "Give one."},
            {"role": "assistant", "content": "Another one to be replaced."},
            {"role": "user", "content": "And a bigger one?"},
        ],
    },
    {
        "id": "p-sharegpt",
        "conversations": [
            {"from": "human", "value": "Hello there."},
            {"from": "gpt", "value": "Old answer."},
            {"from": "human", "value": "Tell me a word."},
        ],
    },
    {"prompt": "A prompt without an id."},
]


def test_multi_turn_regeneration_equals_greedy_turn_by_turn(redis, settings, tmp_path, greedy):
    source = write_jsonl(
        tmp_path / "input.jsonl",
        [
            GOOD[0],
            '{"id": "broken", "prompt": ',  # line 2: malformed
            GOOD[1],
            {"id": "empty", "prompt": "   "},  # line 4: empty prompt
            "",  # a blank line: skipped, not a prompt
            GOOD[2],
            {"id": "long", "prompt": "word " * 2100},  # line 7: over the tiny model's 2,048-token context
            GOOD[3],
        ],
    )
    with LocalStack(tmp_path / "logs") as stack:
        start_workers(stack, settings, ["w0", "w1"])
        state = start_run(redis, settings.redis_url, "regen", source, max_tokens=MAX_NEW, batch_prompts=2,
                          concurrency=2, stop_after=True)  # fmt: skip
        assert wait_regenerated(state, 180) == Stage.done
    out = output_path(settings.data_dir, "regen")
    assert state.meta().dataset == str(out)
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [c["id"] for c in written[:3]] == ["p-single", "p-openai", "p-sharegpt"] and len(written) == 4
    assert written[3]["id"].startswith("s")  # no id given: a stable one from the line, as ingest makes
    for given, got in zip(GOOD, written, strict=True):
        turns = given.get("messages") or given.get("conversations") or [{"role": "user", "content": given["prompt"]}]
        expected = []  # replayed as the target saw it: its own earlier answers, never the given ones
        for turn in turns:
            role = {"human": "user", "gpt": "assistant"}.get(turn.get("from"), turn.get("role"))
            if role == "assistant":
                continue
            expected.append({"role": role, "content": turn.get("content", turn.get("value"))})
            if role == "user":
                expected.append({"role": "assistant", "content": greedy.answer(expected, MAX_NEW)})
        assert got["messages"] == expected, got["id"]

    report = read_run(redis, "regen", config=StatusSettings().status_config()).run
    rg = report.regeneration
    assert (rg.total, rg.done, rg.failed, rg.remaining) == (7, 4, 3, 0)
    assert rg.tokens_out > 0 and rg.tokens_in > rg.tokens_out and rg.completed_at is not None
    reasons = {e.sample_id: e.reason for e in report.extraction.last_errors}
    assert "malformed JSON" in reasons["input.jsonl:2"]
    assert "empty user message" in reasons["input.jsonl:4"]
    assert "exceed the target's context of 2048" in reasons["input.jsonl:7"]
    assert "prompt long:" in reasons["input.jsonl:7"]


def test_the_run_goes_on_to_ingest_and_extract_what_was_regenerated(redis, settings, tmp_path):
    source = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"q{i}", "prompt": f"Count to {i}."} for i in range(5)])
    with LocalStack(tmp_path / "logs") as stack:
        start_workers(stack, settings, ["w0"])
        stack.start("ingest", "eaglet.services.ingest.worker", "--name", "ingest", env=env_of(settings))
        state = start_run(redis, settings.redis_url, "regen-on", source, max_tokens=MAX_NEW, batch_prompts=3)
        assert wait_regenerated(state, 120) == Stage.ingesting
        wait_for("the extraction", state.extraction_complete, 180, 0.2)
    meta = state.meta()
    assert meta.total == 5 and state.counts().done == 5
    assert meta.dataset == str(output_path(settings.data_dir, "regen-on"))
    assert meta.regenerate_input == str(source)
    assert RunState(redis, "regen-on").stage() == Stage.extracted
