"""``eaglet status``: the gateway's figures in the terminal, from the same code (``shared/status.py``)."""

import argparse
import sys
import time

from redis import Redis
from redis.exceptions import RedisError
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from eaglet.shared import statustext as words
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.config import StatusSettings
from eaglet.shared.connections import connect
from eaglet.shared.records import FINISHED_STAGES
from eaglet.shared.status import disk_usage, read_run, read_status
from eaglet.shared.statusreport import Cluster, InferenceStatus, RunReport, RunStatus, StatusReport


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eaglet status", description="Progress, rates, errors, disk, workers, alerts.")
    p.add_argument("run_id", nargs="?", help="one run; all runs (newest first) when left out")
    p.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default 2)")
    p.add_argument("--json", action="store_true", help="print the same JSON as GET /status or /runs/{id}")
    p.add_argument("--brief", action="store_true", help="one line per active run: progress, rates, errors, disk, "
                   "ETA, GPUs and a verdict")  # fmt: skip
    p.add_argument("--redis-url", help="default: EAGLET_REDIS_URL")
    p.add_argument("--limit", type=int, default=10, help="most runs shown (default 10)")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error("--interval must be > 0")
    return args


def _bar(percent: float | None) -> ProgressBar:
    return ProgressBar(total=100, completed=percent or 0, width=24)


def render_run(run: RunStatus) -> Panel:
    """The run's lines of words (``RunStatus.lines``), a bar beside each stage that has a percent."""
    percents = {"extraction": run.extraction.percent, "training": run.training.percent}
    if run.regeneration is not None:
        percents["regeneration"] = run.regeneration.percent
    grid = Table.grid(padding=(0, 1))
    for stage, line in run.lines.items():
        grid.add_row(stage, _bar(percents[stage]) if stage in percents else "", Text(line))  # text, not markup
    for e in run.extraction.last_errors[:5]:
        grid.add_row(Text("error", style="red"), e.sample_id, Text(e.reason, overflow="ellipsis"))
    for a in run.alerts:
        grid.add_row(Text("ALERT", style="bold white on red"), a.kind, a.message)
    verdict = f" · {escape(run.verdict)}" if run.verdict != run.stage else ""
    title = f"{run.run_id} [bold]{run.stage}[/]{verdict}"
    return Panel(grid, title=title, title_align="left")


def render_cluster(cluster: Cluster, now: float) -> Group:
    table = Table("worker", "state", "run", "sample", "heartbeat", "s a sample: server / check / store",
                  title="workers", title_justify="left")  # fmt: skip
    for w in cluster.workers:
        state = Text(f"lost ({w.state})", style="bold red") if w.lost else w.state
        st = w.stage_seconds
        stages = f"{st['prefill']:.2f} / {st['check']:.2f} / {st['store']:.2f}" if "store" in st else ""
        table.add_row(w.name, state, w.run, w.sample, f"{words.duration(w.seconds_since_heartbeat)} ago", stages)
    if not cluster.workers:
        table.add_row("no worker reports", "", "", "", "", "")
    parts: list = [table]
    if cluster.workers_gone:
        parts.append(Text(f"lost: {cluster.workers_gone} more, silent for longer (not listed)", style="dim"))
    servers = Table("host", "inference server", "health", "model", "extraction", "detail",
                    title="inference servers", title_justify="left")  # fmt: skip
    for s in cluster.inference:
        detail = s.detail
        if s.dump_backpressure is not None:  # the share of the recent time its forwards waited for the dump folder
            detail += f" · dumps wait {s.dump_backpressure:.0%}"
        rate = f"{words.figure(s.tokens_per_s)} tok/s, {words.figure(s.samples_per_s)} samples/s, {s.workers} worker(s)"
        health = "healthy" if s.healthy else Text(f"down ({server_age(s)})", style="red")
        servers.add_row(s.host, s.url, health, server_model(s), rate, detail)
    if not cluster.inference:
        servers.add_row("", "no server in service", "", "", "", "")
    parts.append(servers)
    if cluster.inference_gone:
        gone = ", ".join(f"{s.host} {s.url} (last report {words.clock(now - s.seconds_since_report, now)})"
                         for s in cluster.inference_gone)  # fmt: skip
        parts.append(Text(f"out of service (no worker uses it, or no run needs it): {gone}", style="dim"))
    parts.append(render_gpus(cluster))
    return Group(*parts)


