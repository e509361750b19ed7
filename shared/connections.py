"""eaglet's Redis clients, made here with one set of options and passed in to whatever uses them.

Two kinds: decoded (run state, records and heartbeats are text) and raw (RQ pickles its jobs, and bitmaps are
bytes). Both check an idle connection before using it and retry a command once on a timeout, so a process
outlives a Redis restart or a dropped connection. Probing whether a Redis answers (``redisserver.py``, the
images' healthcheck) uses short timeouts of its own instead.
"""

from redis import Redis

OPTIONS = {"health_check_interval": 30, "retry_on_timeout": True}


def connect(url: str) -> Redis:
    """A client whose replies are text."""
    return Redis.from_url(url, decode_responses=True, **OPTIONS)


def connect_raw(url: str) -> Redis:
    """A client whose replies are bytes: RQ's queues, bitmaps."""
    return Redis.from_url(url, **OPTIONS)
