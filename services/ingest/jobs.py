"""Starting a run: register it in Redis, ingest its dataset, queue every sample for extraction.

``start_run`` is what ``eaglet ingest`` calls; ``ingest_run`` is the same as an RQ job, which the
gateway's ``POST /runs`` queues on the control queue.
"""

import json
import logging
from dataclasses import asdict
from pathlib import Path

from redis import Redis
from transformers import AutoTokenizer

from services.ingest.ingest import IngestOptions, IngestResult, ingest_dataset
from shared.config import Settings
from shared.ids import check_id
from shared.jobqueue import cancel, enqueue_samples
from shared.runstate import RunState, Stage
from shared.samples import SampleWriter
from shared.store import samples_dir
from shared.target import eagle3_layer_ids, model_config, resolve_model_dir

log = logging.getLogger(__name__)
ENQUEUE_BATCH = 1000


class RunExists(ValueError):
    """A run id that is already taken: runs are never overwritten."""


def start_run(redis: Redis, settings: Settings, run_id: str, dataset: Path, options: IngestOptions) -> IngestResult:
    check_id(run_id, "run id")
    dataset = Path(dataset)
    if not dataset.is_file():
        raise FileNotFoundError(f"dataset {dataset}: no such file")
    state = RunState(redis, run_id)
    if state.exists():
        raise RunExists(f"run {run_id!r} exists already; pick another id")
    model_dir = resolve_model_dir(settings.model, settings.model_cache_dir)
    config = model_config(model_dir)
    num_layers = config["num_hidden_layers"]
    max_tokens = min(options.max_tokens, config.get("max_position_embeddings", options.max_tokens))
    options = IngestOptions(**{**asdict(options), "max_tokens": max_tokens})
    state.create(
        dataset=str(dataset),
        model=settings.model,
        model_dir=str(model_dir),
        hidden_size=config["hidden_size"],
        num_layers=num_layers,
        vocab_size=config["vocab_size"],
        aux_layer_ids=json.dumps(eagle3_layer_ids(num_layers)),
        options=json.dumps(asdict(options)),
    )
    log.info("run %s: ingesting %s for %s", run_id, dataset, model_dir)
    try:
        return _ingest(redis, settings, state, dataset, model_dir, config["vocab_size"], options)
    except Exception as e:
        # The run can't complete without its whole dataset: it ends failed with the reason, in /status.
        fail_ingest(state, f"ingest of {dataset} stopped: {type(e).__name__}: {e}")
        raise


def fail_ingest(state: RunState, reason: str) -> None:
    """Ends a run whose ingest stopped: failed, with the reason; the samples queued so far are dropped."""
    log.error("run %s: %s", state.run_id, reason)
    state.fail(reason)
    cancel(state.redis, state.run_id)


def _ingest(
    redis: Redis,
    settings: Settings,
    state: RunState,
    dataset: Path,
    model_dir: Path,
    vocab_size: int,
    options: IngestOptions,
) -> IngestResult:
    run_id = state.run_id
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    writer = SampleWriter(samples_dir(settings.data_dir, run_id))
    pending: list[int] = []

    def flush() -> None:
        if pending:
            writer.flush()
            if state.stage() == Stage.ingesting:
                state.start_extraction()
            enqueue_samples(redis, run_id, pending)
            pending.clear()

    def on_sample(index: int) -> None:
        pending.append(index)
        if len(pending) >= ENQUEUE_BATCH:
            flush()

    result = ingest_dataset(
        dataset,
        tokenizer,
        writer,
        options,
        vocab_size=vocab_size,
        on_error=lambda sample_id, message: state.record_error(-1, sample_id, message, "ingest", final=True),
        on_sample=on_sample,
    )
    flush()
    writer.close({"dataset": str(dataset), "model_dir": str(model_dir), "bad_lines": result.bad_lines})
    state.set_meta(bad_lines=result.bad_lines, truncated=result.truncated, loss_tokens=result.loss_tokens)
    if result.samples == 0:
        state.fail(f"no valid sample in {dataset.name} ({result.bad_lines} bad lines)")
    state.set_total(result.samples, result.tokens)
    log.info("run %s: %d samples, %d tokens, %d bad lines", run_id, result.samples, result.tokens, result.bad_lines)
    return result


def ingest_run(run_id: str, dataset: str, options: dict) -> dict:
    """RQ job: ``start_run`` with the worker's settings and connection."""
    settings = Settings()
    redis = Redis.from_url(settings.redis_url, decode_responses=True)  # run state is text; RQ's own client is not
    result = start_run(redis, settings, run_id, Path(dataset), IngestOptions(**options))
    return asdict(result)