def server_age(s: InferenceStatus) -> str:
    return f"reported {words.duration(s.seconds_since_report)} ago"


def render_gpus(cluster: Cluster) -> Table:
    """Each GPU of each reporting host: how busy, how full; one row saying why where they are unknown."""
    table = Table("host", "used by", "GPU", "busy", "memory", "reported", title="GPUs", title_justify="left")
    for h in cluster.gpus:
        who = f"{h.role} {h.run}".strip()
        age = f"{words.duration(h.seconds_since_report)} ago"
        if h.gpus is None:
            table.add_row(h.host, who, f"unknown: {h.detail}", "", "", age)
        for g in h.gpus or []:
            memory = f"{words.size(g.memory_used)} / {words.size(g.memory_total)}"
            table.add_row(h.host, who, f"{g.index} {g.name}", words.percent(g.utilization), memory, age)
    if not cluster.gpus:
        table.add_row("", "", "no inference supervisor or trainer reports its GPUs", "", "", "")
    return table


def server_model(s: InferenceStatus) -> str:
    """The server's model, hidden size and captured layers, as far as they are known."""
    parts = [s.model or "model ?"]
    if s.hidden_size is not None:
        parts.append(f"hidden {s.hidden_size}")
    if s.num_layers is not None:
        parts.append(f"{s.num_layers} layers")
    if s.aux_layer_ids is not None:
        parts.append(f"captures {s.aux_layer_ids}")
    return ", ".join(parts)


def brief_lines(runs: list[RunStatus]) -> list[str]:
    """One line per run that is not finished; the newest run's when all are (what it did, and ``done``)."""
    active = [r for r in runs if r.stage not in FINISHED_STAGES]
    return [r.brief for r in active or runs[:1]] or ["no run yet"]


def snapshot(
    redis: Redis, args: argparse.Namespace, config: StatusConfig, disk: tuple[int, int] | None
) -> tuple[StatusReport | RunReport | None, RenderableType | None]:
    """The report (for --json) and its rendering; the rendering is None if the run is unknown."""
    if args.run_id:
        report = read_run(redis, args.run_id, config=config, local_disk=disk)
        if report is None:
            return None, None
        if args.brief:
            return report, Text(report.run.brief)
        return report, Group(render_run(report.run), render_cluster(report.cluster, report.generated_at))
    report = read_status(redis, config=config, limit=args.limit, local_disk=disk)
    if args.brief:
        return report, Text("\n".join(brief_lines(report.runs)))
    runs: list[RenderableType] = [render_run(r) for r in report.runs] or [Text("no run yet")]
    return report, Group(*runs, render_cluster(report.cluster, report.generated_at))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = StatusSettings()
    redis = connect(args.redis_url or settings.redis_url)
    config, console = settings.status_config(), Console(soft_wrap=args.brief)  # a brief line stays one line
    disk = disk_usage(settings.data_dir)
    try:
        report, view = snapshot(redis, args, config, disk)
        if report is None or view is None:
            print(f"no run {args.run_id!r}", file=sys.stderr)
            return 1
        if args.json:
            print(report.model_dump_json(indent=2))
            return 0
        if not args.watch:
            console.print(view)
            return 0
        with Live(view, console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(snapshot(redis, args, config, disk)[1] or Text("run gone"), refresh=True)
    except KeyboardInterrupt:
        return 0
    except RedisError as e:
        print(f"cannot read run state from Redis: {e}; check --redis-url or EAGLET_REDIS_URL", file=sys.stderr)
        return 2
    finally:
        redis.close()


if __name__ == "__main__":
    sys.exit(main())
