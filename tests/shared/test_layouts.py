"""Storage layouts: the 4-bit codec, the top-k encoder and its checks, the dumps a server writes for them, each
layout stored and read back, and the bytes a token each costs, counted by one function and found in the files."""

import math
from pathlib import Path

import pytest
import torch

from eaglet.shared.dumpfile import Dump, DumpEncoding, DumpInvalid, read_dump, validate_dump, write_dump
from eaglet.shared.fp4 import Fp4Error, check_fp4, decode_fp4, encode_fp4, magnitude_codes
from eaglet.shared.layout import FP4_BLOCK, Layout, TopkError, bytes_per_token, check_k
from eaglet.shared.runoptions import RunOptions
from eaglet.shared.store import (
    FP4_AUX_TENSORS,
    decode_states,
    encode_states,
    loss_rows,
    open_sample,
    read_metadata,
    sample_is_complete,
    write_sample,
)
from eaglet.shared.topk import TOPK_TENSORS, check_topk, encode_topk, loss_spans, span_rows, top_logits

H, V, T = 64, 300, 12


def sample(seed: int = 0, num_aux: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.uint8)
    return {
        "input_ids": torch.arange(T, dtype=torch.int32),
        "loss_mask": mask,
        "hidden_states": torch.randn(T, H, generator=g),
        "aux_hidden_states": torch.randn(T, num_aux * H, generator=g) * 4,
    }


def test_fp4_codes_every_e2m1_value_exactly_and_bounds_the_error_by_the_grid_step():
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 0.0])
    x = grid.repeat(2, 4)  # [2, 64]: each block's amax is 6, so its scale is 1
    codes, scales = encode_fp4(x)
    assert torch.equal(scales.float(), torch.ones(2, 2))
    assert torch.equal(decode_fp4(codes, scales, torch.float32), x)
    y = torch.randn(50, 3 * H) * torch.logspace(-3, 3, 3 * H)  # blocks of very different sizes: each its own scale
    back = decode_fp4(*encode_fp4(y), torch.float32)
    step = y.abs().view(50, -1, FP4_BLOCK).amax(-1, keepdim=True) / 6 * 1.01  # the widest gap, 4 to 6, is one scale
    assert bool(((back - y).abs().view(50, -1, FP4_BLOCK) <= step).all())
    rel = (back - y).norm() / y.norm()
    assert float(rel) < 0.12, float(rel)


def test_fp4_refuses_a_width_no_block_divides_and_names_a_corrupt_block():
    with pytest.raises(Fp4Error, match="divisible by 32"):
        encode_fp4(torch.ones(2, 48))
    codes, scales = encode_fp4(torch.randn(4, 64))
    check_fp4(codes, scales, rows=4, width=64, where="sample s-1")
    scales[2, 1] = float("nan")
    with pytest.raises(Fp4Error, match=r"sample s-1: corrupt 4-bit block \(token 2, block 1\)"):
        check_fp4(codes, scales, rows=4, width=64, where="sample s-1")
    with pytest.raises(Fp4Error, match="expected uint8"):
        check_fp4(codes[:, :-1], scales, rows=4, width=64, where="sample s-1")


def test_topk_is_the_targets_most_likely_tokens_with_their_log_probabilities():
    g = torch.Generator().manual_seed(1)
    final, head = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
    ids, logp = encode_topk(final, head, 5)
    full = torch.log_softmax(final @ head.T, -1)
    expected = full.topk(5, -1)
    assert torch.equal(ids.long(), expected.indices) and ids.dtype == torch.int32
    torch.testing.assert_close(logp.float(), expected.values, atol=2e-3, rtol=1e-3)
    check_topk(ids, logp, rows=T, k=5, vocab_size=V, where="dump r")


