"""``GET /``: the live page. Plain HTML and a little JS that polls ``/status`` and draws each run's series
(``static/charts.js``, with the uPlot library vendored under ``static/vendor/``); no build step, no CDN."""

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parents[1] / "static"

router = APIRouter(tags=["page"])


@router.get("/", include_in_schema=False)
def index() -> FileResponse:
    # The page asks for the token itself when GETs need one: a browser can't send a bearer header to load it.
    return FileResponse(STATIC / "index.html", media_type="text/html")
