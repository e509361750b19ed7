"""Bad inputs to ingest and to the APIs: each line ingested or refused with its line number and reason, every
request answered with a 4xx rather than a crash, and nothing written outside the run's (or the dump) folder."""

import json
from pathlib import Path
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from eaglet.services.gateway.main import create_app as create_gateway
from eaglet.services.inference.batcher import Batcher
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.inference.server import create_app as create_inference
from eaglet.services.ingest.chat import tokenize_conversation
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared import chatlines
from eaglet.shared.chatlines import BadLine, Conversation, parse_line
from eaglet.shared.config import Settings
from eaglet.shared.dumpwriter import STATS_DIR, DumpWriter
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import samples_dir
from tests.reliability.helpers import TOKEN, gateway_settings

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=4),
    max_leaves=20,
)
roles = st.sampled_from(["user", "assistant", "system", "human", "gpt", "tool", "", "USER"]) | json_values
turn = st.fixed_dictionaries({"role": roles, "content": st.text(max_size=60) | json_values})
sharegpt_turn = st.fixed_dictionaries({"from": roles, "value": st.text(max_size=60) | json_values})
ids = st.text(max_size=20) | st.sampled_from(["../x", "a/b", "a\x00b", "..", ".hidden", "/etc/passwd", "ok-1"])
records_st = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(turn, max_size=4)}, optional={"id": ids | json_values}),
    st.fixed_dictionaries({"conversations": st.lists(sharegpt_turn, max_size=4)}, optional={"id": ids}),
    st.fixed_dictionaries(
        {"input_ids": st.lists(st.integers(-5, 2**40), max_size=8) | json_values, "loss_mask": json_values}
    ),
    json_values,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@FUZZ
@given(line=st.binary(max_size=200) | records_st.map(lambda r: json.dumps(r).encode()))
def test_fuzzed_lines_become_a_record_or_a_bad_line(line, tokenizer):
    try:
        record = parse_line(line)
        if isinstance(record, Conversation):
            input_ids, mask = tokenize_conversation(tokenizer, record.messages)
            assert len(input_ids) == len(mask)
    except BadLine as e:
        assert str(e)


def test_a_dataset_of_bad_lines_ingests_the_good_ones_and_reports_the_rest(
    redis, tmp_path, tiny_model_dir, monkeypatch
):
    monkeypatch.setattr(chatlines, "MAX_LINE_BYTES", 16384)  # a "giant" line without writing gigabytes
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    lines = [  # (line, the reason it must be refused with; None: ingested)
        (json.dumps({**good, "id": "good-1"}).encode(), None),
        (b"{not json", "malformed JSON"),
        (b'{"messages": []}', "empty conversation"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "no assistant turn"),
        (b'{"id": "caf\xe9", "messages": []}', "not UTF-8"),
        (json.dumps({**good, "id": "x" * 20_000}).encode(), "bytes exceeds"),
        (json.dumps({**good, "id": "../../escape"}).encode(), "not a safe id"),
        (json.dumps({**good, "id": "dir/name"}).encode(), "not a safe id"),
        (json.dumps({**good, "id": "nul\x00byte"}).encode(), "not a safe id"),
        (json.dumps({**good, "id": "good-1"}).encode(), "duplicate id 'good-1' (first at line 1)"),
        (json.dumps({"id": "long", "input_ids": [5] * 2100, "loss_mask": [1] * 2100}).encode(), "exceeds max_tokens"),
        (json.dumps({"messages": [{"role": ["user"], "content": "x"}]}).encode(), "unknown role"),
        (json.dumps({**good, "id": "good-2"}).encode(), None),
    ]
    dataset = tmp_path / "in" / "data.jsonl"
    dataset.parent.mkdir()
    # The last line is giant and has no newline: it must not be read whole.
    dataset.write_bytes(b"\n".join(line for line, _ in lines) + b"\n" + b"z" * 100_000)
    settings = Settings(_env_file=None, model=str(tiny_model_dir), data_dir=tmp_path / "data")
    before = {p for p in tmp_path.rglob("*")}
    result = ingest_new_run(redis, settings, "bad", dataset, RunOptions())
    refused = [(n, why) for n, (_, why) in enumerate(lines, start=1) if why] + [(len(lines) + 1, "bytes exceeds")]
    assert (result.samples, result.bad_lines) == (2, len(refused))
    errors = [json.loads(e)["reason"] for e in reversed(redis.lrange(RunState(redis, "bad").keys.errors, 0, -1))]
    for (line_no, why), error in zip(refused, errors, strict=True):
        assert error.startswith(f"data.jsonl:{line_no}: ") and why in error, (line_no, why, error)
    samples = SampleSet(samples_dir(settings.data_dir, "bad"))
    assert [samples[i].sample_id for i in range(len(samples))] == ["good-1", "good-2"]
    run_dir = settings.data_dir / "runs" / "bad"
    written = {p for p in tmp_path.rglob("*")} - before
    outside = [p for p in written if not (p == run_dir or run_dir in p.parents or p in run_dir.parents)]
    assert not outside, f"written outside the run directory: {outside}"