@pytest.mark.parametrize("k", [1, 24, 32])
@pytest.mark.parametrize("vocab", [64 * 200, 64 * 200 + 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_selection_is_the_full_one(k, vocab, dtype):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(50, vocab, generator=g).to(dtype)
    logits[7] = torch.randint(-3, 4, (vocab,), generator=g)  # a row of ties, across chunks and in the last one
    logits[8, -1] = 99.0  # the largest in the partial chunk
    values, columns = top_logits(logits, k)
    want = logits.topk(k, dim=-1)
    assert torch.equal(values, want.values)
    assert torch.equal(logits.gather(1, columns), values)  # each column holds its value: a tie may pick another
    assert all(len(set(row.tolist())) == k for row in columns)
    if dtype == torch.float32:  # no ties but row 7's: the very same columns
        assert torch.equal(columns[:7], want.indices[:7]) and torch.equal(columns[8:], want.indices[8:])


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (lambda ids, logp: ids.__setitem__((3, 0), 999), "an id outside the vocabulary"),
        (lambda ids, logp: logp.__setitem__((4, 2), 0.0), "not in falling order"),
        (lambda ids, logp: logp.__setitem__((5, 0), float("nan")), "not finite"),
    ],
)
def test_a_spoiled_topk_is_refused_with_the_first_bad_token(spoil, reason):
    ids, logp = encode_topk(torch.randn(T, H), torch.randn(V, H), 4)
    spoil(ids, logp)
    with pytest.raises(TopkError, match=reason):
        check_topk(ids, logp, rows=T, k=4, vocab_size=V, where="dump r")
    with pytest.raises(TopkError, match=r"\(3, 4\)"):
        check_topk(ids[:3], logp[:3], rows=T, k=4, vocab_size=V, where="dump r")


def test_k_out_of_range_is_refused_at_the_options_and_at_the_server():
    for bad in (0, 1025):
        with pytest.raises(TopkError, match="give 1 to"):
            check_k(bad)
    with pytest.raises(TopkError, match=r"give 1 to 300 \(vocabulary of 300\)"):
        check_k(301, V)
    with pytest.raises(ValueError, match="give 1 to 1024"):
        RunOptions(store_final="topk", store_topk=2000)
    with pytest.raises(ValueError, match="only a run with store_final 'topk'"):
        RunOptions(store_final="all", store_topk=8)
    assert RunOptions(store_final="topk").layout() == Layout(final="topk", topk=24, aux="fp4", topk_rows="loss")
    assert RunOptions(store_final="all").layout() == Layout(final="all", aux="fp4")  # the top-k rows ignored
    with pytest.raises(ValueError, match="custom_params.eaglet_topk=400"):
        DumpEncoding.from_params({"eaglet_topk": 400}, V)


def test_a_dump_without_the_topk_it_was_asked_for_is_refused():
    s = sample()
    dump = Dump(
        s["hidden_states"], s["aux_hidden_states"], {"rid": "r", "num_tokens": str(T), "aux_layer_ids": "[1, 2, 3]"}
    )
    with pytest.raises(DumpInvalid, match="dump r: asked for the top-4 distribution, the dump holds none"):
        validate_dump(dump, rid="r", num_tokens=T, hidden_size=H, topk=4, vocab_size=V)
    validate_dump(dump, rid="r", num_tokens=T, hidden_size=H)


