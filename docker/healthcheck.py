"""Container healthchecks, one per kind of service; exit 0 when healthy.

python docker/healthcheck.py http URL    # 200 from URL; sends the bearer token if EAGLET_API_TOKEN is set
python docker/healthcheck.py worker      # an extractor of this container beat within 3 intervals
python docker/healthcheck.py control     # an RQ worker of this container is registered on the control queue
python docker/healthcheck.py file PATH   # PATH was touched within EAGLET_HEALTH_MAX_AGE_S (default 60)
"""

import json
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path


def http(url: str) -> bool:
    request = urllib.request.Request(url)
    if token := os.environ.get("EAGLET_API_TOKEN"):
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.status == 200


def worker() -> bool:
    # Reads the heartbeat the worker itself writes to Redis: healthy means it reaches Redis and its loop runs.
    from redis import Redis

    from eaglet.shared import keys
    from eaglet.shared.config import Settings

    settings = Settings()
    redis = Redis.from_url(settings.redis_url, decode_responses=True, socket_timeout=5)
    host, now = socket.gethostname(), time.time()
    beats = [json.loads(v) for v in redis.hvals(keys.WORKERS)]
    return any(b["host"] == host and now - b["ts"] < 3 * settings.heartbeat_interval_s for b in beats)


def control() -> bool:
    # RQ forgets a worker once its own heartbeat key expires: registered means its loop runs and reaches Redis.
    from redis import Redis
    from rq import Queue, Worker

    from eaglet.shared.config import Settings
    from eaglet.shared.keys import CONTROL_QUEUE

    queue = Queue(CONTROL_QUEUE, connection=Redis.from_url(Settings().redis_url, socket_timeout=5))
    return any(w.hostname == socket.gethostname() for w in Worker.all(queue=queue))


def fresh_file(path: str) -> bool:
    return time.time() - Path(path).stat().st_mtime < float(os.environ.get("EAGLET_HEALTH_MAX_AGE_S", "60"))


def main(argv: list[str]) -> int:
    kind, *args = argv
    try:
        ok = {"http": http, "worker": worker, "control": control, "file": fresh_file}[kind](*args)
    except Exception as e:  # the check's boundary: any failure is "unhealthy", said in one line
        sys.stderr.write(f"unhealthy: {type(e).__name__}: {e}\n")
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
