"""Safetensors files written and read without Python copies, checked against the safetensors library itself."""

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglet.shared.dumpfile import DumpInvalid, read_dump, validate_dump, write_dump
from eaglet.shared.store import open_sample, sample_path, write_sample
from eaglet.shared.tensorfile import FileSlice, TensorFileError, map_tensors, read_header, write_tensors


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "states": torch.randn(7, 12, generator=g).to(torch.bfloat16),
        "scales": torch.rand(7, 1, generator=g),
        "fp8": torch.randn(7, 12, generator=g).clamp(-448, 448).to(torch.float8_e4m3fn),
        "ids": torch.arange(7, dtype=torch.int32),
        "mask": torch.tensor([0, 1, 1, 0, 1, 1, 1], dtype=torch.uint8),
        "empty": torch.empty(0, 4),
    }


def write(path, parts, metadata) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        return write_tensors(fd, parts, metadata)
    finally:
        os.close(fd)


def test_written_files_read_back_by_the_safetensors_library(tmp_path):
    tensors, path = mixed(), tmp_path / "a.safetensors"
    assert write(path, tensors, {"rid": "r1"}) == path.stat().st_size
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"rid": "r1"}
        for name, t in tensors.items():
            assert f.get_tensor(name).dtype == t.dtype and torch.equal(f.get_tensor(name).view(torch.uint8),
                                                                       t.view(torch.uint8))  # fmt: skip


def test_library_files_read_by_header_and_memory_map(tmp_path):
    tensors, path = mixed(), tmp_path / "b.safetensors"
    save_file(tensors, str(path), metadata={"k": "v"})
    header = read_header(path)
    assert header.metadata == {"k": "v"}
    mapped = map_tensors(header)
    for name, t in tensors.items():
        assert mapped[name].shape == t.shape and torch.equal(mapped[name].view(torch.uint8), t.view(torch.uint8))


def test_slices_are_copied_from_their_file(tmp_path):
    src = tmp_path / "src.safetensors"
    save_file(mixed(), str(src))
    slices = read_header(src).slices
    out = tmp_path / "out.safetensors"
    write(out, {"states": slices["states"], "ids": torch.arange(3, dtype=torch.int32)}, {})
    got = map_tensors(read_header(out))
    assert torch.equal(got["states"], mixed()["states"]) and got["ids"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("cut", [-1, +1])
def test_truncated_or_padded_files_are_refused(tmp_path, cut):
    path = tmp_path / "c.safetensors"
    save_file(mixed(), str(path))
    size = path.stat().st_size
    if cut < 0:
        os.truncate(path, size - 1)
    else:
        with open(path, "ab") as f:
            f.write(b"\0")
    with pytest.raises(TensorFileError, match="the header describes"):
        read_header(path)


def test_a_header_that_lies_about_a_tensor_is_refused(tmp_path):
    path, empty = tmp_path / "d.safetensors", tmp_path / "empty"
    empty.touch()
    with pytest.raises(TensorFileError, match="ended 64 bytes early"):
        write(path, {"x": FileSlice(empty, 0, torch.float32, (4, 4))}, {})  # 64 bytes said, none there
    path.write_bytes(b"\x20\0\0\0\0\0\0\0" + b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}'[:32])
    with pytest.raises(TensorFileError):
        read_header(path)
    path.write_bytes(b"\x08\0\0\0\0\0\0\0" + b"[1, 2] ")  # JSON, but not a header
    with pytest.raises(TensorFileError, match="malformed header"):
        read_header(path)


def test_store_copies_kept_states_from_the_dump_and_encodes_the_rest(tmp_path):
    """The slice's bytes are what is stored when the state is kept as it is, and never when it is re-encoded.
    The dump here deliberately differs from the tensors passed, so the stored bytes show which path ran."""
    h, aux = torch.randn(6, 8).to(torch.bfloat16), torch.randn(6, 24).to(torch.bfloat16)
    dump = read_dump(write_dump(tmp_path, "eaglet:r:s:1", h, aux, aux_layer_ids=[1, 2, 3], model="m"))
    other = {"hidden_states": torch.zeros(6, 8, dtype=torch.bfloat16),
             "aux_hidden_states": torch.zeros(6, 24, dtype=torch.bfloat16),
             "input_ids": torch.arange(6, dtype=torch.int32),
             "loss_mask": torch.ones(6, dtype=torch.uint8)}  # fmt: skip
    for store_dtype, expect_dump in (("model", True), ("bf16", True), ("fp8", False)):
        path = sample_path(tmp_path, "r", f"s-{store_dtype}")
        size = write_sample(path, other, {"rid": "x"}, store_dtype=store_dtype, slices=dump.slices)
        stored = open_sample(path)
        assert size == path.stat().st_size
        assert torch.equal(stored["hidden_states"].float(), (h if expect_dump else torch.zeros(6, 8)).float())
        assert stored["input_ids"].tolist() == list(range(6))


def test_nan_far_into_a_long_dump_is_found_with_its_token(tmp_path):
    t, hidden = 3000, 1024  # more rows than one finiteness chunk
    h, aux = torch.zeros(t, hidden, dtype=torch.bfloat16), torch.zeros(t, 3 * hidden, dtype=torch.bfloat16)
    aux[2901, 5] = float("inf")
    dump = read_dump(write_dump(tmp_path, "eaglet:r:s:1", h, aux, aux_layer_ids=[1, 2, 3], model="m"))
    with pytest.raises(DumpInvalid, match="aux_hidden_states has NaN/Inf \\(first at token 2901\\)"):
        validate_dump(dump, rid="eaglet:r:s:1", num_tokens=t, hidden_size=hidden)


def test_huge_but_finite_states_are_accepted_and_a_nan_beside_them_is_found(tmp_path):
    """The check sums a block first; finite values whose sum overflows must not be taken for an Inf."""
    h = torch.full((40, 64), 3e38, dtype=torch.bfloat16)  # each finite, their sum far past float32's range
    aux = torch.zeros(40, 192, dtype=torch.bfloat16)
    dump = read_dump(write_dump(tmp_path, "eaglet:r:s:1", h, aux, aux_layer_ids=[1, 2, 3], model="m"))
    validate_dump(dump, rid="eaglet:r:s:1", num_tokens=40, hidden_size=64)
    h[33, 7] = float("nan")
    dump = read_dump(write_dump(tmp_path, "eaglet:r:s:2", h, aux, aux_layer_ids=[1, 2, 3], model="m"))
    with pytest.raises(DumpInvalid, match="hidden_states has NaN/Inf \\(first at token 33\\)"):
        validate_dump(dump, rid="eaglet:r:s:2", num_tokens=40, hidden_size=64)
