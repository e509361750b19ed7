"""A redis-server of eaglet's own on this host: the demo's, the tests', the benchmarks'. It listens on
127.0.0.1 only, keeps its files in one folder, and counts as started once it answers PING.

    python -m eaglet.shared.redisserver --port 6379 --dir var/redis     # leaves one running unless one answers

AOF is on by default, fsync'd every second as the compose stack runs it: an fsync per write would make the
test suite wait on the disk (a test that needs one asks for it with CONFIG SET). No RDB snapshots: the AOF
is the persistence.
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError


class RedisServerError(RuntimeError):
    """redis-server is missing, exited, or did not answer in time; the message says which, and where its log is."""


def free_port() -> int:
    """A loopback TCP port that nothing listens on right now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ping(url: str) -> bool:
    try:
        with Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2) as redis:
            return bool(redis.ping())
    except RedisError:
        return False


class RedisServer:
    """One redis-server process on 127.0.0.1:``port`` (a free one by default) with its files in ``folder``.

    ``executable`` and ``env`` are for a redis-server unpacked outside PATH, with its libraries beside it.
    Without ``log`` its output is dropped."""

    def __init__(
        self,
        folder: Path,
        port: int | None = None,
        *,
        appendonly: bool = True,
        password: str | None = None,
        executable: str = "redis-server",
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ):
        self.folder = Path(folder)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.password = password
        self.executable = executable
        self.env = env
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def __enter__(self) -> "RedisServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 10) -> None:
        exe = shutil.which(self.executable)
        if exe is None:
            raise RedisServerError(f"{self.executable} is not installed: `make redis` installs Debian's redis-server")
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder), "--save", ""]
        argv += ["--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec"]
        argv += ["--requirepass", self.password] if self.password else []
        out = open(self.log, "ab") if self.log else None
        try:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env} if self.env else None,
                start_new_session=True,  # a Ctrl-C meant for its starter does not stop it before the processes using it
            )
        finally:
            if out is not None:
                out.close()
        deadline = time.monotonic() + timeout
        where = f"; see {self.log}" if self.log else ""
        while not ping(self.url):
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                raise RedisServerError(f"redis-server on port {self.port} exited with {code}{where}")
            if time.monotonic() > deadline:
                self.stop(kill=True)
                raise RedisServerError(f"redis-server on port {self.port} did not answer within {timeout:.0f}s{where}")
            time.sleep(0.05)

    def stop(self, kill: bool = False, timeout: float = 10) -> None:
        """SIGTERM (Redis writes out its AOF and exits), or SIGKILL to test a crash; SIGKILL after ``timeout``."""
        if self.proc is None:
            return
        self.proc.kill() if kill else self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, kill: bool = False) -> None:
        self.stop(kill=kill)
        self.start()


def ensure(server: RedisServer) -> bool:
    """Starts ``server`` unless a Redis already answers at its URL; True when this call started it."""
    if ping(server.url):
        return False
    server.start()
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Leaves a redis-server running on 127.0.0.1:PORT unless one answers.")
    p.add_argument("--port", type=int, default=6379)
    p.add_argument("--dir", type=Path, default=Path("var/redis"), help="its AOF and its log")
    args = p.parse_args(argv)
    server = RedisServer(args.dir, args.port, log=args.dir / "redis.log")
    try:
        started = ensure(server)
    except RedisServerError as e:
        p.exit(1, f"{e}\n")
    sys.stdout.write(f"redis-server started on port {args.port}\n" if started else f"Redis answers on {args.port}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