@pytest.mark.parametrize("num_aux", [3, 5], ids=["eagle3", "dflash5"])
@pytest.mark.parametrize("store_dtype", ["model", "bf16", "fp8"])
@pytest.mark.parametrize(
    "layout",
    [
        Layout(),
        Layout(final="loss"),
        Layout(final="topk", topk=6),
        Layout(aux="fp4"),
        Layout(final="loss", aux="fp4"),
        Layout(final="topk", topk=6, aux="fp4"),
    ],  # fmt: skip
    ids=lambda x: x.name,
)
def test_each_layout_stores_what_it_says_reads_back_and_costs_what_the_count_says(
    tmp_path, layout, store_dtype, num_aux
):
    s = sample(num_aux=num_aux)
    head = torch.randn(V, H)
    s.update(zip(("topk_ids", "topk_logp"), encode_topk(s["hidden_states"], head, 6), strict=True))
    path = tmp_path / "s.safetensors"
    size = write_sample(path, s, {"rid": "r"}, store_dtype=store_dtype, layout=layout)
    metadata = read_metadata(path)
    assert Layout.from_metadata(metadata) == layout
    rows = loss_rows(s["loss_mask"])
    assert rows.tolist() == [2, 3, 4, 7, 8, 9, 10]  # the positions whose next token is a loss token
    assert sample_is_complete(path, T, len(rows)) and sample_is_complete(path, T)
    assert not sample_is_complete(path, T + 1, len(rows))
    back = decode_states(open_sample(path), metadata, torch.float32)
    tol = {"model": 1e-6, "bf16": 1e-2, "fp8": 0.07}[store_dtype]
    if layout.final == "topk":
        assert "hidden_states" not in back and torch.equal(back["topk_ids"], s["topk_ids"].long())
    else:
        hidden = back["hidden_states"]
        kept = rows if layout.final == "loss" else torch.arange(T)
        torch.testing.assert_close(hidden[kept], s["hidden_states"][kept], rtol=tol, atol=tol * 3)
        dropped = torch.ones(T, dtype=torch.bool)
        dropped[kept] = False
        assert not hidden[dropped].any()
        if layout.final == "loss":
            assert not sample_is_complete(path, T, len(rows) + 1)
    aux_err = (back["aux_hidden_states"] - s["aux_hidden_states"]).norm() / s["aux_hidden_states"].norm()
    assert back["aux_hidden_states"].shape == (T, num_aux * H)
    assert float(aux_err) < (0.12 if layout.aux == "fp4" else tol), float(aux_err)
    itemsize = 4 if store_dtype == "model" else 2
    expected = T * bytes_per_token(H, layout, store_dtype, loss_fraction=len(rows) / T, model_itemsize=itemsize,
                                   num_aux=num_aux)  # fmt: skip
    assert 0 <= size - expected < 2048, (size, expected)  # the rest: the header


def test_bytes_per_token_at_the_two_shapes():
    bf16 = Layout()
    assert bytes_per_token(576, bf16, "bf16") == 5 + 8 * 576
    assert bytes_per_token(7168, bf16, "bf16") == 5 + 8 * 7168
    top_fp4 = Layout(final="topk", topk=32, aux="fp4")
    assert bytes_per_token(7168, top_fp4, "bf16") == 5 + 6 * 32 + 3 * 7168 * (0.5 + 2 / 32)
    assert math.isclose(
        bytes_per_token(7168, top_fp4, "bf16") / bytes_per_token(7168, bf16, "bf16"), 0.2143, abs_tol=1e-3
    )
    assert bytes_per_token(576, Layout(final="loss"), "fp8", loss_fraction=0.5) == 5 + 0.5 * 580 + 3 * 576 + 4
    assert bytes_per_token(576, top_fp4, "bf16", num_aux=5) == 5 + 6 * 32 + 5 * 576 * (0.5 + 2 / 32)


def test_fp8_aux_states_are_never_rounded_again_to_four_bits():
    s = sample()
    with pytest.raises(ValueError, match="encoded from full width only"):
        encode_states({**s, "hidden_states_scale": torch.ones(T, 1), "aux_hidden_states_scale": torch.ones(T, 1)},
                      {"storage": "fp8_e4m3"}, "fp8", Layout(aux="fp4"))  # fmt: skip


def test_magnitude_codes_round_to_the_nearest_e2m1_magnitude_ties_to_the_smaller():
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    edges = [midpoints, torch.nextafter(midpoints, torch.tensor(0.0)), torch.nextafter(midpoints, torch.tensor(9.0))]
    a = torch.cat([*edges, torch.tensor([0.0, 1e-45, 2.0, 3.0, 4.0, 6.0, 6.5, 100.0]), torch.rand(200_000) * 7])
    assert torch.equal(magnitude_codes(a.clone()), torch.bucketize(a, midpoints).to(torch.uint8))
    assert magnitude_codes(midpoints.clone()).tolist() == list(range(7))  # a tie takes the smaller magnitude


