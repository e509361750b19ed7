import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from eaglet.services.trainer import main as trainer_main
from eaglet.services.trainer.checkpoint import list_states
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.train import train
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.layers import default_layer_ids
from eaglet.shared.runstate import RunState, Stage
from eaglet.shared.series import read_series
from eaglet.shared.status import read_run
from eaglet.shared.store import checkpoints_dir, drafter_dir
from tests.trainer.fixtures import make_run

ROOT = Path(__file__).resolve().parents[2]


def small(**kw) -> TrainConfig:
    base = dict(ttt_steps=3, draft_vocab_size=512, tokens_per_batch=160, lr=3e-3, warmup_ratio=0.1, loader_workers=0,
                heldout_fraction=0.1, checkpoint_every=1000, log_every=5)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def curve(data_dir: Path, run: str) -> dict[int, float]:
    rows = [json.loads(x) for x in (checkpoints_dir(data_dir, run) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}  # a step logged twice (killed, resumed): the later one counts


def test_loss_decreases_and_drafter_is_written(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "r1")
    final = train(
        redis=redis,
        run_id="r1",
        data_dir=tmp_path,
        target_dir=tiny_model_dir,
        cfg=small(epochs=6, heldout_fraction=0.3),
        env=Dist(),
    )
    losses = list(curve(tmp_path, "r1").values())
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
    progress = RunState(redis, "r1").train()
    assert progress.step == final["step"] == progress.total_steps
    assert len(progress.acc) == 3 and progress.tokens_per_s > 0
    assert progress.last_checkpoint.endswith(".pt") and progress.heldout_loss is not None
    assert (drafter_dir(tmp_path, "r1") / "model.safetensors").is_file()
    # The page's training series: every report's figures by step, the last one the record's own.
    series = read_series(redis, "r1").training
    steps = [p.step for p in series.points]
    assert steps == sorted({*range(5, final["step"] + 1, 5), final["step"]}) and series.closed
    last, loss_at = series.points[-1], curve(tmp_path, "r1")
    assert (last.loss, last.acc, last.tokens_per_s) == (progress.loss, progress.acc, progress.tokens_per_s)
    assert all(p.loss == loss_at[p.step] and len(p.acc) == 3 for p in series.points)


def test_trainer_waits_for_the_flag(redis, tmp_path, tiny_model_dir, monkeypatch):
    make_run(redis, tmp_path, tiny_model_dir, "r2", n=12, complete=False)
    monkeypatch.setenv("EAGLET_REDIS_URL", _url(redis))
    monkeypatch.setenv("EAGLET_DATA_DIR", str(tmp_path))
    args = ["--run", "r2", "--poll-s", "0.05", "--model", str(tiny_model_dir), "--loader-workers", "0",
            "--draft-vocab-size", "256", "--tokens-per-batch", "160", "--ttt-steps", "2"]  # fmt: skip
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", trainer_main.main(args)))
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive(), "the trainer must wait for extraction_complete"
    waiting = RunState(redis, "r2").train()
    assert set(waiting.to_redis()) == {"beat_at", "host", "pid"}, waiting  # alive, beating, nothing trained
    assert RunState(redis, "r2").stage() == Stage.extracting
    assert not checkpoints_dir(tmp_path, "r2").exists()
    RunState(redis, "r2").mark_done(11, 40, 0)  # the last sample: sets extraction_complete
    thread.join(120)
    assert result.get("rc") == 0
    assert RunState(redis, "r2").stage() == Stage.done


def _url(redis) -> str:
    kw = redis.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"


def test_partial_run_trains_only_when_told(redis, tmp_path, tiny_model_dir, monkeypatch):
    make_run(redis, tmp_path, tiny_model_dir, "r3", n=12, complete=False)
    monkeypatch.setenv("EAGLET_REDIS_URL", _url(redis))
    monkeypatch.setenv("EAGLET_DATA_DIR", str(tmp_path))
    args = ["--run", "r3", "--allow-partial", "--model", str(tiny_model_dir), "--loader-workers", "0",
            "--draft-vocab-size", "256", "--tokens-per-batch", "160", "--ttt-steps", "2",
            "--heldout-fraction", "0"]  # fmt: skip
    assert trainer_main.main(args) == 0
    assert RunState(redis, "r3").train().train_samples == 11  # the undone sample is left out


@pytest.mark.timeout(300)
def test_resume_after_kill_continues_the_same_curve(redis, tmp_path, tiny_model_dir):
    cfg, reference = trained_reference(redis, tmp_path, tiny_model_dir, "kill", checkpoint_every=7)
    proc = trainer_process(redis, tmp_path, tiny_model_dir, "kill", checkpoint_every=7, loader_workers=0)
    folder = checkpoints_dir(tmp_path, "kill")
    deadline = time.time() + 120
    state = RunState(redis, "kill")
    # killed once a checkpoint is on disk and recorded (the file is written before the run's record names it)
    while (
        time.time() < deadline and not (list_states(folder) and state.train().last_checkpoint) and proc.poll() is None
    ):
        time.sleep(0.02)
    status = StatusConfig(lost_after_s=2.0)
    alive = read_run(redis, "kill", config=status).run
    assert alive.stage == Stage.training and "trainer_lost" not in [a.kind for a in alive.alerts]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(2.5)  # the heartbeat ages past lost_after_s
    lost = read_run(redis, "kill", config=status).run
    assert lost.stage == Stage.training  # nothing else can tell the trainer died...
    [alert] = [a for a in lost.alerts if a.kind == "trainer_lost"]  # ...but its heartbeat's age does
    assert "start it again (it resumes from" in alert.message, alert.message
    states = list_states(folder)
    assert states, "no checkpoint before the kill"
    resumed_from = int(states[-1].stem.split("_")[1])
    assert 0 < resumed_from < max(reference)
    assert_resumes_the_curve(redis, tmp_path, tiny_model_dir, "kill", cfg, reference, resumed_from)


def trained_reference(
    redis, data_dir: Path, model_dir: Path, run: str, checkpoint_every: int
) -> tuple[TrainConfig, dict[int, float]]:
    """The tiny run ``run`` and its twin "ref", "ref" trained through in this process (40 epochs, as
    ``trainer_process``): the config, and the loss curve an interrupted ``run`` must come back to."""
    make_run(redis, data_dir, model_dir, "ref")
    make_run(redis, data_dir, model_dir, run)
    cfg = small(epochs=40, checkpoint_every=checkpoint_every, tokens_per_batch=100)
    train(redis=redis, run_id="ref", data_dir=data_dir, target_dir=model_dir, cfg=cfg, env=Dist())
    return cfg, curve(data_dir, "ref")


def assert_resumes_the_curve(
    redis, data_dir: Path, model_dir: Path, run: str, cfg: TrainConfig, reference: dict[int, float], start: int
) -> None:
    """``run``, interrupted at step ``start``, trained again: every later step's loss is the reference's."""
    train(redis=redis, run_id=run, data_dir=data_dir, target_dir=model_dir, cfg=cfg, env=Dist())
    got = curve(data_dir, run)
    assert sorted(got) == sorted(reference)
    for step in range(start + 1, max(reference) + 1):
        assert got[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), (step, got, reference)


def trainer_process(
    redis, data_dir: Path, model_dir: Path, run: str, checkpoint_every: int, loader_workers: int
) -> subprocess.Popen:
    """The trainer's entry point as its own process (and process group) on the tiny run, 40 epochs; its log in
    ``data_dir/<run>.log``."""
    env = {**os.environ, "EAGLET_REDIS_URL": _url(redis), "EAGLET_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1",
           "EAGLET_HEARTBEAT_INTERVAL_S": "0.2"}  # fmt: skip
    args = ["--run", run, "--model", str(model_dir), "--loader-workers", str(loader_workers),
            "--draft-vocab-size", "512", "--tokens-per-batch", "100", "--ttt-steps", "3", "--lr", "3e-3",
            "--warmup-ratio", "0.1", "--heldout-fraction", "0.1", "--epochs", "40",
            "--checkpoint-every", str(checkpoint_every)]  # fmt: skip
    with (data_dir / f"{run}.log").open("wb") as log:  # the child writes to its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "eaglet.services.trainer.main", *args], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)  # fmt: skip


@pytest.mark.timeout(300)
def test_sigterm_checkpoints_the_last_step_and_the_rerun_resumes_there(redis, tmp_path, tiny_model_dir):
    """A SIGTERM to the trainer's process group (its loader's workers included) ends it at the next step with a
    checkpoint of that step, not at the checkpoint before; the rerun continues the same curve from there."""
    cfg, reference = trained_reference(redis, tmp_path, tiny_model_dir, "term", checkpoint_every=1000)
    # no regular checkpoint in the whole training: the only one is the stop's
    proc = trainer_process(redis, tmp_path, tiny_model_dir, "term", checkpoint_every=1000, loader_workers=2)
    metrics = checkpoints_dir(tmp_path, "term") / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text()) and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)
    err = (tmp_path / "term.log").read_text()
    assert proc.returncode == 143, err[-2000:]
    states = list_states(checkpoints_dir(tmp_path, "term"))
    assert len(states) == 1, states
    stopped_at = int(states[0].stem.split("_")[1])
    assert 0 < stopped_at < max(reference)
    assert f"stopped on request at step {stopped_at} of {max(reference)}" in err
    assert RunState(redis, "term").stage() == Stage.training  # not failed: a rerun resumes it
    assert_resumes_the_curve(redis, tmp_path, tiny_model_dir, "term", cfg, reference, stopped_at)


