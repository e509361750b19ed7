"""The speed phases read SGLang's own log: its prefill batches since a point, as 0.5.17 writes them."""

from bench.gpu import extraction

# 0.5.17's line (scheduler_components/metrics_reporter.py), as it logs each prefill batch at --log-level info
LINE = ("[2026-12-07 20:41:16] Prefill batch, #new-seq: {seqs}, #new-token: {tokens}, #cached-token: 0, token usage: "
        "0.01, #running-req: 0, #queue-req: {queued}, #pending-token: 0, cuda graph: False, input throughput "
        "(token/s): 41000.00\n")  # fmt: skip


def test_the_prefill_batches_since_a_point_of_the_log_are_counted_and_averaged(tmp_path, monkeypatch):
    monkeypatch.setattr(extraction.H, "LOGS", tmp_path)
    log = tmp_path / "smol-plugin.log"
    log.write_text(LINE.format(seqs=1, tokens=300, queued=0))
    since = extraction.log_size("smol-plugin")
    with open(log, "a") as f:
        f.write(LINE.format(seqs=16, tokens=5696, queued=3) + "a line of something else\n")
        f.write(LINE.format(seqs=8, tokens=2000, queued=1))
    assert extraction.prefill_batches("smol-plugin", since) == {
        "batches": 2, "mean_seqs": 12.0, "mean_tokens": 3848.0, "mean_queued": 2.0}  # fmt: skip
    assert extraction.prefill_batches("smol-plugin", 0)["batches"] == 3
    assert extraction.prefill_batches("never-started", 0) == {"batches": 0}
