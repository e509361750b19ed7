"""Prometheus figures, read from Redis at each scrape through the same code as ``/status``."""

import json
from collections.abc import Callable, Iterator
from typing import get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis import Redis

from eaglet.shared.alerts import StatusConfig
from eaglet.shared.runstate import Stage
from eaglet.shared.status import read_status
from eaglet.shared.statusreport import AlertKind, StatusReport

ALERT_KINDS: tuple[AlertKind, ...] = get_args(AlertKind)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"eaglet_{name}", doc, labels=labels)


class StatusCollector(Collector):
    """No state of its own: every scrape reads the newest ``max_runs`` runs, so any replica answers the same."""

    def __init__(
        self, redis: Redis, config: StatusConfig, max_runs: int, local_disk: Callable[[], tuple[int, int] | None]
    ):
        self.redis = redis
        self.config = config
        self.max_runs = max_runs
        self.local_disk = local_disk

    def collect(self) -> Iterator[Metric]:
        report = read_status(self.redis, config=self.config, limit=self.max_runs, local_disk=self.local_disk())
        yield from _run_metrics(report)
        yield from _cluster_metrics(report)

    def describe(self) -> list[Metric]:
        return []  # don't read Redis at registration


def _run_metrics(report: StatusReport) -> Iterator[Metric]:
    run = ["run"]
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
        "done": CounterMetricFamily("eaglet_samples_done", "Samples extracted and stored", labels=run),
        "failed": CounterMetricFamily("eaglet_samples_failed", "Samples given up", labels=run),
        "errors": CounterMetricFamily("eaglet_errors", "Errors recorded, transient ones included", labels=run),
        "retries": CounterMetricFamily("eaglet_retries", "Sample attempts after the first", labels=run),
        "tokens": CounterMetricFamily("eaglet_tokens_written", "Tokens of stored samples", labels=run),
        "bytes": CounterMetricFamily("eaglet_bytes_written", "Bytes of stored samples", labels=run),
        "total": _gauge("samples", "Samples in the run", run),
        "in_flight": _gauge("samples_in_flight", "Samples being extracted now", run),
        "sps": _gauge("samples_per_second", "Completions per second over the recent window", run),
        "tps": _gauge("tokens_per_second", "Tokens per second over the recent window", run),
        "eta": _gauge("extraction_eta_seconds", "Estimated seconds to the end of extraction", run),
        "error_rate": _gauge("error_rate", "Failed samples over samples with an outcome", run),
        "projected": _gauge("projected_bytes", "Projected bytes of the whole run", run),
        "stage": _gauge("stage", "1 for the run's current stage", ["run", "stage"]),
        "alert": _gauge("alert", "1 while the alert is raised", ["run", "kind"]),
        "step": _gauge("train_step", "Trainer step", run),
        "steps": _gauge("train_total_steps", "Trainer steps in all", run),
        "loss": _gauge("train_loss", "Trainer loss", run),
        "acc": _gauge("train_accuracy", "Trainer accuracy", run),
        "train_tps": _gauge("train_tokens_per_second", "Trainer tokens per second", run),
        "train_eta": _gauge("train_eta_seconds", "Estimated seconds to the end of training", run),
        "acc_pos": _gauge(
            "train_accuracy_position", "Trainer accuracy of each draft position (1 = the first)", ["run", "position"]
        ),  # fmt: skip
        "accept_length": _gauge("eval_accept_length", "Mean acceptance length of the evaluation", run),
        "accept_rate": _gauge(
            "eval_accept_rate", "Acceptance rate of each draft position in the evaluation", ["run", "position"]
        ),  # fmt: skip
        "rg_done": CounterMetricFamily("eaglet_regen_prompts_done", "Prompts regenerated", labels=run),
        "rg_failed": CounterMetricFamily("eaglet_regen_prompts_failed", "Prompts given up", labels=run),
        "rg_retries": CounterMetricFamily("eaglet_regen_retries", "Requests tried again (429, 5xx)", labels=run),
        "rg_in": CounterMetricFamily("eaglet_regen_tokens_in", "Prompt tokens sent to the endpoint", labels=run),
        "rg_out": CounterMetricFamily("eaglet_regen_tokens_out", "Tokens the target wrote", labels=run),
        "rg_total": _gauge("regen_prompts", "Prompts to regenerate", run),
        "rg_pps": _gauge("regen_prompts_per_second", "Prompts regenerated per second, recent window", run),
        "rg_tps": _gauge("regen_tokens_out_per_second", "Tokens written per second, recent window", run),
        "rg_eta": _gauge("regen_eta_seconds", "Estimated seconds to the end of regeneration", run),
    }
    for r in report.runs:
        ex, st, tr, label = r.extraction, r.storage, r.training, [r.run_id]
        values = {
            "done": ex.done, "failed": ex.failed, "errors": ex.errors, "retries": ex.retries,
            "tokens": st.tokens_written, "bytes": st.bytes_written, "total": ex.total, "in_flight": ex.in_flight,
            "sps": ex.samples_per_s, "tps": ex.tokens_per_s, "eta": ex.eta_s, "error_rate": ex.error_rate,
            "projected": st.projected_total_bytes, "step": tr.step, "steps": tr.total_steps, "loss": tr.loss,
            "acc": tr.accuracy, "train_tps": tr.tokens_per_s, "train_eta": tr.eta_s,
            "accept_length": _number(r.evaluation.get("accept_length")),
        }  # fmt: skip
        if (rg := r.regeneration) is not None:
            values |= {
                "rg_done": rg.done, "rg_failed": rg.failed, "rg_retries": rg.retries, "rg_in": rg.tokens_in,
                "rg_out": rg.tokens_out, "rg_total": rg.total, "rg_pps": rg.prompts_per_s,
                "rg_tps": rg.tokens_out_per_s, "rg_eta": rg.eta_s,
            }  # fmt: skip
        for key, value in values.items():
            if value is not None:  # an unknown figure is absent, not 0: 0 would read as a real ETA or loss
                families[key].add_metric(label, value)
        for i, acc in enumerate(tr.accuracy_per_position or [], start=1):
            families["acc_pos"].add_metric([r.run_id, str(i)], acc)
        for i, rate in enumerate(_accept_rates(r.evaluation), start=1):
            families["accept_rate"].add_metric([r.run_id, str(i)], rate)
        for stage in Stage:
            families["stage"].add_metric([r.run_id, stage], float(r.stage == stage))
        raised = {a.kind for a in r.alerts}
        for kind in ALERT_KINDS:
            families["alert"].add_metric([r.run_id, kind], float(kind in raised))
    return iter(families.values())


