"""``GET /status``: every run's figures, newest first."""

from typing import Annotated

from fastapi import APIRouter, Query, Response

from eaglet.services.gateway.deps import LocalDiskDep, ReadAccessDep, RedisDep, SettingsDep, StatusConfigDep
from eaglet.shared.status import read_status
from eaglet.shared.statusreport import StatusReport

router = APIRouter(prefix="/status", tags=["status"], dependencies=[ReadAccessDep])


@router.get("", response_model=StatusReport, summary="Figures of every run, newest first")
def get_status(
    redis: RedisDep,
    settings: SettingsDep,
    config: StatusConfigDep,
    disk: LocalDiskDep,
    offset: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int | None, Query(ge=1, description="Runs per page; at most EAGLET_STATUS_MAX_RUNS")] = None,
) -> Response:
    """Extraction, storage, training and alerts of each run, and the workers and inference servers.

    Every figure is read from counters and capped windows: the cost does not grow with the samples.
    """
    limit = min(limit or 20, settings.status_max_runs)
    report = read_status(redis, config=config, offset=offset, limit=limit, local_disk=disk)
    # Serialized here: the model is built and checked once already, and FastAPI would validate it again.
    return Response(report.model_dump_json(), media_type="application/json")
