"""Ingesting a created run: describe its target model, read its dataset, queue every sample for extraction.

``ingest_run`` starts the ingest of a run made by ``create_run`` (shared/runs.py), or takes it
up from its last flush if the process that ran it died: the cursor is in the run's record. ``eaglet ingest``
calls it in its own process; ``ingest_job`` is the same as an RQ job on the control queue, run by an ingest
worker (services/ingest/worker.py).
"""

import logging
from dataclasses import asdict, replace
from pathlib import Path

from redis import Redis
from transformers import AutoTokenizer

from eaglet.services.ingest.ingest import IngestResult, ingest_dataset
from eaglet.shared.config import Settings
from eaglet.shared.fp4 import Fp4Error
from eaglet.shared.jobqueue import cancel, enqueue_samples
from eaglet.shared.layout import FP4_BLOCK, check_k
from eaglet.shared.records import ACTIVE_STAGES, RunMeta
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runs import create_run
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.samples import SampleSet, SampleWriter
from eaglet.shared.store import samples_dir
from eaglet.shared.target import resolve_model_dir, text_config
from eaglet.shared.workerloop import job_process

log = logging.getLogger(__name__)
ENQUEUE_BATCH = 1000


class NoIngestToTakeUp(ValueError):
    """The run is unknown, its ingest is over, or the run has ended: there is nothing to ingest."""


def ingest_new_run(redis: Redis, settings: Settings, run_id: str, dataset: Path, options: RunOptions) -> IngestResult:
    """``create_run``, then ``ingest_run`` in this process: what ``eaglet ingest DATASET`` does."""
    create_run(redis, run_id, dataset, options)
    return ingest_run(redis, settings, run_id)


def ingest_run(redis: Redis, settings: Settings, run_id: str) -> IngestResult:
    """Ingests a created run from its cursor: from the top if it never flushed, else from its last flush."""
    state = RunState(redis, run_id)
    meta = state.meta()
    if meta.dataset is None or meta.total is not None or meta.stage not in ACTIVE_STAGES:
        raise NoIngestToTakeUp(f"run {run_id!r} has no ingest to take up (stage {meta.stage})")
    if meta.stage == Stage.regenerating:
        raise NoIngestToTakeUp(f"run {run_id!r} is regenerating: its ingest starts once its new dataset is written")
    cursor = IngestResult(**meta.ingest_cursor) if meta.ingest_cursor else None
    if cursor:
        log.info("run %s: ingest taken up again at line %d", run_id, cursor.lines)
    try:
        if meta.model_dir is None:
            meta = _describe_target(state, settings, meta)
        log.info("run %s: ingesting %s for %s", run_id, meta.dataset, meta.model_dir)
        return _ingest(redis, settings, state, meta, cursor)
    except Exception as e:
        # The run can't complete without its whole dataset: it ends failed with the reason, in /status.
        fail_ingest(state, f"ingest of {meta.dataset} stopped: {type(e).__name__}: {e}")
        raise


def fail_ingest(state: RunState, reason: str) -> None:
    """Ends a run whose ingest stopped: failed, with the reason; the samples queued so far are dropped."""
    log.error("run %s: %s", state.run_id, reason)
    state.fail(reason)
    cancel(state.redis, state.run_id)


def _describe_target(state: RunState, settings: Settings, meta: RunMeta) -> RunMeta:
    """Records the target model the run is ingested for; ``max_tokens`` is capped at the model's context."""
    model_dir = resolve_model_dir(settings.model, settings.model_cache_dir)
    config = text_config(model_dir)  # a wrapper class (Kimi-K2.5) keeps the language model's config inside
    num_layers = config["num_hidden_layers"]
    options = meta.options or RunOptions()
    # the layout's limits that depend on the target, checked before any sample is queued
    if options.store_final == "topk":
        check_k(options.store_topk, config["vocab_size"])
    # Whole blocks per layer, not only per row: a worker takes a run's layers out of a dump of more, block by block.
    if options.store_aux == "fp4" and config["hidden_size"] % FP4_BLOCK:
        raise Fp4Error(f"store_aux fp4: each layer's aux state, {config['hidden_size']} wide, is not whole blocks of "
                       f"{FP4_BLOCK}; store them full width (store_aux 'full', --store-aux full)")  # fmt: skip
    layers = options.layer_ids(num_layers)
    context = config.get("max_position_embeddings", options.max_tokens)
    target = RunMeta(
        model=settings.model,
        model_dir=str(model_dir),
        hidden_size=config["hidden_size"],
        num_layers=num_layers,
        vocab_size=config["vocab_size"],
        aux_layer_ids=layers,
        options=replace(
            options,
            aux_layer_ids=layers,
            max_tokens=min(options.max_tokens, context),
            store_dtype=options.store_dtype or settings.store_dtype,
        ),
    )
    state.update_meta(target)
    return state.meta()


def _ingest(
    redis: Redis, settings: Settings, state: RunState, meta: RunMeta, cursor: IngestResult | None
) -> IngestResult:
    run_id, dataset, model_dir = state.run_id, Path(meta.dataset), Path(meta.model_dir)
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
        state.update_meta(RunMeta(ingest_cursor=result.cursor()))
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
        meta.options or RunOptions(),
        vocab_size=meta.vocab_size,
        on_error=lambda sample_id, message: state.record_error(-1, sample_id, message, "ingest", final=True),
        on_sample=on_sample,
        result=result,
        earlier_ids=earlier_ids,
    )
    flush()
    writer.close({"dataset": str(dataset), "model_dir": str(model_dir), "bad_lines": result.bad_lines})
    state.update_meta(RunMeta(bad_lines=result.bad_lines, truncated=result.truncated, loss_tokens=result.loss_tokens))
    if result.samples == 0:
        state.fail(f"no valid sample in {dataset.name} ({result.bad_lines} bad lines)")
    state.set_total(result.samples, result.tokens)
    log.info("run %s: %d samples, %d tokens, %d bad lines", run_id, result.samples, result.tokens, result.bad_lines)
    return result


def ingest_job(run_id: str) -> dict:
    """RQ job: ``ingest_run`` with the worker's settings and connection. Queued again after its worker died
    (services/ingest/resume.py), it takes the ingest up where it last flushed."""
    process = job_process()
    return asdict(ingest_run(process.redis, process.settings, run_id))
