"""The stack as local processes, without Docker: Redis (if none answers), the reference inference
server, extractor workers, the gateway. The demo and the end-to-end tests start it the same way.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

from eaglet.shared.redisserver import RedisServer, RedisServerError, ping


class StackError(RuntimeError):
    """A process of the stack did not come up; the message names it and its log."""


class LocalStack:
    """Starts processes with their logs in ``log_dir``; ``stop`` (or leaving the ``with``) ends them all."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "LocalStack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, name: str, module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a signal to the demo does not hit the services before it stops them
        )
        self.procs[name] = proc
        return proc

    def wait_http(self, name: str, url: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise StackError(f"{name} exited with {self.procs[name].returncode}; see {self.log_dir / name}.log")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise StackError(f"{name} did not answer {url} within {timeout:.0f}s; see {self.log_dir / name}.log")

    def ensure_redis(self, url: str, data_dir: Path) -> None:
        """Uses the Redis at ``url`` if it answers; else starts a local redis-server (AOF on) there."""
        if ping(url):
            return
        parsed = urlparse(url)
        if parsed.hostname not in ("127.0.0.1", "localhost"):
            raise StackError(f"no Redis answers at {url}, and none can be started on another host")
        server = RedisServer(data_dir, parsed.port or 6379, log=self.log_dir / "redis.log")
        try:
            server.start()
        except RedisServerError as e:
            raise StackError(str(e)) from e
        self.procs["redis"] = server.proc

    def stop(self, name: str | None = None, timeout: float = 20) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; Redis last, so the others can say goodbye to it."""
        names = [name] if name else sorted(self.procs, key=lambda n: n == "redis")
        for n in names:
            proc = self.procs.get(n)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for n in names:
            proc = self.procs.pop(n, None)
            if proc is None:
                continue
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
