"""The GPU bench's phase runner keeps one clean record per phase attempt; a server refused for memory while others
start is tried again once they are up."""

import importlib
import json
import sys
import threading
import time

import pytest
import torch


def load_phases(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("GPUBENCH_ROOT", str(tmp_path / "root"))
    from bench.gpu import harness

    return importlib.reload(harness)  # its folders follow the environment at import


def load_h2h(family: str):
    """The head-to-head's settings and one of its phase families, imported afresh: their folders follow the
    harness's."""
    h2h = importlib.reload(importlib.import_module("bench.gpu.h2h"))
    return h2h, importlib.reload(importlib.import_module(f"bench.gpu.{family}"))


def test_a_phase_run_again_starts_from_a_clean_record(tmp_path, monkeypatch):
    P = load_phases(tmp_path, monkeypatch)
    state = P.ROOT / "gpubench-results.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    earlier = {"error": "ModuleNotFoundError: No module named 'tensorboardX'", "rc": 1, "date": "then"}
    state.write_text(json.dumps({"train": earlier, "data": {"done": True, "rows": 3}}))
    ran = {}

    def train():
        ran["record_at_start"] = dict(P.RESULTS["train"])
        P.RESULTS["train"].update(rc=0, done=True)

    estimates = {"train": lambda: 1}  # estimates may be computed when the phase comes up
    monkeypatch.setattr(sys, "argv", ["phases.py", "data", "train"])
    assert P.main({"train": train, "data": lambda: None}, estimates) == 0
    assert ran["record_at_start"] == {"earlier_attempts": [{"date": "then", "error": earlier["error"]}]}
    saved = json.loads((P.OUT / "train.json").read_text())
    assert saved["rc"] == 0 and "error" not in saved and saved["done"]
    assert json.loads((P.OUT / "data.json").read_text())["rows"] == 3  # a finished phase keeps its record


def test_a_phase_whose_estimate_passes_the_deadline_is_skipped(tmp_path, monkeypatch):
    P = load_phases(tmp_path, monkeypatch)
    monkeypatch.setenv("GPUBENCH_DEADLINE_S", "100")
    long = lambda: (_ for _ in ()).throw(AssertionError("started"))  # noqa: E731
    monkeypatch.setattr(sys, "argv", ["phases.py", "long"])
    assert P.main({"long": long}, {"long": lambda: 500}) == 0
    assert json.loads((P.OUT / "long.json").read_text())["skipped"].startswith("not started")


def test_the_kept_conversations_are_the_data_phase(tmp_path, monkeypatch):
    P = load_phases(tmp_path, monkeypatch)
    h2h, D = load_h2h("h2hdata")
    D.phase_data()
    R = P.RESULTS["h2h-data"]
    assert R["done"] and R["source"] == "data/h2h" and R["conversations"] == 4004
    train = (h2h.H2H / "train.jsonl").read_text().splitlines()
    held = (h2h.H2H / "heldout.jsonl").read_text().splitlines()
    assert len(train) == R["conversations"] and len(held) == R["heldout_prompts"]
    first = json.loads(train[0])
    assert [m["role"] for m in first["messages"]][:2] == ["user", "assistant"] and json.loads(held[0])["prompt"]
    monkeypatch.setenv("H2H_NEW_DATA", "1")
    assert not D.kept_data()  # new data asked for: the phase writes it with the target


def test_a_recipe_from_another_recipes_drafter_waits_for_that_one(tmp_path, monkeypatch):
    load_phases(tmp_path, monkeypatch)
    _, H = load_h2h("h2hablate")
    monkeypatch.setenv("H2H_ABLATIONS", "base=;round=--onpolicy-from @base --epochs 1")
    flags = "--onpolicy-from @base --epochs 1"
    assert H.drafter_flags(flags, {}) == ([], "starts from recipe base's drafter: trained once base is")
    assert H.drafter_flags(flags, {"base": {"train": {"rc": 1}}})[1]  # failed: still waiting, never its checkpoint
    trained = {"base": {"train": {"rc": 0}, "drafter_dir": "recipes/base/drafter"}}
    assert H.drafter_flags(flags, trained) == (["--onpolicy-from", "recipes/base/drafter", "--epochs", "1"], None)
    with pytest.raises(ValueError, match="@nobody, which is no recipe"):
        H.drafter_flags("--onpolicy-from @nobody", trained)


STOPPABLE = """
import signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
while not stop:
    time.sleep(0.05)
open(sys.argv[1], "w").write("checkpoint")  # what a trainer writes between its SIGTERM and its end
sys.exit(143)
"""


def test_trainers_cut_off_by_the_deadline_are_stopped_together_and_waited_for(tmp_path, monkeypatch):
    """At the call's end every trainer still running gets SIGTERM at once and the grace to write its checkpoint;
    one that ignores it is killed when the grace is over, and each record says how it ended."""
    P = load_phases(tmp_path, monkeypatch)
    _, H = load_h2h("h2htrain")
    P.LOGS.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(H, "STOP_GRACE_S", 3)
    monkeypatch.setenv("GPUBENCH_DEADLINE_S", "1e9")
    done = tmp_path / "checkpoint"
    jobs = [
        ({}, "stoppable", [sys.executable, "-c", STOPPABLE, str(done)]),
        ({}, "stubborn", [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(60)"]),
        ({}, "quick", [sys.executable, "-c", "pass"]),
    ]  # fmt: skip
    records = H.run_trainers(jobs, "", {}, timeout=2, probe_dir=tmp_path)
    stoppable, stubborn, quick = records
    assert done.read_text() == "checkpoint"
    assert stoppable["rc"] == 143 and stoppable["error"] == "timed out after 2s"
    assert stubborn["rc"] == -9 and stubborn["wall_s"] < 2 + 3 + 5
    assert quick["rc"] == 0 and "error" not in quick


def test_a_start_refused_for_memory_is_tried_again_once_the_other_starts_are_done(tmp_path, monkeypatch):
    P = load_phases(tmp_path, monkeypatch)
    monkeypatch.setattr(P, "stop", lambda name: None)
    other_loading, events = threading.Event(), []

    def other():  # a server still loading beside the refused one
        other_loading.set()
        time.sleep(0.5)
        events.append("other up")
        return 1.0

    attempts = iter([RuntimeError(f"x exited (-9):\nValueError: Loaded weights {P.KV_REFUSED} under 0.1"), 2.0])

    def refused_then_up():
        got = next(attempts)
        events.append("start")
        if isinstance(got, Exception):
            raise got
        return got

    t = threading.Thread(target=P.once_more_if_refused, args=("other", other))
    t.start()
    other_loading.wait()
    assert P.once_more_if_refused("x", refused_then_up) == 2.0
    t.join()
    assert events == ["start", "other up", "start"]


def test_units_an_attempt_finished_stay_in_its_note(tmp_path, monkeypatch):
    # h2h-layouts records each stored layout as it finishes: a call cut short keeps them for the next to reuse
    P = load_phases(tmp_path, monkeypatch)
    P.RESULTS.clear()
    P.RESULTS["layouts"] = {"runs": {"loss": {"run_id": "r-loss"}}, "date": "then"}
    P.fresh("layouts")
    assert P.RESULTS["layouts"] == {"earlier_attempts": [{"date": "then", "runs": {"loss": {"run_id": "r-loss"}}}]}


def test_a_cut_off_training_phase_keeps_its_trainers_walls_and_features_for_the_next_call(tmp_path, monkeypatch):
    """dfl-train's trainers resume in the next call from their checkpoints: their records (the wall so far) and the
    SpecForge features' conversion outlive the phase's clean record."""
    P = load_phases(tmp_path, monkeypatch)
    state = P.ROOT / "gpubench-results.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    cut = {"drafters": {"dflash-lr6e-4": {"rc": 143, "wall_s": 344.3}}, "specforge_convert": {"wall_s": 6.1},
           "date": "then", "rows": [1, 2]}  # fmt: skip
    state.write_text(json.dumps({"dfl-train": cut}))
    ran = {}
    monkeypatch.setattr(sys, "argv", ["phases.py", "dfl-train"])
    assert P.main({"dfl-train": lambda: ran.update(P.RESULTS["dfl-train"])}, {"dfl-train": lambda: 1}) == 0
    (note,) = ran["earlier_attempts"]
    assert note == {k: cut[k] for k in ("date", "drafters", "specforge_convert")}  # not its other figures


def test_specforge_reads_the_same_target_files_in_every_call(tmp_path):
    """SpecForge resumes a checkpoint only where the target's files are unchanged since (their size and mtime are
    in its provenance): the view's LM-head file is written once, not again on each call."""
    from safetensors.torch import save_file

    from bench.gpu.specforge_features import target_view

    model = tmp_path / "model"
    model.mkdir()
    save_file({"model.embed_tokens.weight": torch.randn(8, 4)}, str(model / "model.safetensors"))
    (model / "config.json").write_text("{}")
    view = target_view(model, tmp_path / "view")
    first = (view / "heads.safetensors").stat().st_mtime_ns
    time.sleep(0.01)
    target_view(model, tmp_path / "view")
    assert (view / "heads.safetensors").stat().st_mtime_ns == first


def test_the_dflash_head_to_head_trains_each_recipe_beside_the_learning_rates(tmp_path, monkeypatch):
    load_phases(tmp_path, monkeypatch)
    monkeypatch.setenv("DFL_LRS", "6e-4,1e-3")
    monkeypatch.setenv("DFL_RECIPES", "scaled=--dflash-scale-inputs; decay3=--dflash-scale-inputs --dflash-decay 3")
    _, D = load_h2h("h2hdflash")
    assert D.eaglet_drafters() == [
        ("dflash-lr6e-4", "6e-4", ""),
        ("dflash-lr1e-3", "1e-3", ""),
        ("dflash-scaled", "6e-4", "--dflash-scale-inputs"),
        ("dflash-decay3", "6e-4", "--dflash-scale-inputs --dflash-decay 3"),
    ]
    # a drafter evaluated in an earlier call is not served again; one cut short or trained since is
    assert D.served_well({"humaneval": {"accept_length": 1.2}, "heldout": {"accept_length": 1.4}})
    assert not D.served_well({"humaneval": {"error": "not run: out of this call's time"}})
    assert not D.served_well(None)


def test_a_log_tail_names_the_checkouts_files_from_its_root(tmp_path, monkeypatch):
    P = load_phases(tmp_path, monkeypatch)
    P.LOGS.mkdir(parents=True, exist_ok=True)
    (P.LOGS / "t.log").write_text(f'File "{P.REPO}/bench/gpu/specforge_train.py", line 81\nValueError: x\n')
    assert P.tail("t") == 'File "bench/gpu/specforge_train.py", line 81\nValueError: x'


def test_the_pipelines_cpu_profile_names_the_busy_process_and_the_workers_seconds(tmp_path, monkeypatch):
    P = load_phases(tmp_path, monkeypatch)
    import subprocess

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 3: pass\ntime.sleep(30)"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)  # both started
        before, t = P.cpu_seconds(), time.time()
        time.sleep(1.0)  # the spinner spins throughout
        cpu = P.cpu_busy(before, P.cpu_seconds(), time.time() - t, {busy.pid})
    finally:
        busy.kill(), idle.kill()
    first = cpu["cpu_busiest"][0]
    assert first["pid"] == busy.pid and first["process"].startswith("-c import time") and first["cores"] > 0.2
    assert next(r for r in cpu["cpu_busiest"] if r["pid"] == idle.pid)["cores"] < 0.05
    assert 0.2 < cpu["workers_s"] <= 1.5 and cpu["cpu_cores_busy"] >= first["cores"]


def test_the_dflash_report_sets_eagle3_of_this_sequence_beside_it_else_the_committed_labelled(tmp_path, monkeypatch):
    P = load_phases(tmp_path, monkeypatch)
    _, D = load_h2h("h2hdflash")
    committed = D.eagle3_rows()  # no h2h-eval in this sequence: the committed 2026-12-04 figures, labelled
    assert [(r["prompt_set"], r["accept_length"]) for r in committed] == [("humaneval", 1.5784), ("heldout", 1.8473)]
    assert all(r["trainer"] == "eaglet" and r["call"].startswith("2026-12-04") for r in committed)
    served = {"humaneval": {"accept_length": 1.6, "output_tokens_per_s": 900.0}, "heldout": {"error": "boom"}}
    P.RESULTS["h2h-eval"] = {"eaglet": {"(3, 1, 4)": served}, "specforge": {"(3, 1, 4)": served, "(5, 1, 6)": served}}
    P.RESULTS["h2h-specforge"] = {"lr": 1e-3}
    rows = D.eagle3_rows()
    assert [(r["trainer"], r["prompt_set"], r["call"]) for r in rows] == [
        ("eaglet", "humaneval", "this sequence"), ("eaglet", "heldout", "this sequence"),
        ("specforge", "humaneval", "this sequence"), ("specforge", "heldout", "this sequence")]  # fmt: skip
    assert rows[2]["specforge_lr"] == 1e-3 and rows[0]["specforge_lr"] is None and rows[1]["error"] == "boom"
