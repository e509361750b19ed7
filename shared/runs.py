"""Starting a run: the one place a run id is claimed, its record written and its first job queued.

The gateway's ``POST /runs``, ``eaglet regenerate`` and the demo start a run with ``queue_run``: the run is created
and its ingest (or first its regeneration's planning) queued on the control queue, for an ingest worker. ``eaglet
ingest`` creates it with ``create_run`` and ingests in its own process. Either way the record holds the dataset
and the options, so whoever ingests (or takes an ingest up after its process died) needs only the run id. Light on
imports: the gateway uses it without loading a tokenizer.
"""

import logging
from pathlib import Path

from redis import Redis

from . import jobqueue
from .ids import check_id
from .runoptions import RunOptions
from .runstate import RunState, Stage

log = logging.getLogger(__name__)


def create_run(redis: Redis, run_id: str, dataset: Path, options: RunOptions) -> RunState:
    """Claims ``run_id`` (``RunExists`` if it is taken) and records the run (stage ``ingesting``, or ``regenerating``
    if its options ask for it) with its dataset and options."""
    check_id(run_id, "run id")
    if not Path(dataset).is_file():
        raise FileNotFoundError(f"dataset {dataset}: no such file")
    state = RunState(redis, run_id)
    # Absolute: whoever ingests (a worker, a later --resume) may run from another folder.
    absolute = str(Path(dataset).absolute())
    if options.regenerate is None:
        state.create(dataset=absolute, options=options)
    else:  # ``dataset`` becomes the regenerated file once it is written
        state.create(Stage.regenerating, dataset=absolute, regenerate_input=absolute, options=options)
    log.info("run %s: created for %s", run_id, absolute)
    return state


def queue_run(redis: Redis, queue_redis: Redis, *, run_id: str, dataset: Path, options: RunOptions) -> str:
    """Creates the run and queues its ingest for an ingest worker, or first its regeneration's planning when the
    options ask for one (the ingest follows it in the same run); returns the job id. ``queue_redis``: RQ pickles
    its jobs, so a client that leaves replies as bytes."""
    create_run(redis, run_id, dataset, options)
    if options.regenerate is None:
        job_id = jobqueue.enqueue_ingest(queue_redis, run_id)
    else:
        job_id = jobqueue.enqueue_regeneration(queue_redis, run_id)
    log.info("run %s: %s of %s queued as %s", run_id, "ingest" if options.regenerate is None else "regeneration",
             dataset, job_id)  # fmt: skip
    return job_id
