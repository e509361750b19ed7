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

from eaglet.services.ingest.ingest import IngestOptions, IngestResult, ingest_dataset
from eaglet.shared.config import Settings
from eaglet.shared.ids import check_id
from eaglet.shared.jobqueue import cancel, enqueue_samples
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.samples import SampleSet, SampleWriter
from eaglet.shared.store import samples_dir
from eaglet.shared.target import eagle3_layer_ids, model_config, resolve_model_dir

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
    return _ingest_or_fail(redis, settings, state, None)


def resume_run(redis: Redis, settings: Settings, run_id: str) -> IngestResult:
    """Takes up the ingest of a run whose ingest died, from its last flush (the cursor in the run's meta)."""
    state = RunState(redis, run_id)
    meta = state.meta()
    if not meta or "total" in meta or state.stage() not in (Stage.ingesting, Stage.extracting):
        raise RunExists(f"run {run_id!r} has no ingest to take up (stage {meta.get('stage')})")
    cursor = IngestResult(**json.loads(meta["ingest_cursor"])) if meta.get("ingest_cursor") else None
    log.info("run %s: ingest taken up again at line %d", run_id, cursor.lines if cursor else 0)
    return _ingest_or_fail(redis, settings, state, cursor)


def _ingest_or_fail(redis: Redis, settings: Settings, state: RunState, cursor: IngestResult | None) -> IngestResult:
    meta = state.meta()
    try:
        return _ingest(redis, settings, state, meta, cursor)
    except Exception as e:
        # The run can't complete without its whole dataset: it ends failed with the reason, in /status.
        fail_ingest(state, f"ingest of {meta['dataset']} stopped: {type(e).__name__}: {e}")
        raise


def fail_ingest(state: RunState, reason: str) -> None:
    """Ends a run whose ingest stopped: failed, with the reason; the samples queued so far are dropped."""
    log.error("run %s: %s", state.run_id, reason)
    state.fail(reason)
    cancel(state.redis, state.run_id)


def _ingest(redis: Redis, settings: Settings, state: RunState, meta: dict, cursor: IngestResult | None) -> IngestResult:
    run_id, dataset, model_dir = state.run_id, Path(meta["dataset"]), Path(meta["model_dir"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    folder = samples_dir(settings.data_dir, run_id)
    # Read before the writer cuts the files back to the cursor (a map past a file's end faults when read).
    earlier_ids = [s.decode() for s in SampleSet(folder).index[: cursor.samples]["id"]] if cursor else []
    writer = SampleWriter(folder, keep=(cursor.samples, cursor.tokens) if cursor else None)
    pending: list[int] = []
    result = cursor or IngestResult()

    def flush() -> None:
        # The cursor is recorded before the samples are queued: a resume never cuts off a queued sample. One
        # recorded but never queued (died in between) is queued again by the workers' sweep for lost samples.
        writer.flush()
        state.set_meta(ingest_cursor=json.dumps(result.cursor()))
        if pending:
            if state.stage() == Stage.ingesting:
                state.start_extraction()
            enqueue_samples(redis, run_id, pending)
            pending.clear()

    def on_sample(index: int) -> None:
        pending.append(index)
        if len(pending) >= ENQUEUE_BATCH:
            flush()

    ingest_dataset(
        dataset,
        tokenizer,
        writer,
        IngestOptions(**json.loads(meta["options"])),
        vocab_size=int(meta["vocab_size"]),
        on_error=lambda sample_id, message: state.record_error(-1, sample_id, message, "ingest", final=True),
        on_sample=on_sample,
        result=result,
        earlier_ids=earlier_ids,
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
    """RQ job: ``start_run`` with the worker's settings and connection; the same job queued again after its
    worker died (eaglet/services/extractor/reaper.py) takes the ingest up where it last flushed."""
    settings = Settings()
    redis = Redis.from_url(settings.redis_url, decode_responses=True)  # run state is text; RQ's own client is not
    if RunState(redis, run_id).exists():
        result = resume_run(redis, settings, run_id)
    else:
        result = start_run(redis, settings, run_id, Path(dataset), IngestOptions(**options))
    return asdict(result)
