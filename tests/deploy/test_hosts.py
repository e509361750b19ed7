"""Several hosts: each runs an inference server with its own dump folder and its own extractor workers, against one
Redis and one data folder. Two such "hosts" run here as real processes side by side.

One run's samples are split over both hosts and all land once in the one data folder; ``/status`` shows each
server with its host, health, model and its own extraction rate. One host's server is killed mid-run: ``/status``
shows that host down while the other goes on, and once it is back its workers' held samples are retried and done.
"""

import json
import logging
import signal

import httpx
import pytest

from eaglet.cli.stack import LocalStack
from eaglet.services.ingest.jobs import ingest_new_run
from eaglet.shared import heartbeats
from eaglet.shared.config import Settings
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.samples import SampleSet
from eaglet.shared.store import read_metadata, sample_path, samples_dir
from tests.reliability.helpers import (
    HEARTBEAT_S,
    check_outcome,
    env_of,
    free_port,
    gateway_settings,
    serve_gateway,
    wait_for,
    write_dataset,
)

log = logging.getLogger(__name__)
pytestmark = pytest.mark.slow
HOSTS = ("host-a", "host-b")


def test_report_of_one_url_on_two_hosts_is_two_servers(redis):
    """In containers every host's workers name their server ``http://inference:30000``: the host tells them apart."""
    heartbeats.report_inference(redis, "http://inference:30000", ok=True, host="host-a", model="m")
    heartbeats.report_inference(redis, "http://inference:30000", ok=False, host="host-b", detail="refused")
    servers = heartbeats.inference_servers(redis)
    assert {(s.host, s.ok) for s in servers.values()} == {("host-a", True), ("host-b", False)}


def servers_by_host(gateway_url: str) -> dict[str, dict]:
    report = httpx.get(f"{gateway_url}/status", timeout=10).json()
    return {s["host"]: s for s in report["cluster"]["inference"]}


def test_two_hosts_share_one_run_and_one_data_folder(redis, redis_server, tiny_model_dir, tmp_path):
    n, run_id = 160, "two-hosts"
    data_dir = tmp_path / "data"
    write_dataset(tmp_path / "data.jsonl", n, min_len=60)
    # Each host serves the model under its own directory name: a stored sample's metadata names its server.
    hosts = {}
    for host in HOSTS:
        model = tmp_path / f"tiny-{host}"
        model.symlink_to(tiny_model_dir, target_is_directory=True)
        hosts[host] = Settings(
            _env_file=None, redis_url=redis_server.url, data_dir=data_dir, dump_dir=tmp_path / host / "dump",
            model=str(model), inference_url=f"http://127.0.0.1:{free_port()}", heartbeat_interval_s=HEARTBEAT_S,
            dump_wait_s=10, host_name=host,
        )  # fmt: skip
    gateway_url, stop_gateway = serve_gateway(gateway_settings(redis_server.url, data_dir))
    try:
        with LocalStack(tmp_path / "logs") as stack:

            def start_server(host: str) -> None:
                s = hosts[host]
                port = s.inference_url.rsplit(":", 1)[1]
                stack.start(f"server-{host}", "eaglet.services.inference.main", "--port", port, env=env_of(s))
                stack.wait_http(f"server-{host}", f"{s.inference_url}/health", timeout=120)

            for host in HOSTS:
                start_server(host)
                for w in range(2):
                    env = env_of(hosts[host], EAGLET_HOST_NAME=host)
                    stack.start(f"{host}-w{w}", "eaglet.services.extractor.worker", "--name", f"{host}-w{w}", env=env)
            ingest_new_run(redis, hosts["host-a"], run_id, tmp_path / "data.jsonl", RunOptions())
            state = RunState(redis, run_id)

            # Both servers in /status, each with its host, its model and the rate of its own two workers (a worker
            # is counted from its first heartbeat: on a loaded machine one may extract before the other beats)
            def both_extracting() -> dict | None:
                servers = servers_by_host(gateway_url)
                ready = all(h in servers and servers[h]["samples_per_s"] > 0 and servers[h]["workers"] == 2
                            for h in HOSTS)  # fmt: skip
                return servers if ready else None

            servers = wait_for("both hosts extracting, in /status", both_extracting, 240, 0.3)
            for host in HOSTS:
                s = servers[host]
                assert s["healthy"] and s["url"] == hosts[host].inference_url and s["workers"] == 2, s
                assert s["model"] == f"tiny-{host}" and s["hidden_size"] > 0 and s["num_layers"] > 0, s
                assert len(s["aux_layer_ids"]) == 3 and s["tokens_per_s"] > s["samples_per_s"], s
            wait_for("a quarter of the run", lambda: state.counts().done >= n // 4, 240, 0.2)
            assert state.counts().done < n - 40, "the run ended before the kill: give it more samples"

            # host-b's server dies: host-b shows down, host-a goes on extracting.
            stack.procs["server-host-b"].send_signal(signal.SIGKILL)
            stack.procs["server-host-b"].wait(10)
            wait_for("host-b down in /status", lambda: not servers_by_host(gateway_url)["host-b"]["healthy"], 60, 0.3)
            done_at_kill = state.counts().done
            wait_for("host-a going on", lambda: state.counts().done >= done_at_kill + 20, 120, 0.2)
            assert servers_by_host(gateway_url)["host-a"]["healthy"]

            # host-b's server comes back: the samples its workers held are retried and stored.
            start_server("host-b")
            wait_for("the run's extraction to complete", state.extraction_complete, 240, 0.3)
            counts = check_outcome(redis, hosts["host-a"], run_id, n)
            assert counts.done == n and counts.failed == 0, counts
            errors = [json.loads(e) for e in redis.lrange(state.keys.errors, 0, -1)]
            errors = [e for e in errors if "unreachable" in e["reason"]]
            assert errors and all(e["worker"].startswith("host-b") for e in errors), errors
            wait_for("host-b healthy again", lambda: servers_by_host(gateway_url)["host-b"]["healthy"], 60, 0.3)
    finally:
        stop_gateway()
    samples = SampleSet(samples_dir(data_dir, run_id))
    made_by = [read_metadata(sample_path(data_dir, run_id, samples[i].sample_id))["model"] for i in range(n)]
    split = {host: made_by.count(f"tiny-{host}") for host in HOSTS}
    log.warning("two hosts: samples stored per host %s; retried after host-b's server died: %d", split, len(errors))
    assert sum(split.values()) == n and all(split[host] > 0 for host in HOSTS), split
