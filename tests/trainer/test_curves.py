"""The TensorBoard curves hold what metrics.jsonl and the run's progress say, read back from the event files as
TensorBoard reads them (TFRecord framing, Event protos)."""

import json
import struct
from collections import defaultdict
from pathlib import Path

import pytest
from tensorboardX.crc32c import crc32c
from tensorboardX.proto.event_pb2 import Event

from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.curves import curves_dir
from eaglet.services.trainer.distributed import Dist
from eaglet.services.trainer.train import train
from eaglet.shared.runstate import RunState
from eaglet.shared.store import checkpoints_dir
from tests.trainer.fixtures import make_run


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value over every event file of the folder; each record's checksums checked."""
    scalars: dict[str, dict[int, float]] = defaultdict(dict)
    for path in sorted(folder.glob("events.out.tfevents.*")):
        raw, at = path.read_bytes(), 0
        while at < len(raw):
            header = raw[at : at + 8]
            (length,), (header_crc,) = struct.unpack("<Q", header), struct.unpack("<I", raw[at + 8 : at + 12])
            body = raw[at + 12 : at + 12 + length]
            (body_crc,) = struct.unpack("<I", raw[at + 12 + length : at + 16 + length])
            assert header_crc == masked_crc(header) and body_crc == masked_crc(body), path
            event = Event.FromString(body)
            for value in event.summary.value:
                scalars[value.tag][event.step] = value.simple_value
            at += 16 + length
    return scalars


def test_curves_hold_the_metrics(redis, tmp_path, tiny_model_dir):
    make_run(redis, tmp_path, tiny_model_dir, "tb")
    cfg = TrainConfig(ttt_steps=3, draft_vocab_size=512, tokens_per_batch=160, lr=3e-3, warmup_ratio=0.1,
                      heldout_fraction=0.2, epochs=2, checkpoint_every=5, loader_workers=0, log_every=4)  # fmt: skip
    final = train(redis=redis, run_id="tb", data_dir=tmp_path, target_dir=tiny_model_dir, cfg=cfg, env=Dist())
    rows = [json.loads(x) for x in (checkpoints_dir(tmp_path, "tb") / "metrics.jsonl").read_text().splitlines()]
    scalars = read_scalars(curves_dir(tmp_path, "tb"))
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, final["step"] + 1)) and len(steps) > 5

    approx = lambda x: pytest.approx(x, rel=1e-6, abs=1e-7)  # noqa: E731 - float32 in the event file
    for name in ("loss", "lr", "grad_norm"):
        assert scalars[f"train/{name}"] == approx({r["step"]: r[name] for r in rows}), name
    for i in range(cfg.ttt_steps):
        assert scalars[f"train/acc/{i}"] == approx({r["step"]: r["acc"][i] for r in rows}), i

    assert sorted(scalars["train/tokens_per_s"]) == [s for s in steps if s % cfg.log_every == 0 or s == steps[-1]]
    assert scalars["train/tokens_per_s"][steps[-1]] == approx(RunState(redis, "tb").train().tokens_per_s)

    held_steps = [s for s in steps[:-1] if s % cfg.checkpoint_every == 0] + [steps[-1]]
    assert sorted(scalars["heldout/loss"]) == held_steps
    assert scalars["heldout/loss"][steps[-1]] == approx(final["heldout_loss"])
    assert [scalars[f"heldout/acc/{i}"][steps[-1]] for i in range(cfg.ttt_steps)] == approx(final["heldout_acc"])
