"""The stored encodings of the hidden states: fp8 (e4m3, per-token scales) and bf16 against the model dtype."""

import pytest
import torch
from safetensors import safe_open

from eaglet.services.trainer.data import load_sample
from eaglet.shared.store import (
    FP8_STORAGE,
    decode_states,
    encode_states,
    read_metadata,
    sample_is_complete,
    sample_path,
    write_sample,
)


def sample(T: int = 64, H: int = 96, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # per-token magnitudes over five orders, one outlier channel, one all-zero token: what residual streams do
    rows = 10 ** torch.linspace(-3, 2, T)[:, None]
    h = torch.randn(T, H, generator=g) * rows
    aux = torch.randn(T, 3 * H, generator=g) * rows
    aux[:, 7] *= 50
    h[5] = 0
    return {
        "input_ids": torch.arange(T, dtype=torch.int32),
        "loss_mask": torch.ones(T, dtype=torch.uint8),
        "hidden_states": h,
        "aux_hidden_states": aux,
    }


def test_fp8_round_trip_is_within_e4m3_precision_of_each_token():
    tensors = sample()
    stored, metadata = encode_states(tensors, {"rid": "x"}, "fp8")
    assert metadata["storage"] == FP8_STORAGE and stored["hidden_states"].dtype == torch.float8_e4m3fn
    assert stored["hidden_states_scale"].shape == (64, 1) and stored["hidden_states_scale"].dtype == torch.float32
    back = decode_states(stored, metadata, torch.float32)
    for k in ("hidden_states", "aux_hidden_states"):
        x, y = tensors[k], back[k]
        scale = stored[f"{k}_scale"]
        # 3 mantissa bits: half a step is 2^-4 of the value; below 2^-6 (subnormals) the step is 2^-9 of the scale
        assert ((x - y).abs() <= x.abs() * 2**-4 + scale * 2**-10 + 1e-30).all(), k
        assert torch.isfinite(y).all()
        rel = ((x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)).max()
        assert rel < 0.05, (k, float(rel))
    assert torch.equal(back["hidden_states"][5], torch.zeros(96))  # an all-zero token stays zero


def test_model_and_bf16_encodings():
    tensors = sample()
    same, metadata = encode_states(tensors, {"rid": "x"}, "model")
    assert same["hidden_states"] is tensors["hidden_states"] and "storage" not in metadata
    bf16, metadata = encode_states(tensors, {}, "bf16")
    assert bf16["aux_hidden_states"].dtype == torch.bfloat16 and metadata["storage"] == "bf16"
    with pytest.raises(ValueError, match="fp4"):
        encode_states(tensors, {}, "fp4")


def test_fp8_file_is_half_of_bf16_and_verifies(tmp_path):
    T, H = 256, 576
    tensors = sample(T, H)
    sizes = {}
    for dtype in ("model", "bf16", "fp8"):
        path = sample_path(tmp_path, "r", f"s-{dtype}")
        sizes[dtype] = write_sample(path, tensors, {"rid": "x"}, store_dtype=dtype)
        assert sample_is_complete(path, T) and not sample_is_complete(path, T + 1)
    states_bf16 = T * 4 * H * 2
    header_slack = 512  # the JSON header differs by a metadata field and the tensor list
    assert abs(sizes["model"] - sizes["bf16"] - states_bf16) < header_slack  # float32 -> bf16
    # fp8: one byte an element plus a float32 scale per token and tensor
    assert abs(sizes["bf16"] - sizes["fp8"] - (states_bf16 // 2 - T * 2 * 4)) < header_slack
    assert sizes["fp8"] / sizes["bf16"] < 0.51
    fp8_path = sample_path(tmp_path, "r", "s-fp8")
    assert read_metadata(fp8_path)["storage"] == FP8_STORAGE
    loaded = load_sample(fp8_path, torch.float32)
    assert set(loaded) == {"input_ids", "loss_mask", "hidden_states", "aux_hidden_states"}
    assert loaded["aux_hidden_states"].dtype == torch.float32 and loaded["aux_hidden_states"].shape == (T, 3 * H)
    torch.testing.assert_close(loaded["hidden_states"], tensors["hidden_states"], rtol=0.07, atol=1e-3)


def test_fp8_file_without_its_scales_is_not_complete(tmp_path):
    T = 8
    stored, metadata = encode_states(sample(T, 16), {}, "fp8")
    del stored["aux_hidden_states_scale"]
    from safetensors.torch import save_file

    path = tmp_path / "s.safetensors"
    save_file(stored, str(path), metadata=metadata)
    assert not sample_is_complete(path, T)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["storage"] == FP8_STORAGE


def test_fp8_encoding_is_the_same_across_row_blocks():
    """Encoding runs a cache-sized block of rows at a time; every row must come out as if encoded alone,
    zero rows and huge values included."""
    x = torch.randn(3000, 700, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[5], x[2999, 3] = 0, 1e30
    stored, _ = encode_states({"input_ids": None, "loss_mask": None, "hidden_states": x, "aux_hidden_states": x},
                              {}, "fp8")  # fmt: skip
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax * (1 / 448), torch.ones_like(amax))  # a multiplication, as on the GPU
    expected = (xf / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(stored["hidden_states"].view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(stored["hidden_states_scale"], scale)
