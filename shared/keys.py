"""Every Redis key eaglet uses. One prefix per run; nothing here is ever scanned to count."""

PREFIX = "eaglet"
RUNS = f"{PREFIX}:runs"  # ZSET run id -> created (unix s)
WORKERS = f"{PREFIX}:workers"  # HASH worker name -> records.WorkerBeat (JSON)
INFERENCE = f"{PREFIX}:inference"  # HASH server url -> records.InferenceBeat (JSON), written by the workers using it
GPUS = f"{PREFIX}:gpus"  # HASH "role host pid" -> records.GpuBeat (JSON): a host's GPUs, by the process using them
EVENTS = f"{PREFIX}:events"  # pub/sub channel: JSON {"run", "event", "ts"}
CONTROL_QUEUE = f"{PREFIX}-control"  # RQ queue of run-level jobs (ingest a dataset); ingest workers listen to it
SERIES_RECORDER = f"{PREFIX}:series:recorder"  # STRING, expiring: the gateway process recording this interval's points


def queue_name(run_id: str) -> str:
    """The RQ queue of one run: its jobs are sample indexes."""
    return f"{PREFIX}-extract-{run_id}"


class RunKeys:
    """Keys of one run. ``meta`` holds settings, stage and flags; ``counts`` the O(1) counters."""

    def __init__(self, run_id: str):
        base = f"{PREFIX}:run:{run_id}"
        self.run_id = run_id
        self.meta = f"{base}:meta"  # HASH: records.RunMeta (settings, stage, flags)
        self.counts = f"{base}:counts"  # HASH: done, failed, tokens, bytes, retries, last_done_at
        self.done = f"{base}:done"  # bitmap by sample index
        self.failed = f"{base}:failed"  # bitmap by sample index
        self.failures = f"{base}:failures"  # HASH sample index -> JSON {sample_id, reason, ts, worker}
        self.errors = f"{base}:errors"  # LIST, newest first, capped: every error, transient ones too
        self.recent = f"{base}:recent"  # LIST, newest first, capped: "ts tokens bytes" per completion
        self.inflight = f"{base}:inflight"  # HASH sample index -> JSON {worker, started}
        self.attempts = f"{base}:attempts"  # HASH sample index -> attempts so far
        self.lost = f"{base}:lost"  # HASH sample index -> times the worker extracting it died
        self.abandoned = f"{base}:abandoned"  # SET sample indexes whose RQ job RQ itself found abandoned
        self.regen = f"{base}:regen"  # HASH: total, done, failed, tokens_in, tokens_out, last_done_at, complete
        self.regen_done = f"{base}:regen:done"  # bitmap by prompt index (the prompt's place among the input's prompts)
        self.regen_failed = f"{base}:regen:failed"  # bitmap by prompt index
        self.regen_recent = f"{base}:regen:recent"  # LIST, newest first, capped: "ts tokens_out tokens_in" per prompt
        self.regen_batches = f"{base}:regen:batches"  # LIST of JSON {offset, line, prompt, count}, one per batch job
        self.regen_batch_done = f"{base}:regen:batch_done"  # bitmap by batch: the batch's job ran to its end
        self.regen_lost = f"{base}:regen:lost"  # HASH batch -> times the worker running it died
        self.train = f"{base}:train"  # HASH: records.TrainProgress
        self.unreadable = f"{base}:train:unreadable"  # SET sample indexes whose stored file the trainer could not read
        self.train_lock = f"{base}:train:lock"  # STRING "host:pid" of the trainer that holds the run, with a TTL
        self.eval = f"{base}:eval"  # HASH: records.EvalResult
        self.eval_lock = f"{base}:eval:lock"  # STRING "host:pid" of the evaluator that holds the run, with a TTL
        self.evals = f"{base}:evals"  # LIST, newest first, capped: earlier evaluations' EvalResult fields as JSON
        # Capped series (shared/series.py): LIST of JSON points, oldest first; HASH interval, first, last, closed
        self.extraction_series = f"{base}:series:extraction"
        self.extraction_series_meta = f"{base}:series:extraction:meta"
        self.train_series = f"{base}:series:train"
        self.train_series_meta = f"{base}:series:train:meta"

    def all(self) -> list[str]:
        return [v for k, v in vars(self).items() if k != "run_id"]
