"""The evaluation service: a trainer with ``EAGLET_EVAL_SERVICE`` leaves the checkpoint choice and the evaluation to
it, the trainer service leaves such a run alone, and the evaluator (a real process) finishes it, or fails it with
the reason; an evaluator that died leaves its run to the next one."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from eaglet.services.trainer import evaluator, follow
from eaglet.services.trainer import main as trainer_main
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.status import read_run
from eaglet.shared.store import run_dir
from tests.trainer.fixtures import make_run


@pytest.fixture
def env(redis_server, tmp_path, monkeypatch) -> dict[str, str]:
    e = {"EAGLET_REDIS_URL": redis_server.url, "EAGLET_DATA_DIR": str(tmp_path), "EAGLET_EVAL_POLL_S": "0.2",
         "EAGLET_HEARTBEAT_INTERVAL_S": "0.5", "OMP_NUM_THREADS": "1"}  # fmt: skip
    for k, v in e.items():
        monkeypatch.setenv(k, v)
    return e


def trained(run: str, model, prompts, *more: str) -> int:
    return trainer_main.main(["--run", run, "--model", str(model), "--loader-workers", "0", "--draft-vocab-size",
                              "256", "--tokens-per-batch", "160", "--ttt-steps", "2", "--epochs", "2",
                              "--heldout-fraction", "0.25", "--eval-prompts", str(prompts), "--eval-k", "2",
                              "--eval-max-new-tokens", "6", *more])  # fmt: skip


def test_the_evaluation_service_finishes_what_the_trainer_left(redis, env, tmp_path, tiny_model_dir, monkeypatch):
    make_run(redis, tmp_path, tiny_model_dir, "svc", n=12)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hello."}) + "\n")
    monkeypatch.setenv("EAGLET_EVAL_SERVICE", "true")
    assert trained("svc", tiny_model_dir, prompts, "--select-by", "predicted") == 0
    state = RunState(redis, "svc")
    request = json.loads(state.meta().eval_request or "{}")
    assert state.stage() == Stage.evaluating and request["select_by"] == "predicted" and request["k"] == 2
    assert state.eval().state is None and not (run_dir(tmp_path, "svc") / "selection.json").exists()
    assert follow.next_run(redis, follow.FollowSettings(), "trainer-replica") is None  # not the trainer's any more
    beat = state.train().beat_at or 0
    time.sleep(0.3)
    waiting = read_run(redis, "svc", config=StatusConfig(lost_after_s=0.2)).run
    assert waiting.training.evaluation_attempts == 0
    [alert] = [a for a in waiting.alerts if a.kind == "trainer_lost"]  # nobody beats: it names whom to start
    assert "waits for the evaluation service" in alert.message, alert.message
    assert waiting.verdict == "waiting for the evaluation service"
    proc = subprocess.Popen([sys.executable, "-m", "eaglet.services.trainer.evaluator"], env={**os.environ, **env})
    try:
        deadline = time.time() + 120
        while state.stage() == Stage.evaluating and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert state.stage() == Stage.done, state.meta().error
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert state.eval().state == "done" and state.eval().prompts == 1
    assert json.loads((run_dir(tmp_path, "svc") / "selection.json").read_text())["select_by"] == "predicted"
    assert state.meta().eval_attempts == 1 and (state.train().beat_at or 0) > beat  # it beat for the stage
    assert redis.get(state.keys.eval_lock) is None


def test_a_failed_evaluation_fails_the_run_and_a_dead_evaluators_run_is_claimed_again(
    redis, env, tmp_path, tiny_model_dir, monkeypatch
):  # fmt: skip
    make_run(redis, tmp_path, tiny_model_dir, "bad", n=12)
    missing = tmp_path / "gone.jsonl"
    monkeypatch.setenv("EAGLET_EVAL_SERVICE", "true")
    assert trained("bad", tiny_model_dir, missing) == 0
    settings = evaluator.EvaluatorSettings(eval_lock_ttl_s=0.3, eval_max_attempts=2)
    assert evaluator.next_run(redis, settings, "a") == "bad"
    assert evaluator.next_run(redis, settings, "b") is None  # held by a
    time.sleep(0.5)  # a died without renewing: its lock expires
    assert evaluator.next_run(redis, settings, "b") == "bad"
    state = RunState(redis, "bad")
    assert not evaluator.evaluate_claimed(redis, settings, "bad", "b")
    assert state.stage() == Stage.failed and "evaluation: FileNotFoundError" in (state.meta().error or "")
    assert str(missing) in (state.meta().error or "")
    redis.hset(state.keys.meta, mapping={"stage": "evaluating", "eval_attempts": "2"})
    redis.set(state.keys.eval_lock, "b")
    assert evaluator.next_run(redis, settings, "c") is None  # out of attempts, the last one still holding it
    assert state.stage() == Stage.evaluating
    redis.delete(state.keys.eval_lock)  # ...and it died
    assert evaluator.next_run(redis, settings, "c") is None
    assert state.stage() == Stage.failed and "2 evaluators claimed the run" in (state.meta().error or "")


def test_a_stopped_evaluator_gives_the_run_back_at_once(redis, env, tmp_path, tiny_model_dir, monkeypatch):
    make_run(redis, tmp_path, tiny_model_dir, "stop", n=12)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(400)))
    monkeypatch.setenv("EAGLET_EVAL_SERVICE", "true")
    assert trained("stop", tiny_model_dir, prompts, "--eval-max-new-tokens", "48") == 0
    state = RunState(redis, "stop")
    proc = subprocess.Popen([sys.executable, "-m", "eaglet.services.trainer.evaluator"], env={**os.environ, **env})
    try:
        deadline = time.time() + 60
        while not (state.eval().prompts_done or 0) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)  # stopped well inside its 400 prompts
        assert state.eval().state == "running"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0  # not after the rest of the prompts
    finally:
        proc.kill()
    assert (state.eval().prompts_done or 0) < 400
    assert state.stage() == Stage.evaluating and not state.meta().eval_attempts  # given back, not counted
    assert redis.get(state.keys.eval_lock) is None
    assert evaluator.next_run(redis, evaluator.EvaluatorSettings(), "next") == "stop"  # the next evaluator's at once
