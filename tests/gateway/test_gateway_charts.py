"""The page's charts in a real headless Chromium during a real run: the reference server on the tiny Llama, two RQ
workers in their own processes, then the trainer and the evaluation. What the charts plot is read back off the page
and checked against the series endpoint and the status figures of the same moment."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from eaglet.cli.stack import LocalStack
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.evaluate import evaluate_run
from eaglet.services.trainer.train import train
from eaglet.shared.config import Settings
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.series import mean_stage_seconds
from eaglet.shared.status import read_run
from tests.conftest import ROOT
from tests.gateway.test_gateway_page import Collect, chromium, read_png

RUN = "charts"
ORANGE = (0xE8, 0x59, 0x0C)  # the samples/s line: no other part of the page has it
EXTRACTION_CHARTS = {"throughput", "outcomes", "stages", "disk"}
TRAINING_CHARTS = {"loss", "accuracy", "train-throughput"}


def write_dataset(path: Path, n: int) -> None:
    rows = [{"id": f"s{i}", "input_ids": [(7 * i + j) % 400 + 20 for j in range(24 + i % 17)],
             "loss_mask": [0] * 6 + [1] * (18 + i % 17)} for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def charts_on_page(url: str, profile: Path) -> tuple[dict[str, list], str]:
    """Each chart's plotted arrays ([x, y1, y2, ...]) as the page holds them, and the page's text."""
    page = Collect()
    page.feed(chromium(url, profile, "--dump-dom").stdout)
    charts = {a["data-chart"]: json.loads(a["data-series"]) for a in page.attrs if "data-series" in a}
    return charts, " ".join(page.text)


def pixels_of(path: Path, color: tuple[int, int, int]) -> int:
    _, bpp, rows = read_png(path)
    return sum(tuple(row[x : x + 3]) == color for row in rows for x in range(0, len(row), bpp))


def wait(condition, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return value


@pytest.mark.slow
def test_charts_plot_the_status_figures_mid_run_and_after_training(
    start_gateway, redis, redis_server, reference_server, tmp_path
):
    gateway = start_gateway(series_interval_s=0.5, heartbeat_interval_s=5)  # frozen workers stay live
    settings = Settings(redis_url=redis_server.url, data_dir=gateway.settings.data_dir,
                        dump_dir=reference_server.dump_dir, model=str(reference_server.model_dir),
                        inference_url=reference_server.url)  # fmt: skip
    env = {f"EAGLET_{k.upper()}": str(getattr(settings, k)) for k in ("redis_url", "data_dir", "dump_dir", "model")}
    write_dataset(tmp_path / "data.jsonl", 160)
    client, page = gateway.client(), f"{gateway.url}/?interval=0.5"
    shots = tmp_path
    with LocalStack(
        tmp_path / "logs",
        env={**env, "EAGLET_INFERENCE_URL": settings.inference_url, "EAGLET_HEARTBEAT_INTERVAL_S": "0.5"},
    ) as stack:
        workers = [stack.start(f"worker-{i}", "eaglet.services.extractor.worker", "--name", f"w{i}") for i in range(2)]
        ingest_new_run(redis, settings, RUN, tmp_path / "data.jsonl", RunOptions())
        state = RunState(redis, RUN)
        wait(lambda: 30 <= state.counts().done + state.counts().failed, "no progress", timeout=180)
        config = gateway.settings.status_config()
        wait(
            lambda: all(w.stage_seconds for w in read_run(redis, RUN, config=config).cluster.workers), "no stage times"
        )
        for proc in workers:  # frozen mid-run, heartbeats and all: nothing moves until they go on
            os.kill(proc.pid, signal.SIGSTOP)
        frozen_at = time.time()
        try:
            point = wait(lambda: [p for p in client.get(f"/runs/{RUN}/series").json()["extraction"]["points"]
                                  if p["t"] > frozen_at + 0.1], "no point after the pause")[0]  # fmt: skip
            status = read_run(redis, RUN, config=config, now=point["t"])
            ex, st = status.run.extraction, status.run.storage
            assert 0 < ex.done + ex.failed < 160
            assert (point["done"], point["failed"], point["samples_per_s"], point["tokens_per_s"]) == (
                ex.done, ex.failed, ex.samples_per_s, ex.tokens_per_s)  # fmt: skip
            assert (point["bytes_written"], point["projected_total_bytes"]) == (
                st.bytes_written,
                st.projected_total_bytes,
            )
            assert point["stage_seconds"] == mean_stage_seconds(RUN, status.cluster.workers)
            # the rate at the pause itself may be cut to 0 by a gap between the last completions on a loaded machine
            # (status.py's stall rule); the series before it has measured one
            series = client.get(f"/runs/{RUN}/series").json()["extraction"]["points"]
            assert point["stage_seconds"]["prefill"] > 0 and any(p["tokens_per_s"] > 0 for p in series)

            charts, text = charts_on_page(page, tmp_path / "profile-mid")
            chromium(page, tmp_path / "profile-mid-shot", f"--screenshot={shots / 'charts-mid-run.png'}",
                     "--window-size=1280,1500")  # fmt: skip
        finally:
            for proc in workers:
                os.kill(proc.pid, signal.SIGCONT)
        assert set(charts) == EXTRACTION_CHARTS  # no training yet, no evaluation
        # What the page plots is the recorded series, point for point, and its newest point is the status now.
        recorded = {p["t"]: p for p in client.get(f"/runs/{RUN}/series").json()["extraction"]["points"]}
        t, (tps, sps), (done, failed) = charts["throughput"][0], charts["throughput"][1:], charts["outcomes"][1:]
        assert len(t) >= 2 and set(t) <= set(recorded)
        assert [(recorded[x]["tokens_per_s"], recorded[x]["samples_per_s"]) for x in t] == list(
            zip(tps, sps, strict=True)
        )
        assert [(recorded[x]["done"], recorded[x]["failed"]) for x in t] == list(zip(done, failed, strict=True))
        assert f"{ex.done} done, {ex.failed} failed of 160" in text and (done[-1], failed[-1]) == (ex.done, ex.failed)
        assert charts["disk"][1][-1] == st.bytes_written and charts["disk"][2][-1] == st.projected_total_bytes
        assert charts["stages"][1][-1] == pytest.approx(point["stage_seconds"]["prefill"])
        assert pixels_of(shots / "charts-mid-run.png", ORANGE) > 50  # the samples/s line is drawn

        wait(state.extraction_complete, "extraction did not complete", timeout=180)
    torch.set_num_threads(1)
    cfg = TrainConfig(ttt_steps=2, draft_vocab_size=256, tokens_per_batch=400, loader_workers=0, max_steps=12,
                      log_every=2, checkpoint_every=1000, heldout_fraction=0.1)  # fmt: skip
    train(
        redis=redis, run_id=RUN, data_dir=settings.data_dir, target_dir=reference_server.model_dir, cfg=cfg, env=Dist()
    )
    evaluate_run(redis=redis, run_id=RUN, data_dir=settings.data_dir, target_dir=reference_server.model_dir,
                 prompts=ROOT / "data" / "demo" / "eval.jsonl", k=2, max_new_tokens=8, num_prompts=2)  # fmt: skip

    charts, _ = charts_on_page(page, tmp_path / "profile-after")
    chromium(page, tmp_path / "profile-after-shot", f"--screenshot={shots / 'charts-after-training.png'}",
             "--window-size=1280,1500")  # fmt: skip
    run = client.get(f"/runs/{RUN}").json()["run"]
    training, evaluation = run["training"], run["evaluation"]
    assert set(charts) == EXTRACTION_CHARTS | TRAINING_CHARTS | {"acceptance"}
    steps, losses = charts["loss"]
    assert steps == list(range(2, 13, 2)) and losses[-1] == training["loss"]
    assert [series[-1] for series in charts["accuracy"][1:]] == training["accuracy_per_position"]
    assert charts["train-throughput"][1][-1] == training["tokens_per_s"]
    assert charts["acceptance"] == [[1, 2], json.loads(evaluation["accept_rate"])]
    assert charts["outcomes"][1][-1] + charts["outcomes"][2][-1] == 160  # the extraction's final point
