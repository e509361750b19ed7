"""The inference servers' dump writer: bounded in bytes, several threads, back-pressure measured, nothing lost.

The slow disk is a write held on an event (a fault that cannot be caused on demand here); the dumps are real
files written by ``write_dump``.
"""

import threading
import time

import pytest
import torch

from eaglet.shared import heartbeats
from eaglet.shared.alerts import StatusConfig
from eaglet.shared.dumpfile import dump_path, read_dump, write_dump
from eaglet.shared.dumpwriter import DumpWriter, read_writer_stats
from eaglet.shared.status import read_status

MB = 1 << 20


def dump_write(folder, rid: str, gate: threading.Event | None = None):
    hidden, aux = torch.full((4, 8), 1.0), torch.full((4, 24), 2.0)

    def write():
        if gate is not None:
            gate.wait(10)
        return write_dump(folder, rid, hidden, aux, aux_layer_ids=[1, 2, 3], model="m")

    return write


def test_a_full_writer_makes_the_submitter_wait_and_loses_nothing(tmp_path):
    writer = DumpWriter(tmp_path, cap_bytes=3 * MB, threads=2)
    gate = threading.Event()
    futures = [writer.submit(MB, dump_write(tmp_path, f"eaglet:r:s{i}:0", gate), f"rid {i}") for i in range(3)]
    blocked = threading.Thread(
        target=lambda: futures.append(writer.submit(MB, dump_write(tmp_path, "eaglet:r:s3:0"), "3"))
    )
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "a fourth MB went past a 3 MB cap"
    assert writer.stats().queued_bytes == 3 * MB
    gate.set()
    blocked.join(10)
    writer.flush()
    stats = writer.stats()
    assert stats.written == 4 and stats.failed == 0 and stats.queued_bytes == 0
    assert stats.peak_bytes == 3 * MB and stats.waited_s >= 0.25
    for i, future in enumerate(futures):
        assert future.result() == dump_path(tmp_path, f"eaglet:r:s{i}:0")
        assert read_dump(future.result()).metadata["num_tokens"] == "4"


def test_a_dump_larger_than_the_cap_goes_through_alone(tmp_path):
    writer = DumpWriter(tmp_path, cap_bytes=MB, threads=1)
    assert writer.submit(5 * MB, dump_write(tmp_path, "eaglet:r:big:0"), "big").result(10).exists()
    writer.flush()
    assert writer.stats().peak_bytes == 5 * MB


def test_a_failed_write_fails_its_future_and_the_writer_goes_on(tmp_path):
    writer = DumpWriter(tmp_path, cap_bytes=MB, threads=1)

    def broken():
        raise OSError(28, "No space left on device")

    bad = writer.submit(10, broken, "rid bad")
    good = writer.submit(10, dump_write(tmp_path, "eaglet:r:good:0"), "rid good")
    with pytest.raises(OSError, match="No space"):
        bad.result(10)
    assert good.result(10).exists()
    writer.flush()
    assert (writer.stats().written, writer.stats().failed) == (1, 1)


def test_figures_are_published_for_the_workers_and_stale_ones_dropped(tmp_path):
    writer = DumpWriter(tmp_path, cap_bytes=MB, threads=1)
    writer.submit(10, dump_write(tmp_path, "eaglet:r:a:0"), "a")
    writer.flush()
    [stats] = read_writer_stats(tmp_path, max_age_s=30)
    assert stats.written == 1 and stats.cap_bytes == MB and 0 <= stats.wait_fraction <= 1
    time.sleep(0.2)
    assert read_writer_stats(tmp_path, max_age_s=0.1) == []
    assert read_writer_stats(tmp_path / "absent", max_age_s=30) == []


def test_back_pressure_reaches_status(tmp_path, redis):
    """A writer held up by its disk: the forwards' wait, published and reported by a worker, shows in /status."""
    writer = DumpWriter(tmp_path, cap_bytes=MB, threads=1)
    gate = threading.Event()
    writer.submit(MB, dump_write(tmp_path, "eaglet:r:a:0", gate), "a")
    threading.Timer(0.5, gate.set).start()
    writer.submit(MB, dump_write(tmp_path, "eaglet:r:b:0"), "b")  # waits ~0.5 s for room
    writer.publish()
    writer.flush()
    heartbeats.report_inference(redis, "http://h1:30000", ok=True, writers=read_writer_stats(tmp_path, 30))
    [server] = read_status(redis, config=StatusConfig()).cluster.inference
    assert server.dump_cap_bytes == MB and server.dump_queued_bytes == 0
    assert 0.2 < server.dump_backpressure <= 1, server
