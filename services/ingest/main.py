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
from eaglet.shared.layout import AuxStorage, FinalStorage
from eaglet.shared.logs import setup_logging
from eaglet.shared.runoptions import DEFAULT_TOPK, Overlong, RunOptions, StoreDtype
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
    parser.add_argument("--store-dtype", choices=get_args(StoreDtype), default=DEFAULTS.store_dtype,
                        help="how the run's hidden states are stored (default: EAGLET_STORE_DTYPE)")  # fmt: skip
    parser.add_argument(
        "--store-final",
        choices=get_args(FinalStorage),
        default=DEFAULTS.store_final,
        help=f"the final state at all positions, at loss positions only, or the top-k distribution "
        f"(default {DEFAULTS.store_final})",
    )
    parser.add_argument(
        "--store-topk",
        type=int,
        default=DEFAULTS.store_topk,
        help=f"entries a token of --store-final topk keeps (default {DEFAULT_TOPK})",
    )
    parser.add_argument(
        "--store-aux",
        choices=get_args(AuxStorage),
        default=DEFAULTS.store_aux,
        help=f"the auxiliary states at full width or block-scaled 4-bit (default {DEFAULTS.store_aux})",
    )
    args = parser.parse_args(argv)
    if (args.dataset is None) != args.resume:
        parser.error("give a DATASET for a new run, or --resume for a run whose ingest died (not both)")
    try:
        args.options = RunOptions(
            max_tokens=args.max_tokens,
            overlong=args.overlong,
            limit=args.limit,
            store_dtype=args.store_dtype,
            store_final=args.store_final,
            store_topk=args.store_topk,
            store_aux=args.store_aux,
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
