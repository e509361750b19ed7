"""``eaglet status``: the gateway's figures in the terminal, from the same code (``eaglet/shared/status.py``)."""

import argparse
import sys
import time

from redis import Redis
from redis.exceptions import RedisError
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from eaglet.shared.config import StatusSettings
from eaglet.shared.status import (
    Cluster,
    InferenceStatus,
    RunStatus,
    StatusConfig,
    disk_usage,
    read_run,
    read_status,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eaglet status", description="Progress, rates, errors, disk, workers, alerts.")
    p.add_argument("run_id", nargs="?", help="one run; all runs (newest first) when left out")
    p.add_argument("--watch", action="store_true", help="redraw every --interval seconds until Ctrl-C")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between redraws (default 2)")
    p.add_argument("--json", action="store_true", help="print the same JSON as GET /status or /runs/{id}")
    p.add_argument("--redis-url", help="default: EAGLET_REDIS_URL")
    p.add_argument("--limit", type=int, default=10, help="most runs shown (default 10)")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error("--interval must be > 0")
    return args


def _bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def _duration(s: float | None) -> str:
    if s is None:
        return "–"
    h, rest = divmod(int(s), 3600)
    return f"{h}h {rest // 60}m" if h else f"{rest // 60}m {rest % 60}s"


def _bar(percent: float | None) -> ProgressBar:
    return ProgressBar(total=100, completed=percent or 0, width=40)


def render_run(run: RunStatus) -> Panel:
    ex, st, tr = run.extraction, run.storage, run.training
    grid = Table.grid(padding=(0, 1))
    if (rg := run.regeneration) is not None:
        pct = f"{rg.percent:.1f} %" if rg.percent is not None else "–"
        grid.add_row("regeneration", _bar(rg.percent), f"{rg.done:,} done, {rg.failed:,} failed of "
                     f"{rg.total if rg.total is not None else '?'} prompts ({pct})")  # fmt: skip
        rates = f"{rg.tokens_out_per_s:,.0f} tokens/s out, ETA {_duration(rg.eta_s)}"
        tokens = f"tokens in {rg.tokens_in:,} / out {rg.tokens_out:,}, {rg.retries} retries"
        grid.add_row("", f"{rg.prompts_per_s:.2f} prompts/s", f"{rates}, {tokens}")
    pct = f"{ex.percent:.1f} %" if ex.percent is not None else "–"
    grid.add_row("extraction", _bar(ex.percent), f"{ex.done:,} done, {ex.failed:,} failed of {ex.total or '?'} ({pct})")
    grid.add_row(
        "rate",
        f"{ex.samples_per_s:.2f} samples/s",
        f"{ex.tokens_per_s:,.0f} tokens/s, ETA {_duration(ex.eta_s)}, {ex.in_flight} in flight, "
        f"error rate {'–' if ex.error_rate is None else f'{ex.error_rate:.1%}'}",
    )
    grid.add_row(
        "storage",
        _bytes(st.bytes_written),
        f"{_bytes(st.bytes_per_token)}/token, projected {_bytes(st.projected_total_bytes)}, "
        f"free {_bytes(st.disk_free)}",
    )
    if tr.step is not None:
        grid.add_row(
            "training",
            _bar(tr.percent),
            f"step {tr.step:,}/{tr.total_steps or '?'}, loss {tr.loss}, acc {tr.accuracy}, ETA {_duration(tr.eta_s)}",
        )
    if run.evaluation:
        grid.add_row("evaluation", "", ", ".join(f"{k} {v}" for k, v in run.evaluation.items()))
    for e in ex.last_errors[:5]:
        grid.add_row(Text("error", style="red"), e.sample_id, Text(e.reason, overflow="ellipsis"))
    for a in run.alerts:
        grid.add_row(Text("ALERT", style="bold white on red"), a.kind, a.message)
    title = f"{run.run_id} [bold]{run.stage}[/]" + (f" [red]{run.error}[/]" if run.error else "")
    return Panel(grid, title=title, title_align="left")


def render_cluster(cluster: Cluster) -> Group:
    table = Table("worker", "state", "run", "sample", "heartbeat", "s a sample: server / check / store",
                  title="workers", title_justify="left")  # fmt: skip
    for w in cluster.workers:
        state = Text(f"lost ({w.state})", style="bold red") if w.lost else w.state
        st = w.stage_seconds
        stages = f"{st['prefill']:.2f} / {st['check']:.2f} / {st['store']:.2f}" if "store" in st else ""
        table.add_row(w.name, state, w.run, w.sample, f"{w.seconds_since_heartbeat:.1f} s ago", stages)
    servers = Table("host", "inference server", "health", "model", "extraction", "detail",
                    title="inference servers", title_justify="left")  # fmt: skip
    for s in cluster.inference:
        detail = s.detail
        if s.dump_backpressure is not None:  # the share of the recent time its forwards waited for the dump folder
            detail += f" · dumps wait {s.dump_backpressure:.0%}"
        rate = f"{s.tokens_per_s:,.0f} tok/s, {s.samples_per_s:.2f} samples/s, {s.workers} worker(s)"
        servers.add_row(s.host, s.url, "healthy" if s.healthy else Text("down", style="red"), server_model(s), rate,
                        detail)  # fmt: skip
    return Group(table, servers)


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


def snapshot(redis: Redis, args: argparse.Namespace, config: StatusConfig, disk) -> tuple[object, Group | None]:
    """The report (for --json) and its rendering; the rendering is None if the run is unknown."""
    if args.run_id:
        report = read_run(redis, args.run_id, config=config, local_disk=disk)
        if report is None:
            return None, None
        return report, Group(render_run(report.run), render_cluster(report.cluster))
    report = read_status(redis, config=config, limit=args.limit, local_disk=disk)
    runs = [render_run(r) for r in report.runs] or [Text("no run yet")]
    return report, Group(*runs, render_cluster(report.cluster))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = StatusSettings()
    redis = Redis.from_url(args.redis_url or settings.redis_url, decode_responses=True)
    config, console = settings.status_config(), Console()
    disk = disk_usage(settings.data_dir)
    try:
        report, view = snapshot(redis, args, config, disk)
        if report is None:
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
