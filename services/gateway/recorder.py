"""Records each run's extraction figures over time into its capped series (shared/series.py).

The points are the figures of ``/status``: ``read_status`` computes them, as for a request, and a background task
of the gateway writes them every ``EAGLET_SERIES_INTERVAL_S``. Several gateway processes record once: the one
that takes the interval's Redis lock writes, the others skip the interval. ``GET /status`` itself stays read-only.
"""

import asyncio
import logging
import time
from collections.abc import Callable

from redis import Redis

from eaglet.shared import keys
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.records import Stage
from eaglet.shared.series import extraction_point, extraction_series
from eaglet.shared.status import read_status

log = logging.getLogger(__name__)
RECORDING = frozenset({Stage.ingesting, Stage.extracting})
"""Stages whose figures move: a point every interval. A run past them gets its final point, once."""


class Recorder:
    def __init__(
        self,
        redis: Redis,
        config: StatusConfig,
        *,
        max_runs: int,
        interval_s: float,
        local_disk: Callable[[], tuple[int, int] | None],
    ):
        self.redis, self.config, self.max_runs = redis, config, max_runs
        self.interval_s, self.local_disk = interval_s, local_disk

    def record(self, now: float | None = None) -> int:
        """One interval's points, if no other gateway process took this interval; returns how many were written."""
        if not self.redis.set(keys.SERIES_RECORDER, "1", nx=True, px=max(1, int(self.interval_s * 1000))):
            return 0
        now = time.time() if now is None else now
        report = read_status(self.redis, config=self.config, limit=self.max_runs, local_disk=self.local_disk(), now=now)
        written = 0
        for run in report.runs:
            if run.stage not in RECORDING and run.extraction.total is None:
                continue  # ended before its ingest counted the samples: nothing was extracted
            series = extraction_series(self.redis, run.run_id, self.interval_s)
            point = extraction_point(run, report.cluster.workers, now)
            written += series.append(now, point, close=run.stage not in RECORDING)
        return written

    async def run_forever(self) -> None:
        """Records every interval until cancelled; a failed interval (Redis away) is logged and the next one tried."""
        while True:
            try:
                await asyncio.to_thread(self.record)
            except Exception:
                log.warning("series recorder: recording failed; trying again in %.1f s", self.interval_s, exc_info=True)
            await asyncio.sleep(self.interval_s)