@pytest.fixture
def gateway_client(redis, redis_server, tmp_path):
    settings = gateway_settings(redis_server.url, tmp_path / "data")
    (settings.dataset_roots[0] / "ok.jsonl").write_text("")
    with TestClient(create_gateway(settings), raise_server_exceptions=False) as client:
        yield client


run_ids = st.text(max_size=30) | st.sampled_from(["..", "../x", "a/b", "%2e%2e", "ok", "a\x00"])
bodies = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {},
        optional={
            "dataset": st.text(max_size=30)
            | json_values
            | st.sampled_from(["ok.jsonl", "../../etc/passwd", "ok\x00.jsonl", "/dev/zero"]),
            "run_id": run_ids | json_values,
            "options": json_values
            | st.fixed_dictionaries({}, optional={"max_tokens": json_values, "overlong": json_values}),
        },
    ),
)


@FUZZ
@given(body=bodies, run_id=run_ids, action=st.sampled_from(["cancel", "retry-failed"]))
def test_fuzzed_run_control_requests_get_an_answer_not_a_crash(gateway_client, body, run_id, action):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    response = gateway_client.post("/runs", json=body, headers=auth)
    assert response.status_code in (202, 404, 409, 422), (body, response.status_code, response.text[:300])
    response = gateway_client.post(f"/runs/{quote(run_id, safe='')}/{action}", headers=auth)
    assert response.status_code < 500, (run_id, response.status_code, response.text[:300])
    assert gateway_client.get(f"/runs/{quote(run_id, safe='')}").status_code < 500


@pytest.fixture(scope="module")
def inference_client(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz-inference")
    engine = ReferenceEngine(tiny_model_dir, device="cpu")
    with TestClient(
        create_inference(engine, Batcher(engine, DumpWriter(folder / "dump"))), raise_server_exceptions=False
    ) as c:
        yield c, folder


generate_bodies = st.fixed_dictionaries(
    {},
    optional={
        "input_ids": st.lists(st.integers(-3, 60_000), max_size=12) | json_values,
        "text": st.text(max_size=30) | json_values,
        "rid": st.sampled_from(["eaglet:r:s:1", "eaglet:../../x:1", "eaglet:a/b:1", "x\x00y", "", ":", "eaglet:r:s:2"])
        | st.text(max_size=20)
        | json_values,
        "sampling_params": json_values
        | st.fixed_dictionaries({}, optional={"max_new_tokens": st.integers(-2, 3), "temperature": json_values}),
    },
)


@FUZZ
@given(body=generate_bodies)
def test_fuzzed_generate_requests_never_crash_the_server_or_escape_the_dump_dir(inference_client, body):
    client, folder = inference_client
    response = client.post("/generate", json=body)
    assert response.status_code in (200, 400, 422), (body, response.status_code, response.text[:300])
    dump = folder / "dump"
    figures = dump / STATS_DIR  # the writer's own figures, named by host and pid, never by a request
    stray = [p for p in folder.rglob("*") if p.parent not in (dump, figures) and p not in (dump, figures)]
    assert not stray, stray


def test_dump_and_sample_paths_never_leave_their_folder():
    from eaglet.shared.dumpfile import dump_path
    from eaglet.shared.ids import UnsafeName
    from eaglet.shared.store import sample_path

    @FUZZ
    @given(name=st.text(max_size=40) | st.sampled_from(["..", "../x", "a/b", "/abs", "a\x00", "ok:..:1"]))
    def check(name):
        makers = ((lambda n: dump_path(Path("/d"), n), Path("/d")),
                  (lambda n: sample_path(Path("/data"), "run", n), Path("/data/runs/run/hidden")))  # fmt: skip
        for make, base in makers:
            try:
                path = make(name)
            except UnsafeName:
                continue
            assert path.resolve().parent in (base, *base.glob("*")) or base in path.resolve().parents, path
            assert "/" not in name and "\x00" not in name and ".." not in name

    check()


def test_a_dataset_path_with_a_nul_byte_is_refused_not_a_crash(gateway_client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    response = gateway_client.post("/runs", json={"dataset": "ok\x00.jsonl"}, headers=auth)
    assert response.status_code == 422, response.text[:300]
