"""``eaglet regenerate``: start a run by regenerating a dataset's assistant turns with the target.

Takes prompts (``{"id", "prompt"}``) or conversations (ShareGPT, OpenAI messages); every user turn is answered by
the target after its own earlier answers. The run is created and its planning queued here, as ``POST /runs`` does: an
ingest worker cuts its input into batches and queues them, the extractor workers regenerate the batches through the
chat endpoint, and the run goes on to ingest and extraction with the regenerated file as its dataset, or ends once it
is written (``--stop-after``).
"""

import argparse
import sys
import time
from pathlib import Path
from typing import get_args

from eaglet.shared.config import Settings
from eaglet.shared.connections import connect, connect_raw
from eaglet.shared.ids import UnsafeName
from eaglet.shared.logs import setup_logging
from eaglet.shared.records import Stage
from eaglet.shared.regeneration import Progress
from eaglet.shared.runoptions import Reasoning, RegenerateOptions, RunOptions, add_store_flags, store_flags
from eaglet.shared.runs import queue_run
from eaglet.shared.runstate import RunExists, RunState

DEFAULTS = RegenerateOptions()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eaglet regenerate", description=__doc__)
    p.add_argument("input", type=Path, help="JSONL of prompts or conversations")
    p.add_argument("--run", required=True, help="run id: letters, digits, '.', '_', '-'")
    p.add_argument("--endpoint", help="OpenAI-compatible base URL (.../v1); default: EAGLET_INFERENCE_URL/v1")
    p.add_argument("--model", default=DEFAULTS.model, help="the request's model field")
    p.add_argument("--api-key-env", help="NAME of the environment variable holding the endpoint's key (workers')")
    p.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    p.add_argument("--top-p", type=float, default=DEFAULTS.top_p)
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_tokens, help="most tokens of one answer")
    p.add_argument("--concurrency", type=int, default=DEFAULTS.concurrency, help="requests in flight per worker")
    p.add_argument("--batch-prompts", type=int, default=DEFAULTS.batch_prompts, help="prompts per job")
    p.add_argument("--max-tries", type=int, default=DEFAULTS.max_tries, help="tries of a request on 429/5xx/timeout")
    p.add_argument("--reasoning", choices=get_args(Reasoning), default=DEFAULTS.reasoning)
    p.add_argument("--stop-after", action="store_true", help="end the run once the regenerated file is written")
    p.add_argument("--max-tokens", type=int, default=RunOptions().max_tokens, help="ingest: longest sample kept")
    add_store_flags(p)
    p.add_argument("--wait", action="store_true", help="follow the regeneration here until it is over")
    args = p.parse_args(argv)
    try:
        regenerate = RegenerateOptions(
            endpoint=args.endpoint,
            model=args.model,
            api_key_env=args.api_key_env,
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_new_tokens,
            concurrency=args.concurrency,
            batch_prompts=args.batch_prompts,
            max_tries=args.max_tries,
            reasoning=args.reasoning,
            stop_after=args.stop_after,
        )
        args.options = RunOptions(max_tokens=args.max_tokens, regenerate=regenerate, **store_flags(args))
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    settings = Settings()
    redis = connect(settings.redis_url)
    try:
        job_id = queue_run(redis, connect_raw(settings.redis_url), run_id=args.run, dataset=args.input,
                           options=args.options)  # fmt: skip
    except (RunExists, UnsafeName, FileNotFoundError) as e:
        sys.stderr.write(f"eaglet regenerate: {e}\n")
        return 2
    sys.stdout.write(f"run {args.run}: regeneration queued ({job_id}); an ingest worker cuts it into batches, "
                     "the extractor workers answer them\n")  # fmt: skip
    if not args.wait:
        return 0
    state = RunState(redis, args.run)
    progress = Progress(redis, args.run)
    while (stage := state.stage()) == Stage.regenerating:
        c = progress.counts()
        sys.stdout.write(f"\r{c.done} done, {c.failed} failed of {c.total}; "
                         f"{c.tokens_out} tokens out")  # fmt: skip
        sys.stdout.flush()
        time.sleep(1)
    meta = state.meta()
    if stage == Stage.failed or stage == Stage.cancelled:
        sys.stdout.write(f"\nrun {args.run} {stage}: {meta.error or ''}\n")
        return 1
    sys.stdout.write(f"\nregenerated conversations: {meta.dataset}; the run is {stage}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
