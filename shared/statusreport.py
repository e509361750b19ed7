"""What a status read returns, field by field: the gateway's JSON (``/status``, ``/runs/{id}``), its metrics and
``eaglet status`` all show these models."""

from typing import Literal

from pydantic import BaseModel, Field

from .records import GpuRole, GpuStat, Stage, WorkerRole

AlertKind = Literal["stalled", "workers_lost", "trainer_lost", "disk", "error_rate", "served_acceptance"]


class ErrorEntry(BaseModel):
    index: int = Field(description="Sample index; -1 for an ingest error (a bad line)")
    sample_id: str = Field(description="Sample id, or file:line for an ingest error")
    reason: str
    worker: str = ""
    final: bool = Field(False, description="True if the sample was given up (recorded as failed)")
    ts: float


class Extraction(BaseModel):
    total: int | None = Field(description="Samples in the run; null while ingest is still counting them")
    done: int
    failed: int
    in_flight: int
    remaining: int | None
    percent: float | None = Field(description="Samples with an outcome (done or failed) over total, in %")
    samples_per_s: float = Field(description="Completions per second over the recent window")
    tokens_per_s: float
    eta_s: float | None = Field(
        description="Tokens of the samples left over tokens_per_s (samples differ in length, tokens are the work); "
        "null when unknown"
    )
    tokens_remaining: int | None = Field(None, description="Tokens of the samples without an outcome")
    stalled_since: float | None = Field(
        None,
        description="When the newest sample completed, while none has for longer than the usual interval "
        "allows: the ETA is withheld (null) until samples complete again",
    )
    error_rate: float | None = Field(description="Failed samples over samples with an outcome")
    recent_error_rate: float | None = Field(description="Errored attempts over all attempts in the recent window")
    recent_attempts: int = Field(description="Attempts (completions and errors) in the recent window")
    errors: int = Field(description="Errors recorded so far, transient ones and ingest errors included")
    retries: int
    started_at: float | None
    completed_at: float | None
    last_done_at: float | None
    seconds_since_last_done: float | None
    last_errors: list[ErrorEntry]
    wall_s: float | None = Field(None, description="From the start of extraction to its end, once complete")
    mean_samples_per_s: float | None = Field(None, description="Samples with an outcome over wall_s, once complete")
    mean_tokens_per_s: float | None = Field(None, description="Tokens stored over wall_s, once complete")


class Regeneration(BaseModel):
    total: int | None = Field(description="Prompts in the input; null while it is being cut into batches")
    done: int
    failed: int = Field(description="Prompts given up: bad lines, or the endpoint kept failing (see last_errors)")
    remaining: int | None
    percent: float | None
    prompts_per_s: float = Field(description="Prompts answered per second over the recent window")
    tokens_in: int = Field(description="Prompt tokens sent, every turn of every conversation")
    tokens_out: int = Field(description="Tokens the target wrote")
    tokens_out_per_s: float
    eta_s: float | None = Field(
        description="Prompts left over prompts_per_s: an answer's length is not known before it is written"
    )
    retries: int = Field(description="Requests tried again (429, 5xx, timeouts)")
    error_rate: float | None = Field(description="Failed prompts over prompts with an outcome")
    started_at: float | None
    completed_at: float | None = Field(description="When the regenerated file was written")
    last_done_at: float | None
    seconds_since_last_done: float | None
    stalled_since: float | None = Field(None, description="As extraction's: the ETA is withheld meanwhile")
    wall_s: float | None = Field(None, description="From the start of regeneration to the file, once written")
    mean_prompts_per_s: float | None = None
    mean_tokens_out_per_s: float | None = None


class Storage(BaseModel):
    bytes_written: int
    tokens_written: int
    bytes_per_token: float | None
    layout: str | None = Field(None, description="What the run keeps of the states: final state, aux states")
    expected_bytes_per_token: float | None = Field(
        None,
        description="The run's storage counted (shared/layout.py): the projection's, until a sample is stored",
    )
    total_tokens: int | None = Field(description="Tokens of every ingested sample")
    projected_total_bytes: int | None = Field(
        description="bytes_per_token (else expected_bytes_per_token) x total_tokens"
    )
    projected_remaining_bytes: int | None = Field(description="What is still to be written")
    disk_free: int | None = Field(description="Free bytes on the data volume")
    disk_total: int | None


