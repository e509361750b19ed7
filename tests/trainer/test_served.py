"""The SGLang evaluation on the CPU: its server commands as SGLang 0.5.17's own parser reads them, the server
lifecycle and ``decode`` against a real server speaking SGLang's ``/generate`` (eaglet's reference server on the
tiny Llama), the acceptance figures from histograms, and ``eaglet eval``'s engine flags."""

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from eaglet.cli import main as cli
from eaglet.services.inference.batcher import Batcher
from eaglet.services.inference.engine import ReferenceEngine
from eaglet.services.inference.server import create_app
from eaglet.services.trainer import evaluate, served
from eaglet.services.trainer import main as trainer_main
from eaglet.services.trainer.checkpoint import save_dflash
from eaglet.services.trainer.dflash import DFlashConfig, DFlashDrafter
from eaglet.shared.acceptance import position_acceptance
from eaglet.shared.dumpwriter import DumpWriter
from eaglet.shared.redisserver import free_port
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.runstate import RunState
from eaglet.shared.store import run_dir
from tests.trainer.fixtures import make_run
from tests.trainer.test_dflash_sglang import PATHS, ROOT, SGLANG_PY

CASES = ROOT / "tests" / "trainer" / "sglang_args_cases.py"
PROMPTS = [[300 + 7 * i + j for j in range(6 + i)] for i in range(5)]


@pytest.fixture
def dflash_dir(tmp_path):
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=300, num_target_layers=6, target_layer_ids=[1, 3],
                       block_size=5, mask_token_id=299)  # fmt: skip
    drafter = DFlashDrafter(cfg, torch.randn(300, 32))
    return save_dflash(tmp_path / "dflash", drafter, {"num_hidden_layers": 6, "eos_token_id": 2}, torch.float32)


def test_sglang_parses_the_commands_as_meant(tmp_path, dflash_dir):
    if not SGLANG_PY.exists():
        pytest.fail(f"{SGLANG_PY.relative_to(ROOT)} is missing: run `make install` (scripts/install-sglang-cpu.sh)")
    eagle = tmp_path / "eagle3"
    assert served.drafter_method(dflash_dir) == "dflash" and served.drafted_positions(dflash_dir, None) == 4
    commands = [
        served.sglang_command(
            "python", tmp_path / "target", eagle, "eagle3", (4, 1, 5), 31001, "fp8", ("--mem-fraction-static", "0.7")
        ),  # fmt: skip
        served.sglang_command("python", tmp_path / "target", eagle, "eagle3", None, 31002),
        served.sglang_command(
            "python", tmp_path / "target", dflash_dir, served.drafter_method(dflash_dir), None, 31003
        ),
        served.sglang_command("python", tmp_path / "target", None, None, None, 31004, "fp8"),
    ]
    assert all(c[:3] == ["python", "-m", "sglang.launch_server"] for c in commands)
    (tmp_path / "commands.json").write_text(json.dumps([c[3:] for c in commands]))
    proc = subprocess.run(
        [str(SGLANG_PY), str(CASES), str(tmp_path / "commands.json"), str(tmp_path / "parsed.json")],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*PATHS["0.5.17"], ROOT]))},
    )  # fmt: skip
    assert proc.returncode == 0, f"cases failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    result = json.loads((tmp_path / "parsed.json").read_text())
    assert result["version"] == "0.5.17"
    chain, default, dflash, alone = result["parsed"]
    assert chain == {
        "model_path": str(tmp_path / "target"), "host": "127.0.0.1", "port": 31001, "quantization": "fp8",
        "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(eagle), "speculative_num_steps": 4,
        "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 5,
        "speculative_draft_model_quantization": "unquant",  # the target quantized, the drafter as trained
        "mem_fraction_static": 0.7,
    }  # fmt: skip
    assert (default["speculative_num_steps"], default["speculative_eagle_topk"]) == (3, 1)
    assert default["speculative_num_draft_tokens"] == 4 and default["quantization"] is None
    assert dflash["speculative_algorithm"] == "DFLASH" and dflash["speculative_draft_model_path"] == str(dflash_dir)
    assert dflash["speculative_num_steps"] is None and dflash["speculative_num_draft_tokens"] is None  # its config's
    assert alone["speculative_algorithm"] is None and alone["quantization"] == "fp8"
    assert alone["speculative_draft_model_quantization"] is None


def test_commands_the_evaluation_refuses(tmp_path, dflash_dir):
    with pytest.raises(ValueError, match="fp8"):
        served.sglang_command("python", tmp_path, None, None, None, 1, "int4")
    with pytest.raises(ValueError, match="extra SGLang flags --port:"):
        served.sglang_command("python", tmp_path, None, None, None, 1, extra=("--port", "9"))
    with pytest.raises(ValueError, match="--speculative-num-steps=2"):
        served.ServedConfig(python="python", extra=("--speculative-num-steps=2",))
    assert served.ServedConfig(python="python", extra=("--model-impl", "sglang")).extra[0] == "--model-impl"
    with pytest.raises(ValueError, match=r"steps \+ 1 \(3,1,4\)"):
        served.sglang_command("python", tmp_path, tmp_path, "eagle3", (3, 1, 5), 1)
    with pytest.raises(ValueError, match="DFlash drafter takes none"):
        served.drafted_positions(dflash_dir, (3, 1, 4))
    with pytest.raises(ValueError, match="concurrency"):
        served.ServedConfig(python="python", concurrency=0)


