"""Creating a run: the one place a run id is claimed and its record written.

The gateway's ``POST /runs`` creates the run here and queues its ingest for an ingest worker; ``eaglet
ingest`` creates it here and ingests in its own process. Either way the record holds the dataset and the
options, so whoever ingests (or takes an ingest up after its process died) needs only the run id. Light
on imports: the gateway uses it without loading a tokenizer.
"""

import logging
import time
from pathlib import Path

from redis import Redis

from eaglet.shared import keys
from eaglet.shared.ids import check_id
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState, Stage

log = logging.getLogger(__name__)


class RunExists(ValueError):
    """The run id is taken: runs are never overwritten."""


def create_run(redis: Redis, run_id: str, dataset: Path, options: RunOptions) -> RunState:
    """Claims ``run_id`` and records the run (stage ``ingesting``, or ``regenerating`` if its options ask for it)
    with its dataset and options. The claim is atomic, so two gateway replicas (or a gateway and a terminal) never
    create the same run twice."""
    check_id(run_id, "run id")
    if not Path(dataset).is_file():
        raise FileNotFoundError(f"dataset {dataset}: no such file")
    state = RunState(redis, run_id)
    if state.exists() or not redis.zadd(keys.RUNS, {run_id: time.time()}, nx=True):
        raise RunExists(f"run {run_id!r} exists already; pick another id")
    # Absolute: whoever ingests (a worker, a later --resume) may run from another folder.
    dataset = str(Path(dataset).absolute())
    if options.regenerate is None:
        state.create(dataset=dataset, options=options.to_json())
    else:  # ``dataset`` becomes the regenerated file once it is written
        state.create(Stage.regenerating, dataset=dataset, regenerate_input=dataset, options=options.to_json())
    log.info("run %s: created for %s", run_id, dataset)
    return state
