"""``GET /metrics``: the status figures in Prometheus' text format."""

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from eaglet.services.gateway.deps import ReadAccessDep

router = APIRouter(prefix="/metrics", tags=["metrics"], dependencies=[ReadAccessDep])


@router.get("", response_class=Response, summary="Prometheus metrics, labelled by run")
def get_metrics(request: Request) -> Response:
    # The registry holds only our collector, which reads Redis now: nothing is cached between scrapes.
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)
