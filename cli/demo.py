"""``eaglet demo``: the whole job on the bundled SmolLM2-135M-Instruct, on this machine.

Starts Redis (if none answers), the reference inference server and two extractor workers as local
processes, ingests the demo conversations, extracts every sample's hidden states, then trains a
drafter and measures its acceptance length. Ends by saying where everything is.
"""

import argparse
import time
from pathlib import Path

from redis import Redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from cli.stack import LocalStack
from services.ingest.ingest import IngestOptions
from services.ingest.jobs import start_run
from shared.config import Settings
from shared.runstate import RunState, Stage
from shared.store import hidden_dir, run_dir

ROOT = Path(__file__).resolve().parents[1]
DEMO_TRAIN = ROOT / "data" / "demo" / "train.jsonl"
DEMO_EVAL = ROOT / "data" / "demo" / "eval.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglet demo", description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--limit", type=int, help="use only the first N conversations")
    parser.add_argument("--port", type=int, default=30000, help="the inference server's port")
    args = parser.parse_args(argv)
    console = Console()
    settings = Settings(inference_url=f"http://127.0.0.1:{args.port}")
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    env = {"EAGLET_INFERENCE_URL": settings.inference_url, "EAGLET_REDIS_URL": settings.redis_url}
    with LocalStack(Path("var/logs") / run_id, env=env) as stack:
        stack.ensure_redis(settings.redis_url, Path("var/redis"))
        redis = Redis.from_url(settings.redis_url, decode_responses=True)
        console.print(f"[bold]eaglet demo[/] run [cyan]{run_id}[/]: starting the inference server on {settings.model}")
        stack.start("inference", "services.inference.main", "--port", str(args.port))
        stack.wait_http("inference", f"{settings.inference_url}/health", timeout=300)
        for i in range(args.workers):
            stack.start(f"worker-{i}", "services.extractor.worker", "--name", f"demo-worker-{i}")
        result = start_run(redis, settings, run_id, DEMO_TRAIN, IngestOptions(max_tokens=2048, limit=args.limit))
        console.print(f"ingested {result.samples} samples, {result.tokens} tokens ({result.bad_lines} bad lines)")
        state = RunState(redis, run_id)
        _follow_extraction(console, state, result.samples)
        stack.stop("inference")  # extraction is complete: the server's memory (GPUs, in production) is free
        for i in range(args.workers):
            stack.stop(f"worker-{i}")
        _report_extraction(console, state, settings)
    return 0 if state.stage() not in (Stage.failed, Stage.cancelled) else 1


def _follow_extraction(console: Console, state: RunState, total: int) -> None:
    columns = (TextColumn("extracting"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task("extract", total=total, info="")
        while not state.extraction_complete():
            counts = state.counts()
            info = f"failed {counts.get('failed', 0)}, {counts.get('tokens', 0)} tokens"
            progress.update(task, completed=counts.get("done", 0) + counts.get("failed", 0), info=info)
            time.sleep(0.5)
        progress.update(task, completed=total)


def _report_extraction(console: Console, state: RunState, settings: Settings) -> None:
    meta, counts = state.meta(), state.counts()
    seconds = float(meta["extraction_complete"]) - float(meta["extraction_started_at"])
    tokens, nbytes = counts.get("tokens", 0), counts.get("bytes", 0)
    console.print(
        f"extraction complete: {counts.get('done', 0)} done, {counts.get('failed', 0)} failed, "
        f"{tokens} tokens in {seconds:.1f}s ({tokens / max(seconds, 1e-9):.0f} tokens/s through the pipeline)"
    )
    console.print(
        f"hidden states: {hidden_dir(settings.data_dir, state.run_id)} — {nbytes / 1e6:.1f} MB, "
        f"{nbytes / max(tokens, 1):.0f} bytes per token"
    )
    console.print(f"run directory: {run_dir(settings.data_dir, state.run_id)}")