def test_position_acceptance_from_histograms():
    # entry n: verify steps that accepted exactly n drafts; summed [1, 3, 3] over 7 steps
    assert position_acceptance([[1, 2, 3], [0, 1]]) == {
        "accepted_drafts_histogram": [1, 3, 3], "accept_rate_per_position": [round(6 / 7, 4), round(3 / 7, 4)],
    }  # fmt: skip
    assert position_acceptance([[], []]) == {}
    # requests of unequal histogram lengths (chain of 3 drafts): summed [2, 4, 3, 1] over 10 steps
    s = position_acceptance([[2, 1, 1, 0], [0, 3, 2, 1]])
    assert s["accepted_drafts_histogram"] == [2, 4, 3, 1] and s["accept_rate_per_position"] == [0.8, 0.4, 0.1]
    decoded = served.Decoded(texts=["a"], completion_tokens=21, verify_steps=7, histogram=[1, 3, 3], wall_s=2.0)
    assert decoded.accept_length == 3.0 and decoded.accept_rate == [0.8571, 0.4286] and decoded.tok_s == 10.5


@pytest.fixture
def reference_url(tmp_path, tiny_model_dir):
    """eaglet's reference server on the tiny Llama, over real HTTP: uvicorn in a thread of the test process."""
    engine = ReferenceEngine(tiny_model_dir, device="cpu")
    batcher = Batcher(engine, DumpWriter(tmp_path / "dump"), dump=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, batcher), host="127.0.0.1", port=port,
                                           log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the reference server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_decode_against_a_server_speaking_sglangs_generate(reference_url):
    first = served.decode(reference_url, PROMPTS, 8, 2)
    again = served.decode(reference_url, PROMPTS, 8, 3)
    assert first.texts == again.texts and len(first.texts) == len(PROMPTS)  # greedy, in any batch
    assert 0 < first.completion_tokens <= 8 * len(PROMPTS)
    assert first.verify_steps == 0 and first.accept_length is None and first.accept_rate == []  # the target alone
    assert first.tok_s > 0
    with pytest.raises(served.EngineFailed, match="answered 400"):  # a prompt outside the vocabulary
        served.decode(reference_url, [[10**9]], 4, 1)


# a server of the standard library: /health only, as eaglet's reference server (no /health_generate)
HEALTH_ONLY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
print("listening", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_is_ready_on_its_health_check_and_stopped_on_leaving(tmp_path):
    port = free_port()
    log_path = tmp_path / "logs" / "server.log"
    with served.serving([sys.executable, "-c", HEALTH_ONLY, str(port)], port=port, log_path=log_path) as url:
        assert url == f"http://127.0.0.1:{port}" and httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
    assert "listening" in log_path.read_text()


def test_a_server_that_dies_or_hangs_fails_clearly(tmp_path):
    died = [sys.executable, "-c", "import sys; print('no model at /nowhere', flush=True); sys.exit(3)"]
    with pytest.raises(served.EngineFailed) as e, served.serving(died, port=free_port(), log_path=tmp_path / "d.log"):
        pass
    assert "sglang on http://127.0.0.1:" in str(e.value) and "exited with 3" in str(e.value)
    assert "no model at /nowhere" in str(e.value)
    hangs = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    with pytest.raises(served.EngineFailed, match=r"did not answer /health_generate within 1s(.|\n)*loading"):
        with served.serving(hangs, port=free_port(), log_path=tmp_path / "h.log", timeout_s=1):
            pass


def test_eval_engine_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--help"])
    assert e.value.code == 0 and "--engine {reference,sglang}" in capsys.readouterr().out
    base = ["--run", "r", "--prompts", str(tmp_path / "p.jsonl")]
    for given, says in (
        (["--target-quantization", "fp8"], "--target-quantization: only with --engine sglang"),
        (["--engine", "reference", "--chain", "3,1,4"], "--chain: only with --engine sglang"),
        (["--engine", "sglang", "--k", "3"], "--k is the reference engine's"),
        (["--engine", "sglang", "--chain", "3,1,5"], "steps + 1"),
        (["--engine", "sglang", "--target-quantization", "int4"], "invalid choice: 'int4'"),
    ):
        with pytest.raises(SystemExit) as e:
            evaluate.main(base + given)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_eval_engine_is_a_run_option():
    assert RunOptions().eval_engine == "reference"
    assert RunOptions.from_json(RunOptions(eval_engine="sglang").to_json()).eval_engine == "sglang"
    with pytest.raises(ValueError, match="eval_engine='vllm'"):
        RunOptions(eval_engine="vllm")  # type: ignore[arg-type]


def test_the_trainers_hand_off_follows_the_runs_eval_engine(redis, tmp_path, tiny_model_dir, monkeypatch):
    make_run(redis, tmp_path, tiny_model_dir, "hand", n=6, options=RunOptions(eval_engine="sglang"))
    kw = redis.connection_pool.connection_kwargs
    monkeypatch.setenv("EAGLET_REDIS_URL", f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}")
    monkeypatch.setenv("EAGLET_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("EAGLET_SGLANG_PYTHON", sys.executable)  # a Python without SGLang: its server cannot start
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hello."}) + "\n")
    args = ["--run", "hand", "--model", str(tiny_model_dir), "--loader-workers", "0", "--draft-vocab-size", "256",
            "--tokens-per-batch", "160", "--ttt-steps", "2", "--max-steps", "1", "--heldout-fraction", "0",
            "--eval-prompts", str(prompts)]  # fmt: skip
    assert trainer_main.main(args) == 1
    state = RunState(redis, "hand")
    assert state.eval().engine == "sglang" and state.eval().state == "failed"  # started in SGLang, then failed
    assert "No module named 'sglang'" in (state.eval().error or "")
    error = state.meta().error or ""
    assert "EngineFailed: sglang on http://127.0.0.1:" in error and "No module named 'sglang'" in error
    assert (run_dir(tmp_path, "hand") / "eval" / "sglang-target.log").exists()