class Training(BaseModel):
    step: int | None
    total_steps: int | None
    percent: float | None
    loss: float | None
    accuracy: float | None = Field(description="Top-1 accuracy of the first draft position")
    accuracy_per_position: list[float] | None = Field(description="One accuracy per training-time-test step")
    tokens_per_s: float | None
    eta_s: float | None
    last_checkpoint: str | None
    selection: str | None = Field(
        None, description="Which kept epoch's drafter the run exported and on what figure (--select-by); None: the last"
    )
    state: str | None = Field(description="The trainer's state, from the run's stage: waiting, training, done, failed")
    error: str | None = Field(description="Why the training failed, when it did")
    unreadable_samples: int = Field(
        0, description="Samples whose stored file could not be read, skipped (each in extraction.last_errors)"
    )
    seconds_since_update: float | None
    seconds_since_beat: float | None = Field(description="Age of the trainer process's heartbeat")
    evaluation_attempts: int | None = Field(
        None,
        description="Set while the evaluation service holds the run's evaluation (the trainer left it there): "
        "how many evaluators claimed it so far, 0 while none has; the heartbeat is then the evaluator's",
    )


class Alert(BaseModel):
    kind: AlertKind
    message: str


class RunStatus(BaseModel):
    run_id: str
    stage: Stage
    created_at: float | None
    dataset: str | None
    model: str | None
    error: str | None = Field(description="Why the run failed, when it did")
    regeneration: Regeneration | None = Field(None, description="Only for a run that starts with regeneration")
    extraction: Extraction
    storage: Storage
    training: Training
    evaluation: dict[str, float | str] = Field(description="Acceptance length and friends, once evaluated")
    earlier_evaluations: list[dict[str, float | str]] = Field(
        [], description="The run's earlier evaluations, newest first (another engine, target quantization, drafter)"
    )
    alerts: list[Alert]
    verdict: str = Field("", description="In a few words: running, stalled for 3 min ..., waiting for GPUs, "
                         "training, done, failed: reason")  # fmt: skip
    brief: str = Field("", description="The run in one line: done / total and percent, rates, errors and their "
                       "share, disk used and free, ETA, its GPUs, the verdict")  # fmt: skip
    lines: dict[str, str] = Field(
        default_factory=dict,
        description="One line of words per stage the run has: regeneration, extraction, "
        "storage, training, evaluation (what the page and `eaglet status` print)",
    )


class WorkerStatus(BaseModel):
    name: str
    state: str
    role: WorkerRole
    host: str
    pid: int | None
    inference_url: str
    run: str
    sample: str
    detail: str
    seconds_since_heartbeat: float
    lost: bool
    stage_seconds: dict[str, float] = Field(
        description="Mean seconds of each stage of its recent samples: prefill (waiting on the inference server), "
        "dump_wait, check, store. A worker mostly in prefill is waiting on the server; in store, on the disk"
    )


class InferenceStatus(BaseModel):
    url: str
    host: str = Field("", description="the host of the workers that use it (EAGLET_HOST_NAME)")
    ok: bool
    healthy: bool = Field(description="ok, and reported within the lost-after interval")
    detail: str
    model: str
    hidden_size: int | None = None
    num_layers: int | None = None
    aux_layer_ids: list[int] | None = Field(None, description="the layers it captures")
    seconds_since_report: float
    workers: int = Field(0, description="live extractor workers that use it")
    samples_per_s: float = Field(0.0, description="samples its live workers stored per second, over their last minute")
    tokens_per_s: float = 0.0
    dump_backpressure: float | None = Field(
        None, description="share of the recent time the server's forwards waited for its dump writer (0-1)"
    )
    dump_queued_bytes: int | None = None
    dump_cap_bytes: int | None = None


class GpuHostStatus(BaseModel):
    role: GpuRole = Field(description="inference: the inference supervisor's server; trainer: a trainer's")
    host: str
    pid: int | None
    run: str = Field(description="The run a trainer trains; empty for an inference server")
    gpus: list[GpuStat] | None = Field(description="Utilization (%) and memory (bytes) per GPU; null: unknown")
    detail: str = Field(description="Why the GPUs are unknown (no NVML here, a driver error)")
    seconds_since_report: float
    live: bool = Field(description="Reported within the lost-after interval")


class Cluster(BaseModel):
    workers: list[WorkerStatus] = Field(description="Live workers, and those lost within forget_after_s")
    workers_live: int
    workers_lost: int = Field(description="Lost workers listed in workers")
    workers_gone: int = Field(0, description="Workers lost longer ago than forget_after_s: counted, not listed")
    inference: list[InferenceStatus] = Field(description="Servers in service: their workers report them")
    inference_gone: list[InferenceStatus] = Field(
        default_factory=list,
        description="Servers out of service: no worker reported them within lost_after_s, or down while no run "
        "(of those read) regenerates or extracts: a finished run's",
    )
    gpus: list[GpuHostStatus] = Field(
        default_factory=list, description="The GPUs of each inference supervisor and trainer that reported lately"
    )
    disk_free: int | None
    disk_total: int | None


class StatusReport(BaseModel):
    generated_at: float
    runs_total: int
    offset: int
    limit: int
    runs: list[RunStatus] = Field(description="Newest first")
    cluster: Cluster


class RunReport(BaseModel):
    generated_at: float
    run: RunStatus
    cluster: Cluster
