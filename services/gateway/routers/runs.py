"""``/runs``: one run's figures, and the token-protected run control (start, cancel, retry)."""

from fastapi import APIRouter, HTTPException, Response, status

from eaglet.services.gateway import control
from eaglet.services.gateway.deps import (
    LocalDiskDep,
    QueueRedisDep,
    ReadAccessDep,
    RedisDep,
    RunIdDep,
    SettingsDep,
    StatusConfigDep,
    TokenDep,
)
from eaglet.shared.runstate import RunExists
from eaglet.shared.series import RunSeries, read_series
from eaglet.shared.status import read_run
from eaglet.shared.statusreport import RunReport

router = APIRouter(prefix="/runs", tags=["runs"])


def _field_error(field: str, message: str) -> HTTPException:
    """A 422 shaped like FastAPI's own validation errors, naming the body field."""
    return HTTPException(422, [{"type": "value_error", "loc": ["body", field], "msg": message}])


@router.get("/{run_id}", response_model=RunReport, dependencies=[ReadAccessDep], summary="Figures of one run")
def get_run(run_id: RunIdDep, redis: RedisDep, config: StatusConfigDep, disk: LocalDiskDep) -> Response:
    report = read_run(redis, run_id, config=config, local_disk=disk)
    if report is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    return Response(report.model_dump_json(), media_type="application/json")  # validated once, as in /status


@router.get("/{run_id}/series", response_model=RunSeries, dependencies=[ReadAccessDep],
            summary="Figures of one run over time")  # fmt: skip
def get_series(run_id: RunIdDep, redis: RedisDep) -> Response:
    """Extraction figures by time and training figures by step, each a capped series (at most a few hundred
    points, spread over the whole run), and the evaluation's acceptance per draft position."""
    series = read_series(redis, run_id)
    if series is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    return Response(series.model_dump_json(), media_type="application/json")


@router.post("", status_code=status.HTTP_202_ACCEPTED, dependencies=[TokenDep], summary="Start a run")
def post_run(
    body: control.StartRun, redis: RedisDep, queue_redis: QueueRedisDep, settings: SettingsDep
) -> control.RunStarted:
    """Queues the ingest of a dataset as a new run; ingest then queues every sample for extraction."""
    try:
        dataset = control.resolve_dataset(body.dataset, settings.dataset_roots)
    except control.DatasetRefused as e:
        raise _field_error("dataset", str(e)) from e
    run_id = body.run_id or control.new_run_id()
    try:
        return control.start_run(redis, queue_redis, run_id=run_id, dataset=dataset, options=body.options)
    except RunExists as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e


@router.post("/{run_id}/cancel", dependencies=[TokenDep], summary="Cancel a run")
def cancel_run(run_id: RunIdDep, redis: RedisDep, queue_redis: QueueRedisDep) -> control.Cancellation:
    """Marks the run cancelled and drops its queued samples; samples in flight finish."""
    try:
        return control.cancel_run(redis, queue_redis, run_id)
    except control.RunNotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
    except control.WrongStage as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e


@router.post("/{run_id}/retry-failed", dependencies=[TokenDep], summary="Queue the failed samples again")
def retry_failed(run_id: RunIdDep, redis: RedisDep, queue_redis: QueueRedisDep) -> control.RetryQueued:
    try:
        return control.retry_failed(redis, queue_redis, run_id)
    except control.RunNotFound as e:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(e)) from e
    except control.WrongStage as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from e
