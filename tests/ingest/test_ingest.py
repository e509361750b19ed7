import json

import pytest
from transformers import AutoTokenizer

from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared.config import Settings
from eaglet.shared.jobqueue import run_queue
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunExists, RunState, Stage
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import samples_dir

GOOD = [
    {"id": "sharegpt-1", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there!"}]},
    {
        "id": "openai-1",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6"},
        ],
    },
    {"id": "pretok-1", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
    {"messages": [{"role": "user", "content": "no id"}, {"role": "assistant", "content": "hashed id"}]},
]
BAD = [  # (raw line, what the error must say)
    (b"{not json", "malformed JSON"),
    (b'{"messages": []}', "empty conversation"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    (b'{"id": "x\xff", "messages": []}', "not UTF-8"),
    (
        b'{"id": "../etc/passwd", "messages": [{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}',
        "safe",
    ),
    (
        b'{"id": "sharegpt-1", "messages": [{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}',
        "duplicate",
    ),
    (b'{"input_ids": [1, 2], "loss_mask": [1]}', "same length"),
    (b'{"id": "first-only", "input_ids": [1, 2, 3], "loss_mask": [1, 0, 0]}', "nothing to train on"),
    (b'{"input_ids": [1, 99999999], "loss_mask": [1, 1]}', "outside the model's vocabulary"),
    (b"[1, 2]", "JSON object"),
    (b'{"text": "plain"}', "no 'messages'"),
]


@pytest.fixture
def dataset(tmp_path):
    lines = (
        [json.dumps(g).encode() for g in GOOD[:2]]
        + [raw for raw, _ in BAD]
        + [json.dumps(g).encode() for g in GOOD[2:]]
    )
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_ingest_keeps_good_lines_and_reports_bad_ones(redis, dataset, tmp_path, tiny_model_dir):
    settings = Settings(model=str(tiny_model_dir), data_dir=tmp_path / "data")
    result = ingest_new_run(redis, settings, "run1", dataset, RunOptions())
    assert (result.samples, result.bad_lines) == (4, len(BAD))
    errors = [json.loads(e)["reason"] for e in reversed(redis.lrange(RunState(redis, "run1").keys.errors, 0, -1))]
    for line_no, ((_, why), error) in enumerate(zip(BAD, errors, strict=True), start=3):
        assert error.startswith(f"data.jsonl:{line_no}: ") and why in error, error
    samples = SampleSet(samples_dir(settings.data_dir, "run1"))
    assert [samples[i].sample_id for i in range(4)][:3] == ["sharegpt-1", "openai-1", "pretok-1"]
    assert samples[3].sample_id.startswith("s")
    assert samples[2].input_ids.tolist() == [1, 2, 3, 4] and samples[2].loss_mask.tolist() == [0, 0, 1, 1]
    meta = RunState(redis, "run1").meta()
    assert meta.total == 4 and meta.stage == Stage.extracting
    assert run_queue(redis, "run1").count == 4
    assert not any(p.name == "passwd" for p in tmp_path.rglob("*"))  # nothing outside the run directory
    with pytest.raises(RunExists):
        ingest_new_run(redis, settings, "run1", dataset, RunOptions())


def test_loss_mask_covers_exactly_the_assistant_turns(redis, tmp_path, smollm2_dir):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(GOOD[1]) + "\n")
    settings = Settings(model=str(smollm2_dir), data_dir=tmp_path / "data")
    ingest_new_run(redis, settings, "run2", path, RunOptions())
    sample = SampleSet(samples_dir(settings.data_dir, "run2"))[0]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    masked = tokenizer.decode(sample.input_ids[sample.loss_mask == 1])
    assert masked == "4<|im_end|>\n6<|im_end|>\n"
    assert tokenizer.decode(sample.input_ids).startswith("<|im_start|>system\nBe brief.")


@pytest.mark.parametrize("overlong, kept", [("reject", 0), ("truncate", 1)])
def test_overlong_samples_are_rejected_or_truncated(redis, tmp_path, tiny_model_dir, overlong, kept):
    long_answer = "word " * 400
    line = {
        "id": "long",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": long_answer}],
    }
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(line) + "\n")
    settings = Settings(model=str(tiny_model_dir), data_dir=tmp_path / "data")
    result = ingest_new_run(redis, settings, f"run-{overlong}", path, RunOptions(max_tokens=64, overlong=overlong))
    assert result.samples == kept
    if kept:
        assert SampleSet(samples_dir(settings.data_dir, f"run-{overlong}")).length(0) == 64
    else:
        assert "exceeds max_tokens=64" in result.errors[0]
        assert RunState(redis, f"run-{overlong}").stage() == Stage.failed


def test_an_ingest_that_stops_ends_its_run_failed_with_the_reason(redis, dataset, tmp_path, tiny_model_dir):
    """A real fault of the data volume: a file stands where the run's samples folder goes."""
    settings = Settings(model=str(tiny_model_dir), data_dir=tmp_path / "data")
    blocker = samples_dir(settings.data_dir, "run1")
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a folder")
    with pytest.raises(OSError):
        ingest_new_run(redis, settings, "run1", dataset, RunOptions())
    meta = RunState(redis, "run1").meta()
    assert meta.stage == Stage.failed and meta.total is None
    assert meta.error.startswith(f"ingest of {dataset} stopped: ") and "samples" in meta.error, meta.error
    assert run_queue(redis, "run1").count == 0
