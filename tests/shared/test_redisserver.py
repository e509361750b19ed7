"""The one way eaglet starts a redis-server: ready on PING, persistent across a restart, stopped for good."""

from redis import Redis

from eaglet.shared.redisserver import RedisServer, ensure, free_port, main, ping


def test_start_restart_stop(tmp_path):
    with RedisServer(tmp_path / "redis", log=tmp_path / "redis.log") as server:
        Redis.from_url(server.url).set("k", "v")
        server.restart()  # SIGTERM writes the AOF out: the key comes back
        assert Redis.from_url(server.url).get("k") == b"v"
        assert not ensure(RedisServer(tmp_path / "other", server.port)), "a second server on a port that answers"
    assert server.proc is None and not ping(server.url)
    assert (tmp_path / "redis.log").read_text()


def test_password(tmp_path):
    with RedisServer(tmp_path, password="pw") as server:
        assert server.url.startswith("redis://:pw@") and ping(server.url)
        assert not ping(server.url.replace(":pw@", ""))


def test_command_line_leaves_one_running(tmp_path, capsys):
    port = free_port()
    assert main(["--port", str(port), "--dir", str(tmp_path)]) == 0
    url = f"redis://127.0.0.1:{port}/0"
    try:
        assert ping(url) and "started" in capsys.readouterr().out
        assert main(["--port", str(port), "--dir", str(tmp_path)]) == 0
        assert "answers" in capsys.readouterr().out
    finally:
        Redis.from_url(url).shutdown(nosave=True)
