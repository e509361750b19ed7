"""``eaglet demo`` end to end, as a newcomer runs it, on the tiny Llama: regenerate → ingest → extract → train →
eval."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, free_port


@pytest.mark.slow
def test_demo_runs_to_a_drafter_and_its_acceptance_length(tmp_path, redis_server, tiny_model_dir):
    env = {
        **os.environ,
        "EAGLET_MODEL": str(tiny_model_dir),
        "EAGLET_REDIS_URL": redis_server.url,
        "EAGLET_DATA_DIR": str(tmp_path / "data"),
        "EAGLET_DUMP_DIR": str(tmp_path / "dump"),
        "EAGLET_DATASET_ROOTS": str(tmp_path),
    }
    argv = [
        "--limit",
        "12",
        "--max-steps",
        "2",
        "--eval-prompts",
        "3",
        "--regenerate-prompts",
        "3",
        "--port",
        str(free_port()),
        "--gateway-port",
        str(free_port()),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "eaglet.cli.main", "demo", *argv],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = " ".join((done.stdout + done.stderr).split())  # the console wraps long lines
    assert done.returncode == 0, out
    assert "extraction complete: 12 done, 0 failed" in out
    assert "acceptance length" in out and "outputs equal plain greedy: yes" in out
    assert "regenerated 3 prompts (0 failed)" in out
    runs = sorted((tmp_path / "data" / "runs").iterdir())
    [run_dir] = [r for r in runs if not r.name.endswith("-regenerate")]
    [regenerated] = [r / "regenerated.jsonl" for r in runs if r.name.endswith("-regenerate")]
    assert len(regenerated.read_text().splitlines()) == 3
    assert (run_dir / "drafter" / "config.json").is_file() and (run_dir / "drafter" / "model.safetensors").is_file()
    assert len(list((run_dir / "hidden").rglob("*.safetensors"))) == 12