def test_a_default_layout_dump_holds_the_topk_and_4bit_aux_states_and_is_checked_as_asked(tmp_path):
    """What a server writes for the default layout's request: no final state, the aux states 4-bit encoded; read back
    and checked as the worker does, and refused when it is not what was asked for."""
    s = sample()
    topk = encode_topk(s["hidden_states"], torch.randn(V, H), 4)
    codes, scales = encode_fp4(s["aux_hidden_states"])
    path = write_dump(tmp_path, "r", None, None, aux_layer_ids=[1, 2, 3], model="m", model_dtype=torch.float32,
                      topk=topk, aux_fp4=(codes, scales))  # fmt: skip
    dump = read_dump(path)
    assert dump.hidden_states is None and dump.aux_hidden_states is None and dump.hidden_size == H
    assert dump.metadata["aux_storage"] == "e2m1_b32" and dump.metadata["dtype"] == "float32"
    assert set(dump.states) == {*TOPK_TENSORS, *FP4_AUX_TENSORS} and set(dump.slices) == set(dump.states)
    validate_dump(dump, rid="r", num_tokens=T, hidden_size=H, topk=4, vocab_size=V, aux_fp4=True)
    with pytest.raises(DumpInvalid, match="aux states 4-bit, but full width was asked for"):
        validate_dump(dump, rid="r", num_tokens=T, hidden_size=H, topk=4, vocab_size=V)
    with pytest.raises(DumpInvalid, match="holds no hidden_states"):
        validate_dump(dump, rid="r", num_tokens=T, hidden_size=H, aux_fp4=True)
    # the store keeps the dump's tensors as they are: what a worker stores is the dump, copied
    out, metadata = encode_states({"input_ids": s["input_ids"], "loss_mask": s["loss_mask"], **dump.states},
                                  dump.metadata, "model", Layout(final="topk", topk=4, aux="fp4"))  # fmt: skip
    assert all(out[k] is dump.states[k] for k in dump.states)
    assert Layout.from_metadata(metadata).name == "top4@all+fp4"  # the distribution at every position


def test_a_corrupt_4bit_scale_in_a_dump_is_refused_naming_the_token(tmp_path):
    s = sample()
    codes, scales = encode_fp4(s["aux_hidden_states"])
    scales[5, 2] = float("nan")
    path = write_dump(
        tmp_path, "r", s["hidden_states"], None, aux_layer_ids=[1, 2, 3], model="m", aux_fp4=(codes, scales)
    )
    with pytest.raises(DumpInvalid, match=r"dump r: corrupt 4-bit block \(token 5, block 2\)"):
        validate_dump(read_dump(path), rid="r", num_tokens=T, hidden_size=H, aux_fp4=True)


def test_a_dump_request_names_its_forms_and_refuses_what_it_cannot_be():
    both = DumpEncoding(topk=24, aux_fp4=True)
    assert both.params() == {"eaglet_topk": 24, "eaglet_aux": "e2m1_b32"}
    assert DumpEncoding.from_params(both.params(), V) == both
    with pytest.raises(ValueError, match="eaglet_aux='e2m1'"):
        DumpEncoding.from_params({"eaglet_aux": "e2m1"}, V)
    with pytest.raises(ValueError, match="ask for one"):
        DumpEncoding(fp8=True, aux_fp4=True)
    with pytest.raises(ValueError, match="neither the final state nor its top-k"):
        write_dump(Path("."), "r", None, torch.zeros(2, 3 * H), aux_layer_ids=[1, 2, 3], model="m")


