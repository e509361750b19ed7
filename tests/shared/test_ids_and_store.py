import os
import subprocess
import sys

import pytest
import torch

from eaglet.shared.dumpfile import DumpInvalid, read_dump, validate_dump, write_dump
from eaglet.shared.ids import UnsafeName, check_id, check_rid, make_rid
from eaglet.shared.store import sample_is_complete, sample_path, write_sample


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "a\x00b", ".hidden", "x" * 129, "a:b", "..", "a..b"])
def test_unsafe_ids_are_refused(bad):
    with pytest.raises(UnsafeName):
        check_id(bad)


def test_rid_names_run_sample_attempt():
    assert make_rid("run1", "s-7", 3) == "eaglet:run1:s-7:3"
    with pytest.raises(UnsafeName):
        check_rid("../../etc/passwd")


def test_sample_path_stays_inside_the_run(tmp_path):
    path = sample_path(tmp_path, "run1", "abc")
    assert path.is_relative_to(tmp_path / "runs" / "run1" / "hidden")
    with pytest.raises(UnsafeName):
        sample_path(tmp_path, "run1", "../../x")


def test_dump_round_trip_and_validation(tmp_path):
    h, aux = torch.randn(5, 8), torch.randn(5, 24)
    path = write_dump(tmp_path, "eaglet:r:s:1", h, aux, aux_layer_ids=[2, 3, 4], model="m")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    dump = read_dump(path)
    validate_dump(dump, rid="eaglet:r:s:1", num_tokens=5, hidden_size=8)
    assert torch.equal(dump.hidden_states, h) and dump.aux_layer_ids == [2, 3, 4]
    with pytest.raises(DumpInvalid, match="shape"):
        validate_dump(dump, rid="eaglet:r:s:1", num_tokens=6, hidden_size=8)
    with pytest.raises(DumpInvalid, match="rid"):
        validate_dump(dump, rid="eaglet:r:s:2", num_tokens=5, hidden_size=8)
    h[2, 3] = float("nan")
    bad = read_dump(write_dump(tmp_path, "eaglet:r:s:3", h, aux, aux_layer_ids=[2, 3, 4], model="m"))
    with pytest.raises(DumpInvalid, match="NaN/Inf .* token 2"):
        validate_dump(bad, rid="eaglet:r:s:3", num_tokens=5, hidden_size=8)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_dumps_are_readable_by_other_users(tmp_path, umask):
    # The server and the extractor may run as different users, and safetensors creates files 0o600: the chmod of
    # each dump must stay. A process of its own, so that the umask set is not this one's.
    code = (
        f"import os, torch; os.umask({umask}); from eaglet.shared.dumpfile import write_dump; "
        f"print(write_dump({str(tmp_path)!r}, 'eaglet:r:s:1', torch.zeros(2, 4), torch.zeros(2, 12), "
        "aux_layer_ids=[1, 2, 3], model='m'))"
    )
    path = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert os.stat(path).st_mode & 0o777 == 0o644


def test_dump_of_any_number_of_layers(tmp_path):
    """K*H wide aux states for the K layers the metadata names: DFlash's five, or one."""
    h = torch.randn(5, 8)
    five = read_dump(write_dump(tmp_path, "eaglet:r:s:1", h, torch.randn(5, 40), aux_layer_ids=[1, 2, 3, 4, 5],
                                model="m"))  # fmt: skip
    validate_dump(five, rid="eaglet:r:s:1", num_tokens=5, hidden_size=8)
    assert five.aux_layer_ids == [1, 2, 3, 4, 5] and five.hidden_size == 8
    topk = (torch.zeros(5, 1, dtype=torch.int32), torch.zeros(5, 1, dtype=torch.float16))
    one = read_dump(
        write_dump(tmp_path, "eaglet:r:s:2", None, torch.randn(5, 8), aux_layer_ids=[4], model="m", topk=topk)
    )
    assert one.hidden_size == 8  # from the aux states alone, over its one layer
    short = read_dump(write_dump(tmp_path, "eaglet:r:s:3", h, torch.randn(5, 24), aux_layer_ids=[1, 2, 3, 4, 5],
                                 model="m"))  # fmt: skip
    with pytest.raises(DumpInvalid, match=r"aux_hidden_states shape \(5, 24\), expected \(5, 40\) \(5 layers "):
        validate_dump(short, rid="eaglet:r:s:3", num_tokens=5, hidden_size=8)
    for bad in ("[]", '"1,2"', "[1.5]"):
        path = write_dump(tmp_path, "eaglet:r:s:4", h, torch.randn(5, 8), aux_layer_ids=[1], model="m")
        dump = read_dump(path)
        dump.metadata["aux_layer_ids"] = bad
        with pytest.raises(DumpInvalid, match="is not a list of layer ids"):
            validate_dump(dump, rid="eaglet:r:s:4", num_tokens=5, hidden_size=8)


def test_truncated_dump_is_rejected(tmp_path):
    path = write_dump(tmp_path, "eaglet:r:s:1", torch.randn(5, 8), torch.randn(5, 24), aux_layer_ids=[1], model="m")
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(DumpInvalid, match="unreadable"):
        read_dump(path)


def test_sample_file_is_complete_only_when_whole(tmp_path):
    path = sample_path(tmp_path, "run1", "s1")
    tensors = {
        "input_ids": torch.arange(4, dtype=torch.int32),
        "loss_mask": torch.ones(4, dtype=torch.uint8),
        "hidden_states": torch.randn(4, 8),
        "aux_hidden_states": torch.randn(4, 24),
    }
    size = write_sample(path, tensors, {"rid": "x"})
    assert size == path.stat().st_size and sample_is_complete(path, 4)
    assert not sample_is_complete(path, 5)
    os.truncate(path, size - 1)
    assert not sample_is_complete(path, 4)
