"""The trainer speed bench (bench/gpu/trainspeed.py) run whole on CPU at a tiny shape: the real trainer and loader on
synthetic runs in the store's format, its rows and table, an out-of-memory as a row, the deadline's skips."""

import importlib
import json
import sys

import pytest
import torch

from eaglet.services.trainer.model import Drafter, drafter_config

TINY_ENV = {"TRAINSPEED_SHAPES": "tiny", "TRAINSPEED_LENGTHS": "64,128", "TRAINSPEED_STEPS": "3"}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices on a busy CPU: intra-op threads spend longer waiting for each other than computing (a row
    takes seconds with two threads, a fraction of one with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(tmp_path, monkeypatch, **env):
    """phases and trainspeed imported afresh: their folders and settings follow the environment at import."""
    for k, v in {"OUT": str(tmp_path / "out"), "GPUBENCH_ROOT": str(tmp_path / "root"), **TINY_ENV, **env}.items():
        monkeypatch.setenv(k, v)
    from bench.gpu import harness, trainspeed

    importlib.reload(harness)
    return importlib.reload(trainspeed)


def run(ts, monkeypatch, *phases) -> int:
    monkeypatch.setattr(sys, "argv", ["trainspeed.py", *phases])
    return ts.P.main(ts.PHASES, ts.ESTIMATE_S)


def rows(ts, phase) -> list[dict]:
    return json.loads((ts.P.OUT / f"{phase}.json").read_text())["rows"]


def test_both_phases_train_every_row_and_write_their_figures(tmp_path, monkeypatch):
    ts = load(tmp_path, monkeypatch, TRAINSPEED_FLAGS_B="--lr 3e-4 --loader-workers 0")
    assert run(ts, monkeypatch, "trainspeed", "trainspeed-b") == 0
    for phase, lr in (("trainspeed", 1e-3), ("trainspeed-b", 3e-4)):
        record = json.loads((ts.P.OUT / f"{phase}.json").read_text())
        assert record["config"]["lr"] == lr and "lm_head" in record["flops_formula"]
        assert [(r["shape"], r["T"], r["outcome"]) for r in record["rows"]] == [("tiny", 64, "measured"),
                                                                                 ("tiny", 128, "measured")]  # fmt: skip
        for r in record["rows"]:
            assert r["tokens_per_s"] > 0 and r["timed_steps"] == 1 and len(r["step_s"]) == 2
            assert 0 < r["mfu"] < r["mfu_with_target"]
            assert r["samples"] == 3 and r["target_top_is_next_token"] == 1.0  # the OOV mask keeps every loss position
            f = r["flops"]
            assert set(f["terms"]) == {"fc", "layer", "attention_causal", "attention_ttt_diagonal", "lm_head",
                                       "lm_head_positions"}  # fmt: skip
            assert f["train_per_sample"] == pytest.approx(f["train_per_token"] * r["T"]) and f["target_per_sample"] > 0
            assert f["terms"]["lm_head_positions"] == 7 * r["T"] // 2  # the masked-in second half, at each TTT step
    assert not list((ts.DATA / "runs").iterdir())  # each row's run removed behind it
    table = (ts.P.OUT / "trainspeed.md").read_text()
    assert "| tiny | 128 |" in table and "## trainspeed-b: trainer flags `--lr 3e-4 --loader-workers 0`" in table
    assert "tokens/s vs trainspeed" in table


def test_the_flop_count_uses_the_drafters_own_matmul_shapes(tmp_path, monkeypatch):
    ts = load(tmp_path, monkeypatch)
    cfg = ts.TrainConfig()
    for name in ("kimi", "l8b", "tiny"):
        text = ts.SHAPES[name].text
        f = ts.flops(text, cfg, 2048, oov=True)
        shape = drafter_config(text, vocab_size=text["vocab_size"], draft_vocab_size=f["drafter"]["draft_vocab"])
        with torch.device("meta"):
            drafter = Drafter(shape, torch.empty(text["vocab_size"], text["hidden_size"]))
        matmuls = sum(m.weight.numel() for m in drafter.modules() if isinstance(m, torch.nn.Linear))
        assert f["drafter_matmul_params"] == matmuls
    assert ts.flops(ts.SHAPES["kimi"].text, cfg, 2048, oov=True)["drafter"] | {"intermediate": 0} == {
        "hidden": 7168, "heads": 56, "kv_heads": 8, "head_dim": 128, "intermediate": 0, "draft_vocab": 32768,
    }  # fmt: skip


def test_an_out_of_memory_is_a_row_and_the_longer_lengths_are_skipped(tmp_path, monkeypatch):
    ts = load(tmp_path, monkeypatch, TRAINSPEED_FLAGS_B="--no-such-option 3")
    message = (
        "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 139.81 GiB of which 1.02 GiB "
        "is free. Including non-PyTorch memory, this process has 138.77 GiB memory in use."
    )

    # No GPU here: the drafter's forward raises the error CUDA's allocator would, at the first length.
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError(message)

    monkeypatch.setattr(Drafter, "unroll", out_of_memory)
    assert run(ts, monkeypatch, "trainspeed", "trainspeed-b") == 1  # trainspeed-b's unknown option fails it alone
    oom, after = rows(ts, "trainspeed")
    assert oom["outcome"] == "oom" and oom["tried_to_allocate_GiB"] == 1.5 and oom["process_in_use_GiB"] == 138.77
    assert oom["steps_done"] == 0 and "Tried to allocate" in oom["message"]
    assert after == {"shape": "tiny", "T": 128, "outcome": "skipped", "why": "out of memory at 64 tokens"}
    assert "OOM: tried to allocate 1.5 GiB" in (ts.P.OUT / "trainspeed.md").read_text()
    assert "--no-such-option" in json.loads((ts.P.OUT / "trainspeed-b.json").read_text())["error"]


def test_a_length_the_memory_rule_refuses_is_a_row_and_the_longer_lengths_are_skipped(tmp_path, monkeypatch):
    ts = load(tmp_path, monkeypatch)
    cfg = ts.TrainConfig()
    shape = ts.rule_shape(ts.SHAPES["tiny"].text, cfg)
    budget = sum(ts.estimate(shape, T, cfg).total_gib for T in (64, 128)) / 2  # 64 tokens fit, 128 do not
    ts = load(tmp_path, monkeypatch, TRAINSPEED_FLAGS=f"--memory-gib {budget!r}", TRAINSPEED_LENGTHS="64,128,256")
    assert run(ts, monkeypatch, "trainspeed") == 0
    fits, refused, skipped = rows(ts, "trainspeed")
    assert fits["outcome"] == "measured" and fits["rule_GiB"] <= refused["rule_GiB"]
    assert refused["outcome"] == "refused" and "rows of up to 128 tokens" in refused["message"]
    assert skipped == {"shape": "tiny", "T": 256, "outcome": "skipped", "why": "refused at 128 tokens"}
    assert "refused by the trainer's memory rule" in (ts.P.OUT / "trainspeed.md").read_text()


def test_rows_that_would_pass_the_deadline_are_skipped_with_their_estimate(tmp_path, monkeypatch):
    ts = load(tmp_path, monkeypatch, GPUBENCH_DEADLINE_S="25")  # the phase starts; the rows leave no margin
    assert run(ts, monkeypatch, "trainspeed") == 0
    skipped = rows(ts, "trainspeed")
    assert [r["outcome"] for r in skipped] == ["skipped", "skipped"]
    assert skipped[0]["why"].startswith("estimated ") and skipped[0]["why"].endswith(" s left")


def test_the_compile_phase_interleaves_off_and_on_and_summarizes_their_spread(tmp_path, monkeypatch):
    from eaglet.services.trainer import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")  # inductor's C++ builds: minutes on this CPU
    ts = load(tmp_path, monkeypatch, TRAINSPEED_COMPILE_ROWS="tiny:64", TRAINSPEED_REPEATS="2",
              TRAINSPEED_FLAGS="--ttt-steps 2 --loader-workers 0")  # fmt: skip
    assert run(ts, monkeypatch, "trainspeed-compile") == 0
    record = json.loads((ts.P.OUT / "trainspeed-compile.json").read_text())
    runs = record["runs"]
    assert [(r["compile"], r["repeat"], r["outcome"]) for r in runs] == [
        ("off", 0, "measured"), ("on", 0, "measured"), ("off", 1, "measured"), ("on", 1, "measured")
    ]  # fmt: skip
    [summary] = record["summary"]
    for mode in ("off", "on"):
        speeds = sorted(r["tokens_per_s"] for r in runs if r["compile"] == mode)
        m = summary[mode]
        assert (m["runs"], m["min"], m["max"]) == (2, speeds[0], speeds[1])
        assert m["median"] == pytest.approx(sum(speeds) / 2) and m["spread"] == pytest.approx(
            (speeds[1] - speeds[0]) / m["median"], abs=1e-4
        )
    assert summary["on_over_off"] == pytest.approx(summary["on"]["median"] / summary["off"]["median"], abs=1e-3)
    table = (ts.P.OUT / "trainspeed.md").read_text()
    assert "## trainspeed-compile: `--compile off` against `on`" in table and "| tiny | 64 |" in table
