"""``eaglet``: one command for every part of the pipeline.

eaglet ingest DATASET --run ID     tokenize a JSONL dataset into a run and queue its samples
eaglet ingest --run ID --resume    take up a run's ingest where it last flushed (its process died)
eaglet serve                       the reference inference server (transformers)
eaglet worker                      an extractor worker
eaglet gateway                     the HTTP status and control service
eaglet train --run ID              train the drafter once the run's extraction is complete
eaglet eval --run ID               speculative decoding with the drafter: acceptance length
eaglet status [RUN] [--watch]      progress, rate, ETA, errors, workers, alerts
eaglet regenerate PROMPTS OUT      the target's own answers to prompts, as conversations
eaglet prepare-model               convert the bundled target model once
eaglet demo                        all of it on the bundled model, on this machine
"""

import argparse
import importlib
import logging
import sys
from pathlib import Path

# Commands that are a service's own entry point: ``main(argv)`` of the module, imported on use.
ENTRY_POINTS = {
    "serve": "eaglet.services.inference.main",
    "worker": "eaglet.services.extractor.worker",
    "gateway": "eaglet.services.gateway.main",
    "train": "eaglet.services.trainer.main",
    "eval": "eaglet.services.trainer.evaluate",
    "status": "eaglet.cli.status",
    "demo": "eaglet.cli.demo",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ENTRY_POINTS:
        return importlib.import_module(ENTRY_POINTS[argv[0]]).main(argv[1:]) or 0
    parser = argparse.ArgumentParser(prog="eaglet", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ENTRY_POINTS:
        sub.add_parser(name, help=f"see: eaglet {name} --help")
    ingest = sub.add_parser("ingest", help="tokenize a JSONL dataset into a run and queue its samples")
    ingest.add_argument("dataset", type=Path, nargs="?", help="JSONL dataset (not with --resume)")
    ingest.add_argument("--run", required=True, help="run id: letters, digits, '.', '_', '-'")
    ingest.add_argument("--resume", action="store_true", help="take up the run's ingest where it last flushed")
    ingest.add_argument("--max-tokens", type=int, default=4096)
    ingest.add_argument("--overlong", choices=["truncate", "reject"], default="reject")
    ingest.add_argument("--limit", type=int)
    regen = sub.add_parser("regenerate", help="the target's own answers to prompts")
    regen.add_argument("prompts", type=Path, help='JSONL of {"id", "prompt"}')
    regen.add_argument("out", type=Path)
    regen.add_argument("--max-new-tokens", type=int, default=256)
    regen.add_argument("--temperature", type=float, default=0.0)
    regen.add_argument("--concurrency", type=int, default=8)
    sub.add_parser("prepare-model", help="convert the bundled target model once")
    args = parser.parse_args(argv)
    if args.command == "ingest" and (args.dataset is None) != args.resume:
        parser.error("ingest: give a DATASET for a new run, or --resume for a run whose ingest died (not both)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return {"ingest": ingest_command, "regenerate": regenerate_command, "prepare-model": prepare_model}[args.command](
        args
    )


def ingest_command(args: argparse.Namespace) -> int:
    from redis import Redis

    from eaglet.services.ingest.ingest import IngestOptions
    from eaglet.services.ingest.jobs import resume_run, start_run
    from eaglet.shared.config import Settings

    settings = Settings()
    redis = Redis.from_url(settings.redis_url, decode_responses=True)
    if args.resume:
        result = resume_run(redis, settings, args.run)
    else:
        options = IngestOptions(max_tokens=args.max_tokens, overlong=args.overlong, limit=args.limit)
        result = start_run(redis, settings, args.run, args.dataset, options)
    print(f"run {args.run}: {result.samples} samples, {result.tokens} tokens queued; {result.bad_lines} bad lines")
    for error in result.errors:
        print(f"  {error}")
    return 0 if result.samples else 1


def regenerate_command(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from eaglet.services.ingest.regenerate import regenerate
    from eaglet.shared.config import Settings
    from eaglet.shared.target import resolve_model_dir

    settings = Settings()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(settings.model, settings.model_cache_dir))
    n = regenerate(
        args.prompts,
        args.out,
        tokenizer,
        settings.inference_url,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        concurrency=args.concurrency,
    )
    print(f"{n} conversations written to {args.out}")
    return 0


def prepare_model(args: argparse.Namespace) -> int:
    from eaglet.shared.config import Settings
    from eaglet.shared.target import resolve_model_dir

    settings = Settings()
    print(resolve_model_dir(settings.model, settings.model_cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