def _number(value: float | str | None) -> float | None:
    return value if isinstance(value, float) else None


def _accept_rates(evaluation: dict[str, float | str]) -> list[float]:
    """The per-position rates, which the status keeps as the JSON text the evaluation wrote."""
    text = evaluation.get("accept_rate")
    rates = json.loads(text) if isinstance(text, str) else []
    return [float(r) for r in rates] if isinstance(rates, list) else []


def _cluster_metrics(report: StatusReport) -> Iterator[Metric]:
    c = report.cluster
    beat = _gauge("worker_heartbeat_age_seconds", "Seconds since the worker's heartbeat", ["worker", "state"])
    lost = _gauge("worker_lost", "1 if the worker's heartbeat is too old", ["worker"])
    stages = _gauge("worker_stage_seconds", "Mean seconds of each stage of the worker's recent samples",
                    ["worker", "stage"])  # fmt: skip
    for w in c.workers:
        beat.add_metric([w.name, w.state], w.seconds_since_heartbeat)
        lost.add_metric([w.name], float(w.lost))
        for stage, seconds in w.stage_seconds.items():
            stages.add_metric([w.name, stage], seconds)
    server = ["host", "url"]  # on several hosts one URL names a server on each
    up = _gauge("inference_up", "1 if the inference server answered lately", server)
    pressure = _gauge("inference_dump_backpressure", "Share of the recent time the server's forwards waited "
                      "for its dump writer", server)  # fmt: skip
    queued = _gauge(
        "inference_dump_queued_bytes", "Bytes of dumps the server holds waiting for its dump folder", server
    )
    rate = _gauge("inference_extraction_tokens_per_second", "Tokens its live workers stored per second", server)
    for s in c.inference:
        up.add_metric([s.host, s.url], float(s.healthy))
        rate.add_metric([s.host, s.url], s.tokens_per_s)
        if s.dump_backpressure is not None:
            pressure.add_metric([s.host, s.url], s.dump_backpressure)
        if s.dump_queued_bytes is not None:
            queued.add_metric([s.host, s.url], s.dump_queued_bytes)
    gpu = ["host", "role", "gpu"]
    busy = _gauge("gpu_utilization_percent", "Share of the last sample period a kernel ran on the GPU (NVML)", gpu)
    used = _gauge("gpu_memory_used_bytes", "GPU memory in use (NVML)", gpu)
    for h in (h for h in c.gpus if h.live and h.gpus):  # a report gone stale says nothing of now
        for g in h.gpus:
            if g.utilization is not None:
                busy.add_metric([h.host, h.role, str(g.index)], g.utilization)
            if g.memory_used is not None:
                used.add_metric([h.host, h.role, str(g.index)], g.memory_used)
    workers = _gauge("workers", "Workers by liveness", ["liveness"])
    workers.add_metric(["live"], c.workers_live)
    workers.add_metric(["lost"], c.workers_lost)
    runs = _gauge("runs", "Runs registered", [])
    runs.add_metric([], report.runs_total)
    yield from (beat, lost, stages, up, pressure, queued, rate, busy, used, workers, runs)
    if c.disk_free is not None:
        yield GaugeMetricFamily("eaglet_disk_free_bytes", "Free bytes on the data volume", value=c.disk_free)
    if c.disk_total is not None:
        yield GaugeMetricFamily("eaglet_disk_total_bytes", "Size of the data volume", value=c.disk_total)
