"""``eaglet``: one command for every part of the pipeline.

eaglet ingest DATASET --run ID     tokenize a JSONL dataset into a run and queue its samples
eaglet ingest --run ID --resume    take up a run's ingest where it last flushed (its process died)
eaglet ingest-worker               an ingest worker: ingests the runs queued by the gateway
eaglet serve                       the reference inference server (transformers)
eaglet worker                      an extractor worker
eaglet gateway                     the HTTP status and control service
eaglet train --run ID              train the drafter once the run's extraction is complete
eaglet eval --run ID               speculative decoding with the drafter: acceptance length
eaglet score --run ID              held-out accuracy per draft position of saved drafters (any trainer's)
eaglet status [RUN] [--watch]      progress, rate, ETA, errors, workers, alerts
eaglet regenerate INPUT --run ID   start a run by regenerating the assistant turns with the target
eaglet prepare-model               convert the bundled target model once
eaglet demo                        all of it on the bundled model, on this machine
"""

import argparse
import importlib
import sys

from eaglet.shared.logs import setup_logging

# Each command is an entry point's ``main(argv)``, imported on use.
ENTRY_POINTS = {
    "ingest": "eaglet.services.ingest.main",
    "ingest-worker": "eaglet.services.ingest.worker",
    "serve": "eaglet.services.inference.main",
    "worker": "eaglet.services.extractor.worker",
    "gateway": "eaglet.services.gateway.main",
    "train": "eaglet.services.trainer.main",
    "eval": "eaglet.services.trainer.evaluate",
    "score": "eaglet.services.trainer.score",
    "status": "eaglet.cli.status",
    "regenerate": "eaglet.services.regenerate.main",
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
    sub.add_parser("prepare-model", help="convert the bundled target model once")
    parser.parse_args(argv)  # reached only for prepare-model, --help and unknown commands
    return prepare_model()


def prepare_model() -> int:
    from eaglet.shared.config import Settings
    from eaglet.shared.target import resolve_model_dir

    setup_logging()
    settings = Settings()
    sys.stdout.write(f"{resolve_model_dir(settings.model, settings.model_cache_dir)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
