"""``eaglet demo``: the whole job on the bundled SmolLM2-135M-Instruct, on this machine.

Starts Redis (if none answers), the reference inference server, an ingest worker and two extractor
workers as local processes. First regenerates the answers of a few demo prompts through the regeneration
stage (the server's ``/v1/chat/completions``, the same client path as SGLang or a hosted API), then creates a run
of the demo conversations and queues its ingest (as the gateway's ``POST /runs`` does), extracts every sample's
hidden states, then trains a drafter and measures its acceptance length. Ends by saying where everything is.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

from redis import Redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from eaglet.cli.stack import LocalStack
from eaglet.shared import regeneration
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect, connect_raw
from eaglet.shared.runoptions import RegenerateOptions, RunOptions
from eaglet.shared.runs import queue_run
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.store import drafter_dir, hidden_dir, run_dir

ROOT = Path(__file__).resolve().parents[1]  # the repository: the demo data (data/demo) is not in the wheel
DEMO_TRAIN = ROOT / "data" / "demo" / "train.jsonl"
DEMO_EVAL = ROOT / "data" / "demo" / "eval.jsonl"
DEMO_PROMPTS = ROOT / "data" / "demo" / "prompts-train.jsonl"  # the prompts of DEMO_TRAIN, whose answers SmolLM2 wrote
# A few prompts with short answers: two CPU cores write SmolLM2's answers at ~60 tokens/s in all, so regenerating all
# 300 at full length would add about ten minutes; the training set's answers were written by SmolLM2 the same way.
DEMO_REGENERATE = RegenerateOptions(max_tokens=32, concurrency=4, batch_prompts=4, stop_after=True)
# Sized for a 2-core CPU: a few minutes of training, a short evaluation. A GPU run uses the defaults.
# A small drafter learns from 59 k tokens only with a higher rate and small batches (many updates).
DEMO_TRAIN_FLAGS = ["--ttt-steps", "2", "--draft-vocab-size", "4096", "--epochs", "3", "--max-len", "512"]
DEMO_TRAIN_FLAGS += ["--tokens-per-batch", "2048", "--loader-workers", "0", "--checkpoint-every", "50", "--lr", "1e-3"]
DEMO_TRAIN_FLAGS += ["--log-every", "5"]  # a short training: a progress report (a point of the charts) every 5 steps
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
    parser.add_argument("--regenerate-prompts", type=int, default=12,
                        help="demo prompts answered again through the regeneration stage (0: skip)")  # fmt: skip
    args = parser.parse_args(argv)
    console = Console()
    settings = Settings(inference_url=f"http://127.0.0.1:{args.port}")
    run_id = time.strftime("demo-%Y%m%d-%H%M%S")
    env = {"EAGLET_INFERENCE_URL": settings.inference_url, "EAGLET_REDIS_URL": settings.redis_url}
    with LocalStack(Path("var/logs") / run_id, env=env) as stack:
        stack.ensure_redis(settings.redis_url, Path("var/redis"))
        redis = connect(settings.redis_url)
        console.print(f"[bold]eaglet demo[/] run [cyan]{run_id}[/]: starting the inference server on {settings.model}")
        stack.start("gateway", "eaglet.services.gateway.main", "--port", str(args.gateway_port))
        # Under the inference service's supervisor, as in the compose stack: it reports the server's GPUs.
        server = [sys.executable, "-m", "eaglet.services.inference.main", "--port", str(args.port)]
        stack.start("inference", "eaglet.services.inference.release", "--", *server)
        stack.wait_http("inference", f"{settings.inference_url}/health", timeout=300)
        stack.wait_http("gateway", f"http://127.0.0.1:{args.gateway_port}/status", timeout=60)
        console.print(f"live status: http://127.0.0.1:{args.gateway_port}/  (JSON: /status, Prometheus: /metrics)")
        stack.start("ingest", "eaglet.services.ingest.worker", "--name", "demo-ingest")
        for i in range(args.workers):
            stack.start(f"worker-{i}", "eaglet.services.extractor.worker", "--name", f"demo-worker-{i}")
        if args.regenerate_prompts > 0:
            _regenerate(console, redis, settings, f"{run_id}-regenerate", args.regenerate_prompts, stack.log_dir)
        else:
            console.print("regeneration skipped (--regenerate-prompts 0): the demo answers are SmolLM2's already")
        options = RunOptions(max_tokens=2048, limit=args.limit)
        # RQ's jobs are pickled bytes: a client of its own
        queue_run(redis, connect_raw(settings.redis_url), run_id=run_id, dataset=args.dataset, options=options)
        state = RunState(redis, run_id)
        total = _wait_for_ingest(console, state, stack.log_dir)
        if total is None:
            return 1
        _follow_extraction(console, state, total)
        stack.stop("inference")  # extraction is complete: the server's memory (GPUs, in production) is free
        for name in ["ingest", *(f"worker-{i}" for i in range(args.workers))]:
            stack.stop(name)
        _report_extraction(console, state, settings)
        trained = _train_and_evaluate(console, run_id, args.max_steps, args.eval_prompts, stack.log_dir)
        _report_training(console, state, settings)
        done = state.stage() == Stage.done  # read before the stack stops a Redis it started itself
    return 0 if trained and done else 1


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


def _regenerate(console: Console, redis: Redis, settings: Settings, run_id: str, n: int, log_dir: Path) -> None:
    """A run that only regenerates: the first ``n`` demo prompts answered by the target through the stage."""
    source = log_dir / "regenerate-input.jsonl"
    with open(DEMO_PROMPTS) as f:
        source.write_text("".join(line for _, line in zip(range(n), f, strict=False)))
    started = time.monotonic()
    options = RunOptions(regenerate=DEMO_REGENERATE)
    queue_run(redis, connect_raw(settings.redis_url), run_id=run_id, dataset=source, options=options)
    state = RunState(redis, run_id)
    progress = regeneration.Progress(redis, run_id)
    with console.status(f"regenerating {n} prompts' answers with the target (run {run_id})"):
        while state.stage() == Stage.regenerating:
            time.sleep(0.2)
    seconds, counts, meta = time.monotonic() - started, progress.counts(), state.meta()
    if meta.stage != Stage.done:
        console.print(f"[red]regeneration {meta.stage}[/]: {meta.error} (see {log_dir})")
        return
    console.print(
        f"regenerated {counts.done} prompts ({counts.failed} failed) in {seconds:.1f}s: "
        f"{counts.done / seconds:.2f} prompts/s, {counts.tokens_out / seconds:.1f} tokens/s out "
        f"(max {DEMO_REGENERATE.max_tokens} new tokens each) → {meta.dataset}"
    )
    console.print("training on the 300 demo conversations as shipped: their answers are SmolLM2's own, written the "
                  "same way at full length (all of them would add about ten minutes on two CPU cores)")  # fmt: skip


def _wait_for_ingest(console: Console, state: RunState, log_dir: Path) -> int | None:
    """The run's sample count once the ingest worker has read the whole dataset; None if the ingest failed."""
    with console.status("ingesting the dataset"):
        while state.meta().total is None and state.stage() != Stage.failed:
            time.sleep(0.2)
    meta = state.meta()
    if meta.stage == Stage.failed:
        console.print(f"[red]ingest failed[/]: {meta.error} (see {log_dir / 'ingest.log'})")
        return None
    console.print(f"ingested {meta.total} samples, {meta.total_tokens} tokens ({meta.bad_lines} bad lines)")
    return meta.total


