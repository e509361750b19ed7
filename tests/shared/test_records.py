"""Records parse what their writers wrote, and write only the fields that are set."""

import json
from dataclasses import replace

from eaglet.shared.layout import Layout
from eaglet.shared.records import (
    EvalResult,
    InferenceBeat,
    RunMeta,
    Stage,
    TrainProgress,
    WorkerBeat,
    WorkerRole,
    WorkerState,
)
from eaglet.shared.runoptions import RunOptions


def test_meta_round_trip_parses_types_once():
    meta = RunMeta(run_id="r", stage=Stage.extracting, hidden_size=64, aux_layer_ids=[1, 5, 9], total=10,
                   options=RunOptions(max_tokens=2048), extraction_complete=1.5)  # fmt: skip
    raw = meta.to_redis()
    assert raw == {
        "run_id": "r", "stage": "extracting", "hidden_size": "64", "aux_layer_ids": "[1, 5, 9]",
        "options": RunOptions(max_tokens=2048).to_json(), "total": "10", "extraction_complete": "1.5",
    }  # fmt: skip
    assert RunMeta.from_redis(raw) == meta


def test_partial_record_writes_only_its_fields():
    assert TrainProgress(step=3, loss=0.5).to_redis() == {"step": "3", "loss": "0.5"}
    assert RunMeta().to_redis() == {}


def test_json_fields_may_be_given_encoded():
    # Ingest hands over the JSON it built; it is stored as given and parsed on the way back.
    raw = RunMeta(aux_layer_ids=json.dumps([2, 4])).to_redis()
    assert RunMeta.from_redis(raw).aux_layer_ids == [2, 4]


def test_unknown_empty_and_bad_fields_read_as_unset():
    meta = RunMeta.from_redis({"total": "abc", "hidden_size": "", "stage": "nonsense", "someone_elses": "x"})
    assert meta == RunMeta()
    assert RunMeta.from_redis({"aux_layer_ids": '{"not": "a list"}'}).aux_layer_ids is None


def test_counters_written_as_floats_read_as_ints():
    assert RunMeta.from_redis({"total": "12.0", "ingest_deaths": "2"}).total == 12


def test_accuracy_is_the_first_position():
    progress = TrainProgress.from_redis({"acc": "[0.75, 0.5]", "heldout_acc": "[0.7]"})
    assert (progress.accuracy, progress.acc, progress.heldout_acc) == (0.75, [0.75, 0.5], [0.7])
    assert TrainProgress().accuracy is None


def test_eval_round_trip():
    result = EvalResult(state="done", accept_length=2.5, accept_rate=[0.9, 0.6], mismatches=0)
    assert EvalResult.from_redis(result.to_redis()) == result


def test_worker_beat_round_trip_and_liveness():
    beat = WorkerBeat(worker="w", state=WorkerState.busy, ts=100.0, pid=7, disk_free=5, stage_seconds={"store": 0.1})
    assert WorkerBeat.from_redis(beat.to_redis()) == beat
    ingest = replace(beat, role=WorkerRole.ingest)
    assert WorkerBeat.from_redis(ingest.to_redis()).role == WorkerRole.ingest
    assert not beat.lost(now=110.0, lost_after_s=15.0) and beat.lost(now=116.0, lost_after_s=15.0)
    stopped = WorkerBeat(worker="w", state=WorkerState.stopped, ts=0.0)
    assert not stopped.lost(now=1000.0, lost_after_s=15.0)


def test_worker_beat_tolerates_missing_fields():
    beat = WorkerBeat.from_redis('{"worker": "w", "state": "idle", "ts": 1}')
    assert (beat.host, beat.pid, beat.stage_seconds, beat.role) == ("", None, {}, WorkerRole.extractor)


def test_inference_beat_round_trip():
    beat = InferenceBeat(url="http://inf:1", ok=True, ts=3.0, model="tiny")
    assert InferenceBeat.from_redis(beat.to_redis()) == beat


def test_options_recorded_before_layouts_read_as_every_state():
    options = RunMeta.from_redis({"options": '{"max_tokens": 64}'}).options
    assert options is not None and (options.max_tokens, options.layout()) == (64, Layout())
