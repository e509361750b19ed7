"""The speed rows' ratio: each pipeline repetition against min(plain SGLang's median, its own disk probe's bound)."""

import json

from bench.gpu import speedreport


def test_each_repetition_is_set_against_the_lower_of_the_server_and_its_disk(tmp_path):
    plain = [{"tokens_per_s": t} for t in (39_000.0, 40_000.0, 41_000.0)]
    bf16 = {"tokens_per_s": 30_000.0, "bytes_per_token": 32_768, "disk": {"fsync_write_GBps": 1.0}}  # disk: 30.5 k
    layout = {"tokens_per_s": 38_000.0, "bytes_per_token": 6_000.0, "disk": {"fsync_write_GBps": 1.0}}  # server
    (tmp_path / "speed8b.json").write_text(json.dumps({"plain": plain, "pipeline": [bf16]}))
    (tmp_path / "layoutspeed8b.json").write_text(json.dumps({"pipeline": [layout]}))
    s = speedreport.write(tmp_path, tmp_path / "results")
    bf16_row, layout_row = s["rows"]
    assert s["plain_sglang_median_tokens_per_s"] == 40_000.0
    assert bf16_row["disk_bound_tokens_per_s"] == 30_517.6 and bf16_row["ratio"] == 0.983
    assert layout_row["pipeline"] == "default layout" and layout_row["ratio"] == 0.95
    md = (tmp_path / "results" / "gpu-speedrows.md").read_text()
    assert "| default layout | 0 | 38,000.0 | 6,000.0 | 1.0 | 166,666.7 | — | 40,000 (no) | 0.95 |" in md


def test_a_repetition_recorded_before_the_per_repetition_probe_takes_the_phases_probes_in_order(tmp_path):
    reps = [
        {"tokens_per_s": 20_000.0, "bytes_per_token": 32_768},
        {"tokens_per_s": 20_000.0, "bytes_per_token": 32_768},
    ]
    disk = [{"fsync_write_GBps": 0.5}, {"fsync_write_GBps": 2.0}]
    (tmp_path / "speed8b.json").write_text(json.dumps({"plain": [{"tokens_per_s": 40_000.0}], "pipeline": reps,
                                                       "disk": disk}))  # fmt: skip
    rows = speedreport.write(tmp_path, tmp_path)["rows"]
    assert [r["disk_GBps"] for r in rows] == [0.5, 2.0]
    assert [r["ratio"] for r in rows] == [1.311, 0.5]  # the first bound by its slow disk (15.3 k), the second by SGLang


def test_a_repetition_is_set_against_plain_sglang_of_its_own_call_where_it_ran_in_one(tmp_path):
    plain = [{"tokens_per_s": 40_000.0, "call": 1.0}, {"tokens_per_s": 36_000.0, "call": 2.0},
             {"tokens_per_s": 37_000.0, "call": 2.0}]  # fmt: skip
    reps = [{"tokens_per_s": 34_000.0, "bytes_per_token": 7_000.0, "call": 2.0},
            {"tokens_per_s": 34_000.0, "bytes_per_token": 7_000.0, "call": 3.0}]  # fmt: skip
    (tmp_path / "speed8b.json").write_text(json.dumps({"plain": plain}))
    (tmp_path / "layoutspeed8b.json").write_text(json.dumps({"pipeline": reps}))
    same, other = speedreport.write(tmp_path, tmp_path)["rows"]
    assert same["plain_same_call"] and same["plain_tokens_per_s"] == 36_500.0 and same["ratio"] == 0.932
    assert not other["plain_same_call"] and other["plain_tokens_per_s"] == 37_000.0  # all calls' median


def test_the_ab_phases_rows_are_named_by_what_each_repetition_varied(tmp_path):
    plain = [{"tokens_per_s": 40_000.0, "call": 1.0}]
    reps = [{"tokens_per_s": t, "bytes_per_token": 7_000.0, "call": 1.0, "topk_rows": rows}
            for t, rows in ((32_000.0, "all"), (38_000.0, "loss"))]  # fmt: skip
    (tmp_path / "speed8b.json").write_text(json.dumps({"plain": plain}))
    (tmp_path / "topkrows8b.json").write_text(json.dumps({"pipeline": reps}))
    streams = [{"tokens_per_s": 36_000.0, "bytes_per_token": 7_000.0, "call": 1.0, "capture_stream": "side"}]
    (tmp_path / "stream8b.json").write_text(json.dumps({"pipeline": streams}))
    every, loss, side = speedreport.write(tmp_path, tmp_path)["rows"]
    assert every["pipeline"] == "default layout, top-k at every row" and every["ratio"] == 0.8
    assert loss["pipeline"] == "default layout" and loss["ratio"] == 0.95 and loss["plain_same_call"]
    assert side["pipeline"] == "default layout, capture on the side stream (two servers)" and side["ratio"] == 0.9