def _follow_extraction(console: Console, state: RunState, total: int) -> None:
    columns = (TextColumn("extracting"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task("extract", total=total, info="")
        while not state.extraction_complete():
            counts = state.counts()
            info = f"failed {counts.failed}, {counts.tokens} tokens"
            progress.update(task, completed=counts.done + counts.failed, info=info)
            time.sleep(0.5)
        progress.update(task, completed=total)


def _report_extraction(console: Console, state: RunState, settings: Settings) -> None:
    meta, counts = state.meta(), state.counts()
    seconds = meta.extraction_complete - meta.extraction_started_at
    tokens, nbytes = counts.tokens, counts.bytes
    console.print(
        f"extraction complete: {counts.done} done, {counts.failed} failed, "
        f"{tokens} tokens in {seconds:.1f}s ({tokens / max(seconds, 1e-9):.0f} tokens/s through the pipeline)"
    )
    console.print(
        f"hidden states: {hidden_dir(settings.data_dir, state.run_id)} — {nbytes / 1e6:.1f} MB, "
        f"{nbytes / max(tokens, 1):.0f} bytes per token"
    )
    console.print(f"run directory: {run_dir(settings.data_dir, state.run_id)}")


def _report_training(console: Console, state: RunState, settings: Settings) -> None:
    train, result = state.train(), state.eval()
    if train.step is not None:
        loss = "?" if train.loss is None else f"{train.loss:.3f}"
        console.print(
            f"training: {train.step} steps on {train.train_samples} samples, "
            f"loss {loss}, {train.tokens_per_s or 0:.0f} tokens/s"
        )
    console.print(f"drafter (loads in SGLang and vLLM as EAGLE-3): {drafter_dir(settings.data_dir, state.run_id)}")
    if result.accept_length is not None:
        console.print(
            f"[bold green]acceptance length {result.accept_length:.2f}[/] "
            f"(k={result.k}, {result.prompts} held-out prompts; outputs equal plain greedy: "
            f"{'yes' if result.mismatches == 0 else 'NO'}; "
            f"per position {', '.join(f'{p:.2f}' for p in result.accept_rate or [])}; "
            f"speed-up vs the target alone {result.speedup or 0:.2f}x)"
        )