def test_checkpoint_names_and_shapes_are_what_sglang_and_vllm_load(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "r4", n=8)
    train(redis=redis, run_id="r4", data_dir=tmp_path, target_dir=tiny_model_dir,
          cfg=small(max_steps=2, draft_vocab_size=300), env=Dist())  # fmt: skip
    out = drafter_dir(tmp_path, "r4")
    config = json.loads((out / "config.json").read_text())
    target = json.loads((tiny_model_dir / "config.json").read_text())
    H, inter, V = target["hidden_size"], target["intermediate_size"], target["vocab_size"]
    heads, kv = target["num_attention_heads"], target["num_key_value_heads"]
    d = H // heads
    expected = {
        "fc.weight": [H, 3 * H],
        "input_norm.weight": [3 * H],  # the default recipe's norm before fc (SGLang's and vLLM's name)
        "midlayer.hidden_norm.weight": [H],
        "midlayer.input_layernorm.weight": [H],
        "midlayer.self_attn.q_proj.weight": [heads * d, 2 * H],
        "midlayer.self_attn.k_proj.weight": [kv * d, 2 * H],
        "midlayer.self_attn.v_proj.weight": [kv * d, 2 * H],
        "midlayer.self_attn.o_proj.weight": [H, heads * d],
        "midlayer.post_attention_layernorm.weight": [H],
        "midlayer.mlp.gate_proj.weight": [inter, H],
        "midlayer.mlp.up_proj.weight": [inter, H],
        "midlayer.mlp.down_proj.weight": [H, inter],
        "norm.weight": [H],
        "lm_head.weight": [300, H],
        "d2t": [300],
        "t2d": [V],
    }
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert shapes == expected
    assert str(d2t.dtype) == "torch.int64" and str(t2d.dtype) == "torch.bool"
    hot = d2t + __import__("torch").arange(300)  # SGLang's hot_token_id
    assert bool(t2d[hot].all()) and int(t2d.sum()) == 300
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == V and config["draft_vocab_size"] == 300 and config["hidden_size"] == H
    captured = default_layer_ids(6)  # [3, 4, 5]: inputs of layers 3, 4 and 5
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [c - 1 for c in captured]  # SGLang: +1
    assert config["eagle_aux_hidden_state_layer_ids"] == captured  # vLLM: input of layer i, as stored