def test_a_topk_at_loss_positions_is_scored_stored_and_read_at_those_rows_only(tmp_path):
    """The default layout's top-k: the request names the loss spans, the server scores those rows only, the store
    keeps them, and training reads at every loss position what a top-k over all positions gives there."""
    s, head = sample(), torch.randn(V, H)
    spans = loss_spans(s["loss_mask"])
    assert spans == ((2, 5), (7, 11)) and torch.equal(span_rows(spans, 0, T), loss_rows(s["loss_mask"]))
    assert span_rows(spans, 4, 4).tolist() == [0, 3]  # a prefill chunk of positions 4..7: rows 4 and 7
    encoding = DumpEncoding(topk=4, aux_fp4=True, topk_rows=spans)
    assert DumpEncoding.from_params(encoding.params(), V) == encoding and encoding.topk_length(T) == 7
    rows = loss_rows(s["loss_mask"])
    everywhere = encode_topk(s["hidden_states"], head, 4)
    scored = encode_topk(s["hidden_states"][rows], head, 4)  # what a server asked for the spans computes
    codes, scales = encode_fp4(s["aux_hidden_states"])
    path = write_dump(tmp_path, "r", None, None, aux_layer_ids=[1, 2, 3], model="m", model_dtype=torch.float32,
                      topk=scored, aux_fp4=(codes, scales))  # fmt: skip
    dump = read_dump(path)
    validate_dump(dump, rid="r", num_tokens=T, hidden_size=H, topk=4, vocab_size=V, aux_fp4=True, topk_rows=7)
    with pytest.raises(DumpInvalid, match="top-4 distribution of 7 rows, 12 asked for"):
        validate_dump(dump, rid="r", num_tokens=T, hidden_size=H, topk=4, vocab_size=V, aux_fp4=True)
    loss = Layout(final="topk", topk=4, aux="fp4", topk_rows="loss")
    assert loss.name == "top4+fp4" and loss.metadata()["topk_rows"] == "loss"
    base = {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"]}
    out = tmp_path / "s.safetensors"
    write_sample(out, {**base, **dump.states}, dump.metadata, layout=loss)
    assert sample_is_complete(out, T, len(rows)) and not sample_is_complete(out, T, len(rows) - 1)
    assert sample_is_complete(out, T)  # the loss rows not given: any count up to T
    tensors, metadata = open_sample(out), read_metadata(out)
    assert tensors["topk_ids"].shape == (7, 4) and Layout.from_metadata(metadata) == loss
    read = decode_states(tensors, metadata, torch.float32)
    assert torch.equal(read["topk_ids"][rows], everywhere[0][rows].long())
    assert torch.equal(read["topk_logp"][rows], everywhere[1][rows].float())
    others = torch.ones(T, dtype=torch.bool)
    others[rows] = False
    assert bool(torch.isneginf(read["topk_logp"][others]).all())  # no distribution: no loss reads them
    # a dump of the top-k at every position stores its loss rows; one of another count is refused
    stored, _ = encode_states({**base, "topk_ids": everywhere[0], "topk_logp": everywhere[1],
                               "aux_hidden_states": s["aux_hidden_states"]}, {}, "model", Layout(final="topk", topk=4,
                              topk_rows="loss"))  # fmt: skip
    assert torch.equal(stored["topk_ids"], scored[0])
    with pytest.raises(ValueError, match="a top-k of 3 rows, neither the 7 loss positions nor all 12"):
        encode_states({**base, "topk_ids": everywhere[0][:3], "topk_logp": everywhere[1][:3],
                       "aux_hidden_states": s["aux_hidden_states"]}, {}, "model", loss)  # fmt: skip
    assert (
        bytes_per_token(H, loss, "model", loss_fraction=0.5)
        == bytes_per_token(H, Layout(final="topk", topk=4, aux="fp4"), "model") - 0.5 * 6 * 4
    )


@pytest.mark.parametrize(
    ("rows", "reason"),
    [
        ("1,2", "give a list of"),
        ([[1]], "not a pair of integers"),
        ([[3, 3]], "is empty, or overlaps"),
        ([[4, 6], [5, 8]], "is empty, or overlaps"),
        ([[1.0, 2]], "not a pair of integers"),
    ],
)
def test_a_request_naming_bad_topk_rows_is_refused_naming_them(rows, reason):
    with pytest.raises(ValueError, match=f"custom_params.eaglet_topk_rows.*{reason}"):
        DumpEncoding.from_params({"eaglet_topk": 4, "eaglet_topk_rows": rows}, V)
    with pytest.raises(ValueError, match="the rows of which top-k"):
        DumpEncoding.from_params({"eaglet_topk_rows": [[0, 2]]}, V)
