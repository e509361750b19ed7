"""The compose file's contract, read statically (no Docker): what is published, what needs a secret, what scales,
and that it stays inside what Debian's docker-compose 1.29 accepts."""

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
VAR = re.compile(r"\$\{([A-Z0-9_]+)(?:(:?[-?])([^}]*))?\}")
# Every service of the eaglet image, and the module it runs.
EAGLET_SERVICES = {
    "gateway": "eaglet.services.gateway.main",
    "ingest": "eaglet.services.ingest.worker",
    "inference": "eaglet.services.inference.release",
    "extractor": "eaglet.services.extractor.worker",
    "extractor-gpu": "eaglet.services.extractor.worker",
    "trainer": "eaglet.services.trainer.follow",
    "trainer-gpu": "eaglet.services.trainer.follow",
}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` (the forms the file may use)."""

    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        if op and op.startswith(":") and not value:
            value = None
        if value is not None:
            return value
        if op and op.endswith("?"):
            raise KeyError(f"{name}: {arg}")
        return arg or ""

    return VAR.sub(one, text)


def load(env: dict[str, str]) -> dict:
    return yaml.safe_load(interpolate(COMPOSE.read_text(), env))


SECRETS = {"EAGLET_REDIS_PASSWORD": "pw", "EAGLET_API_TOKEN": "tok"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return load(SECRETS)


def test_secrets_are_required():
    for name in SECRETS:
        with pytest.raises(KeyError, match=name):
            load({k: v for k, v in SECRETS.items() if k != name})


def test_only_the_gateway_and_grafana_publish_a_port_on_loopback(compose):
    published = {name: s["ports"] for name, s in compose["services"].items() if s.get("ports")}
    assert published == {"gateway": ["127.0.0.1:8000:8000"], "grafana": ["127.0.0.1:3000:3000"]}
    assert all("expose" not in s or name == "gateway" for name, s in compose["services"].items())


def test_redis_has_a_password_and_persists(compose):
    command = compose["services"]["redis"]["command"]
    assert command[command.index("--requirepass") + 1] == "pw"
    assert command[command.index("--appendonly") + 1] == "yes"
    assert "redis:/data" in compose["services"]["redis"]["volumes"]
    for name, service in compose["services"].items():
        if "EAGLET_REDIS_URL" in service.get("environment", {}):
            assert service["environment"]["EAGLET_REDIS_URL"] == "redis://:pw@redis:6379/0", name


def test_profiles_and_dependencies(compose):
    services = compose["services"]
    assert services["inference"]["profiles"] == ["cpu"] and services["inference-gpu"]["profiles"] == ["gpu"]
    for name, service in services.items():
        for dep, cond in service.get("depends_on", {}).items():
            # A dependency outside the service's profiles makes compose refuse to start it.
            assert set(services[dep].get("profiles", [])) <= set(service.get("profiles", [])), (name, dep)
            assert cond["condition"] == "service_healthy", (name, dep)
    for name in ("inference-gpu", "trainer-gpu", "evaluator-gpu"):
        assert services[name]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


def test_the_gpu_trainer_leaves_its_evaluation_to_the_evaluator_in_the_sglang_image(compose):
    services = compose["services"]
    assert services["trainer-gpu"]["environment"]["EAGLET_EVAL_SERVICE"] == "true"
    assert "EAGLET_EVAL_SERVICE" not in services["trainer"]["environment"]  # cpu: the trainer evaluates, reference
    ev = services["evaluator-gpu"]
    assert ev["profiles"] == ["gpu"] and ev["image"] == services["inference-gpu"]["image"] and "build" not in ev
    assert ev["entrypoint"] == ["python3", "-m", "eaglet.services.trainer.evaluator"]
    assert ev["environment"]["EAGLET_SGLANG_PYTHON"] == "python3" and "data:/data" in ev["volumes"]
    assert ev["environment"]["EAGLET_EVAL_ALIVE_FILE"] in ev["healthcheck"]["test"][-1]


def test_scalable_extractors_and_restart_policies(compose):
    services = compose["services"]
    for name in ("extractor", "extractor-gpu", "trainer", "trainer-gpu", "evaluator-gpu"):
        assert "container_name" not in services[name] and "ports" not in services[name]
        assert services[name]["restart"] == "unless-stopped"
    # The inference supervisor exits 0 after releasing the GPUs: only a failure may bring it back.
    assert services["inference"]["restart"] == services["inference-gpu"]["restart"] == "on-failure"


def test_volumes(compose):
    assert set(compose["volumes"]) == {"redis", "data", "models", "dump", "prometheus", "grafana"}
    assert compose["volumes"]["dump"]["driver_opts"]["type"] == "tmpfs"
    for name in ("inference", "extractor", "inference-gpu", "extractor-gpu"):
        assert "dump:/dump" in compose["services"][name]["volumes"], name


def test_compose_1_29_accepts_it(compose):
    assert not {"name", "include"} & set(compose)
    for name, service in compose["services"].items():
        assert not {"gpus", "develop", "post_start", "pull_policy"} & set(service), name
        assert "start_interval" not in service.get("healthcheck", {}), name
        for dep in service.get("depends_on", {}).values():
            assert set(dep) == {"condition"}, name
        assert all(isinstance(p, str) for p in service.get("ports", [])), name
    assert ":+" not in COMPOSE.read_text()


def test_env_example_documents_every_variable():
    used = {m.group(1) for m in VAR.finditer(COMPOSE.read_text())}
    example = (ROOT / ".env.example").read_text()
    documented = set(re.findall(r"^#?([A-Z0-9_]+)=", example, flags=re.M))
    assert used - documented == set()


def test_one_image_runs_every_eaglet_service(compose):
    services = compose["services"]
    for name, module in EAGLET_SERVICES.items():
        service = services[name]
        assert service["image"] == "eaglet:latest", name
        assert service["build"] == {
            "context": ".",
            "dockerfile": "docker/Dockerfile",
            "args": {"BASE_IMAGE": "eaglet-base:latest"},
        }, name
        assert service["command"] == ["python", "-m", module], name
        assert service["healthcheck"]["test"][:3] == ["CMD", "python", "/app/docker/healthcheck.py"], name
    images = {name: s["image"] for name, s in services.items() if "build" in s and name not in EAGLET_SERVICES}
    assert images == {"inference-gpu": "eaglet-inference-sglang:latest", "base": "eaglet-base:latest"}


def test_ingest_runs_in_every_profile(compose):
    ingest = compose["services"]["ingest"]
    assert "profiles" not in ingest and set(ingest["depends_on"]) == {"redis"}
    assert {"data:/data", "models:/models"} <= set(ingest["volumes"])


def test_the_image_runs_as_non_root_with_code_after_dependencies():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, flags=re.M)
    assert re.search(r"^USER eaglet$", text, flags=re.M)
    # Code comes after the dependencies: nothing below FROM installs packages.
    assert "pip install" not in text
    # What differs between services is compose's business.
    assert not re.search(r"^(CMD|ENTRYPOINT|HEALTHCHECK|ENV) ", text, flags=re.M)


def test_monitoring_profile_scrapes_the_gateway_with_eaglets_dashboard(compose):
    services = compose["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["monitoring"]
    for service in (prometheus, grafana):  # pinned, never latest
        assert re.fullmatch(r"(prom/prometheus|grafana/grafana):v?\d+\.\d+\.\d+", service["image"]), service["image"]
    # Every file the services mount is in the repository.
    for service in (prometheus, grafana):
        for volume in service["volumes"]:
            source = volume.split(":")[0]
            assert not source.startswith("./") or (ROOT / source).exists(), source
    scrape = yaml.safe_load((ROOT / "docker" / "monitoring" / "prometheus.yml").read_text())
    [job] = scrape["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["gateway:8000"]
    assert job["authorization"]["credentials_file"] in prometheus["entrypoint"][-1]  # the token is written there
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "tok"  # never Grafana's default admin password
    provisioning = ROOT / "docker" / "monitoring" / "grafana" / "provisioning"
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "eaglet.yml").read_text())["providers"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert (ROOT / mounted[provider["options"]["path"]] / "eaglet.json").is_file()
