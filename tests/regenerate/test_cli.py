"""``eaglet regenerate`` as a user runs it: the run created and its planning queued as the gateway queues it (an
ingest worker plans it), a worker answering, ``--wait`` following it to the file; bad flags and a taken run id
refused with the reason."""

import json

import pytest

from eaglet.cli import main as cli
from eaglet.cli.stack import LocalStack
from eaglet.services.regenerate import main as regenerate_main
from eaglet.shared.layout import Layout
from eaglet.shared.records import Stage
from eaglet.shared.runstate import RunState
from tests.regenerate.conftest import start_workers, write_jsonl
from tests.reliability.helpers import env_of


def test_regenerate_waits_for_its_file(redis, settings, tmp_path, monkeypatch, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": "c1", "prompt": "Hi"}, {"id": "c2", "prompt": "Bye"}])
    for name, value in env_of(settings).items():
        monkeypatch.setenv(name, value)
    with LocalStack(tmp_path / "logs") as stack:
        start_workers(stack, settings, ["w0"])
        stack.start("ingest", "eaglet.services.ingest.worker", "--name", "ingest", env=env_of(settings))
        argv = ["regenerate", str(source), "--run", "cli", "--max-new-tokens", "6", "--stop-after", "--wait"]
        assert cli.main(argv) == 0
    out = capsys.readouterr().out
    meta = RunState(redis, "cli").meta()
    assert meta.stage == Stage.done and f"regenerated conversations: {meta.dataset}" in out
    with open(meta.dataset) as f:
        assert [json.loads(line)["id"] for line in f] == ["c1", "c2"]
    assert cli.main(["regenerate", str(source), "--run", "cli"]) == 2
    assert "exists already" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--top-p", "0"], "top_p=0.0"),
        (["--api-key-env", "sk-abc def"], "NAME of an environment variable"),
        (["--endpoint", "ftp://x"], "http:// or https://"),
    ],
)
def test_bad_settings_are_refused_before_any_run(redis, tmp_path, capsys, flags, reason):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hi"}])
    with pytest.raises(SystemExit):
        cli.main(["regenerate", str(source), "--run", "bad", *flags])
    assert reason in capsys.readouterr().err and not RunState(redis, "bad").exists()


def test_regenerate_takes_ingest_storage_flags(tmp_path):
    args = regenerate_main.parse_args([str(tmp_path / "in.jsonl"), "--run", "r", "--store-final", "all",
                                       "--store-aux", "full", "--store-dtype", "fp8"])  # fmt: skip
    assert (args.options.layout(), args.options.store_dtype) == (Layout(), "fp8")
