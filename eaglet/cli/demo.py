"""``eaglet demo``: the whole job on the bundled SmolLM2-135M-Instruct, on this machine.

Starts Redis (if none answers), the reference inference server and two extractor workers as local
processes, ingests the demo conversations, extracts every sample's hidden states, then trains a
drafter and measures its acceptance length. Ends by saying where everything is.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from redis import Redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from eaglet.cli.stack import LocalStack
from eaglet.services.ingest.ingest import IngestOptions
from eaglet.services.ingest.jobs import start_run
from eaglet.shared.config import Settings
from eaglet.shared.keys import RunKeys
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.store import drafter_dir, hidden_dir, run_dir

ROOT = Path(__file__).resolve().parents[2]
DEMO_TRAIN = ROOT / "data" / "demo" / "train.jsonl"
DEMO_EVAL = ROOT / "data" / "demo" / "eval.jsonl"
# Sized for a 2-core CPU: a few minutes of training, a short evaluation. A GPU run uses the defaults.
# A small drafter learns from 59 k tokens only with a higher rate and small batches (many updates).
DEMO_TRAIN_FLAGS = ["--ttt-steps", "2", "--draft-vocab-size", "4096", "--epochs", "3", "--max-len", "512"]
DEMO_TRAIN_FLAGS += ["--max-tokens", "2048", "--workers", "0", "--checkpoint-every", "50", "--lr", "1e-3"]
DEMO_EVAL_FLAGS = ["--eval-k", "2", "--eval-max-new-tokens", "48"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglet demo", description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dataset", type=Path, default=DEMO_TRAIN, help="conversations to train on (JSONL)")
    parser.add_argument("--limit", type=int, help="use only the first N conversations")
    parser.add_argument("--port", type=int, default=30000, help="the inference server's port")
    parser.add_argument("--gateway-port", type=int, default=8000)
    parser.add_argument("--max-steps", type=int, default=0, help="cap the training steps (0: the epochs decide)")
    parser.add_argument("--eval-prompts", type=int, default=10, help="held-out prompts to decode speculatively")
    args = parser.parse_args(argv)
    console = Console()
    settings = Settings(inference_url=f"http://127.0.0.1:{args.port}")
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    env = {"EAGLET_INFERENCE_URL": settings.inference_url, "EAGLET_REDIS_URL": settings.redis_url}
    with LocalStack(Path("var/logs") / run_id, env=env) as stack:
        stack.ensure_redis(settings.redis_url, Path("var/redis"))
        redis = Redis.from_url(settings.redis_url, decode_responses=True)
        console.print(f"[bold]eaglet demo[/] run [cyan]{run_id}[/]: starting the inference server on {settings.model}")
        stack.start("gateway", "eaglet.services.gateway.main", "--port", str(args.gateway_port))
        stack.start("inference", "eaglet.services.inference.main", "--port", str(args.port))
        stack.wait_http("inference", f"{settings.inference_url}/health", timeout=300)
        stack.wait_http("gateway", f"http://127.0.0.1:{args.gateway_port}/status", timeout=60)
        console.print(f"live status: http://127.0.0.1:{args.gateway_port}/  (JSON: /status, Prometheus: /metrics)")
        for i in range(args.workers):
            stack.start(f"worker-{i}", "eaglet.services.extractor.worker", "--name", f"demo-worker-{i}")
        result = start_run(redis, settings, run_id, args.dataset, IngestOptions(max_tokens=2048, limit=args.limit))
        console.print(f"ingested {result.samples} samples, {result.tokens} tokens ({result.bad_lines} bad lines)")
        state = RunState(redis, run_id)
        _follow_extraction(console, state, result.samples)
        stack.stop("inference")  # extraction is complete: the server's memory (GPUs, in production) is free
        for i in range(args.workers):
            stack.stop(f"worker-{i}")
        _report_extraction(console, state, settings)
        trained = _train_and_evaluate(console, run_id, args.max_steps, args.eval_prompts, stack.log_dir)
        _report_training(console, redis, state, settings)
    return 0 if trained and state.stage() == Stage.done else 1


def _train_and_evaluate(console: Console, run_id: str, max_steps: int, eval_prompts: int, log_dir: Path) -> bool:
    """The trainer in its own process, as in production (where torchrun starts it on the GPUs)."""
    console.print("training the drafter (the trainer saw the completion flag), then evaluating it")
    flags = [*DEMO_TRAIN_FLAGS, "--max-steps", str(max_steps), "--eval-prompts", str(DEMO_EVAL), *DEMO_EVAL_FLAGS]
    flags += ["--eval-num-prompts", str(eval_prompts)]
    with open(log_dir / "trainer.log", "ab") as log:
        done = subprocess.run(
            [sys.executable, "-m", "eaglet.services.trainer.main", "--run", run_id, *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        console.print(f"[red]training failed[/]: see {log_dir / 'trainer.log'}")
    return done.returncode == 0


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


def _report_training(console: Console, redis: Redis, state: RunState, settings: Settings) -> None:
    train, result = redis.hgetall(RunKeys(state.run_id).train), redis.hgetall(RunKeys(state.run_id).eval)
    if train:
        console.print(
            f"training: {train.get('step')} steps on {train.get('train_samples')} samples, "
            f"loss {float(train.get('loss', 'nan')):.3f}, {float(train.get('tokens_per_s', 0)):.0f} tokens/s"
        )
    console.print(f"drafter (loads in SGLang and vLLM as EAGLE-3): {drafter_dir(settings.data_dir, state.run_id)}")
    if result:
        per_position = json.loads(result.get("accept_rate", "[]"))
        console.print(
            f"[bold green]acceptance length {float(result.get('accept_length', 0)):.2f}[/] "
            f"(k={result.get('k')}, {result.get('prompts')} held-out prompts; outputs equal plain greedy: "
            f"{'yes' if result.get('mismatches') == '0' else 'NO'}; "
            f"per position {', '.join(f'{p:.2f}' for p in per_position)}; "
            f"speed-up vs the target alone {float(result.get('speedup', 0)):.2f}x)"
        )
