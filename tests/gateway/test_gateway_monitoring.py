"""The Grafana dashboard of docker/monitoring/ asks only for what the gateway's /metrics exports: every metric its
PromQL names, with the labels it filters, groups and names series by, as a real gateway scrapes a run in Redis."""

import json
import re
import time
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from eaglet.shared.dumpwriter import WriterStats
from eaglet.shared.heartbeats import WorkerState, beat, report_inference
from eaglet.shared.records import EvalResult, TrainProgress

MONITORING = Path(__file__).resolve().parents[2] / "docker" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "eaglet.json"
IDENT = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool"}


def exported(url_client) -> dict[str, set[str]]:
    """Sample name -> its label names, as a scrape of /metrics gives them."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(url_client.get("/metrics").text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def parse(expr: str) -> tuple[set[str], set[str]]:
    """The metric names a PromQL expression reads, and every label name it uses (in matchers, by/on clauses)."""
    labels = {m.group(1) for m in re.finditer(rf"({IDENT})\s*(?:=~|!~|!=|=)\s*\"", expr)}
    for clause in re.finditer(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in clause.group(1).split(",") if x.strip()}
    bare = re.sub(r"\"[^\"]*\"", "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    metrics = {m.group(1) for m in re.finditer(rf"(?<![\w:])({IDENT})(?![\w:])(?!\s*\()", bare)} - KEYWORDS
    return metrics, labels


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, PromQL, legend) of every panel's targets."""
    return [
        (p["title"], t["expr"], t.get("legendFormat", "")) for p in dashboard["panels"] for t in p.get("targets", [])
    ]


def test_parse_finds_the_metrics_and_labels_of_an_expression():
    metrics, labels = parse(
        'avg by (stage) (x_total{stage=~"a|b", run="$run"} and on (worker) y_lost == 0) / rate(z[5m])'
    )
    assert metrics == {"x_total", "y_lost", "z"} and labels == {"stage", "run", "worker"}


def test_every_dashboard_query_names_exported_metrics_and_labels(gateway, redis, fake_run):
    fake = fake_run("r1", total=30)
    fake.ingest()
    fake.start()
    while fake.truth.done < 5:
        time.sleep(0.02)
    fake.state.update_train(
        TrainProgress(step=4, total_steps=8, loss=2.5, acc=[0.5, 0.25], tokens_per_s=900.0, eta_s=30)
    )
    fake.state.update_eval(EvalResult(state="done", accept_length=1.6, accept_rate=[0.45, 0.15]))
    beat(redis, "w-timed", state=WorkerState.busy, host="h", pid=2, inference_url="http://inf:1", run="r1",
         stage_seconds={"prefill": 0.4, "dump_wait": 0.0, "check": 0.01, "store": 0.1})  # fmt: skip
    writer = WriterStats(ts=time.time(), cap_bytes=2**30, queued_bytes=0, peak_bytes=0, waited_s=0.0,
                         wait_fraction=0.0, written=3, failed=0, threads=2)  # fmt: skip
    report_inference(redis, "http://inf:2", ok=True, host="h", model="tiny", writers=[writer])
    names = exported(gateway.client())

    dashboard = json.loads(DASHBOARD.read_text())
    checked = queries(dashboard)
    assert len(checked) >= 15
    for title, expr, legend in checked:
        metrics, labels = parse(expr)
        assert metrics, (title, expr)
        assert metrics <= set(names), f"panel {title!r} reads {sorted(metrics - set(names))}, not exported"
        offered = set().union(*(names[m] for m in metrics))
        assert labels <= offered, f"panel {title!r} uses labels {sorted(labels - offered)} its metrics lack"
        assert set(re.findall(r"\{\{(\w+)\}\}", legend)) <= offered, (title, legend)
    # The run picker, and the panels the page draws too: the same figures in Grafana.
    [variable] = dashboard["templating"]["list"]
    metric, label = re.fullmatch(rf"label_values\(({IDENT}), ({IDENT})\)", variable["query"]["query"]).groups()
    assert label in names[metric]
    read = set().union(*(parse(expr)[0] for _, expr, _ in checked))
    page = {"eaglet_tokens_per_second", "eaglet_samples_per_second", "eaglet_samples_done_total",
            "eaglet_samples_failed_total", "eaglet_worker_stage_seconds", "eaglet_bytes_written_total",
            "eaglet_projected_bytes", "eaglet_train_loss", "eaglet_train_accuracy_position",
            "eaglet_train_tokens_per_second", "eaglet_eval_accept_rate"}  # fmt: skip
    assert page <= read
    # Per position, as the page shows them.
    assert names["eaglet_train_accuracy_position"] == names["eaglet_eval_accept_rate"] == {"run", "position"}


def test_the_dashboard_reads_the_provisioned_datasource():
    [source] = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    dashboard = json.loads(DASHBOARD.read_text())
    used = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    used |= {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert used == {source["uid"]} and dashboard["templating"]["list"][0]["datasource"]["uid"] == source["uid"]
