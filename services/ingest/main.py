"""``eaglet ingest``: create a run from a JSONL dataset and ingest it in this process, or take up the ingest
of a run whose ingest process died. An ingest worker (services/ingest/worker.py) does the same for the
runs the gateway creates.
"""

import argparse
import sys
from pathlib import Path
from typing import get_args

from eaglet.services.ingest.jobs import NoIngestToTakeUp, ingest_new_run, ingest_run
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect
from eaglet.shared.ids import UnsafeName
from eaglet.shared.logs import setup_logging
from eaglet.shared.runoptions import Overlong, RunOptions, add_store_flags, store_flags
from eaglet.shared.runstate import RunExists

DEFAULTS = RunOptions()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="eaglet ingest", description=__doc__)
    parser.add_argument("dataset", type=Path, nargs="?", help="JSONL dataset (not with --resume)")
    parser.add_argument("--run", required=True, help="run id: letters, digits, '.', '_', '-'")
    parser.add_argument("--resume", action="store_true", help="take up the run's ingest where it last flushed")
    parser.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens)
    parser.add_argument("--overlong", choices=get_args(Overlong), default=DEFAULTS.overlong)
    parser.add_argument("--limit", type=int, default=DEFAULTS.limit)
    add_store_flags(parser)
    args = parser.parse_args(argv)
    if (args.dataset is None) != args.resume:
        parser.error("give a DATASET for a new run, or --resume for a run whose ingest died (not both)")
    try:
        args.options = RunOptions(
            max_tokens=args.max_tokens, overlong=args.overlong, limit=args.limit, **store_flags(args)
        )
    except ValueError as e:
        parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    settings = Settings()
    redis = connect(settings.redis_url)
    try:
        if args.resume:
            result = ingest_run(redis, settings, args.run)
        else:
            result = ingest_new_run(redis, settings, args.run, args.dataset, args.options)
    except (RunExists, NoIngestToTakeUp, UnsafeName, FileNotFoundError) as e:
        sys.stderr.write(f"eaglet ingest: {e}\n")
        return 2
    sys.stdout.write(
        f"run {args.run}: {result.samples} samples, {result.tokens} tokens queued; {result.bad_lines} bad lines\n"
    )
    sys.stdout.writelines(f"  {error}\n" for error in result.errors)
    return 0 if result.samples else 1


if __name__ == "__main__":
    raise SystemExit(main())
