"""The SGLang dump plugin against SGLang's real classes, in a subprocess of the SGLang venv.

Real: SGLang 0.5.23's ``load_plugins`` (entry point discovery), ``HookRegistry`` (the patching),
``ScheduleBatch``, ``Req``, ``SamplingParams``, ``ForwardMode``, ``LogitsProcessorOutput``,
``GenerationBatchResult``, ``LlamaForCausalLM.set_eagle3_layers_to_capture``; the dumps are read back
here with the extractor's own ``read_dump`` + ``validate_dump``.
Stand-ins, because they need a GPU and an initialized process group: the model forward under
``TpModelWorker.forward_batch_generation`` (it lays out rows by cumulative ``extend_lens`` as SGLang
does, and pads the outputs as a CUDA graph would), ``LogitsProcessor.forward`` and
``ModelRunner.init_attention_backends`` underneath the hooks, and the attention TP/CP rank functions.

The cases live in test_sglang_plugin_cases.py; the tests below run it once with the SGLang venv's
Python and check each case.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from eaglet.shared.layers import default_layer_ids

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
CASES = Path(__file__).with_name("test_sglang_plugin_cases.py")
H = 32  # hidden size of the stand-in model (as in the cases)
LAYERS = 8  # -> EAGLE-3 layers [2, 4, 5]


def sglang_python() -> Path:
    if not SGLANG_PY.exists():
        pytest.fail(f"{SGLANG_PY.relative_to(ROOT)} is missing: run `make install` (scripts/install-sglang-cpu.sh)")
    return SGLANG_PY


@pytest.fixture(scope="module")
def sglang_cases(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("sglang-cases")
    proc = subprocess.run(
        [str(sglang_python()), str(CASES), "cases", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, f"cases failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads((out / "results.json").read_text()), out / "dumps"


def _dump_files(dump_dir: Path) -> set[str]:
    """The dumps and temp files; not the writers' figures (``.writers/``)."""
    return {p.name for p in dump_dir.iterdir() if p.name != ".writers"} if dump_dir.exists() else set()


def _check_dump(dump_dir: Path, rid: str, prompt: list[int], dtype: str = "float32", layers: list[int] | None = None):
    """The extractor's own reading and validation, then the values: row p is token p of the prompt."""
    import torch

    from eaglet.shared.dumpfile import dump_path, read_dump, validate_dump

    dump = read_dump(dump_path(dump_dir, rid))
    validate_dump(dump, rid=rid, num_tokens=len(prompt), hidden_size=H)
    assert dump.metadata["dtype"] == dtype
    assert dump.metadata["model"] == "tiny-llama"
    layers = layers or default_layer_ids(LAYERS)
    assert dump.aux_layer_ids == layers and dump.aux_hidden_states.shape == (len(prompt), len(layers) * H)
    ids = torch.tensor(prompt, dtype=torch.float32)
    pos = torch.arange(len(prompt), dtype=torch.float32)
    assert torch.equal(dump.hidden_states[:, 0].float(), ids)
    assert torch.equal(dump.hidden_states[:, 1].float(), pos)
    for k in range(len(layers)):
        assert torch.equal(dump.aux_hidden_states[:, k * H].float(), ids + 10 * (k + 1))


def test_plugin_loads_through_entry_point(sglang_cases):
    results, _ = sglang_cases
    assert results["load"]["wrapped"] == {"forward": True, "init_attention": True, "logits": True}


def test_interleaved_requests_one_batch(sglang_cases):
    results, dumps = sglang_cases
    case = results["interleaved"]
    for rid, prompt in case["prompts"].items():
        _check_dump(dumps, rid, prompt)
    assert not any(name.startswith("HEALTH") or name.startswith("warm") for name in _dump_files(dumps))


def test_chunked_prefill_over_three_chunks(sglang_cases):
    results, dumps = sglang_cases
    case = results["chunked"]
    assert case["exists_after_chunk"] == [False, False, True]
    _check_dump(dumps, case["rid"], case["prompt"])
    _check_dump(dumps, case["other_rid"], case["other_prompt"])


def test_decode_rows_are_skipped(sglang_cases):
    results, dumps = sglang_cases
    case = results["mixed"]
    _check_dump(dumps, case["rid"], case["prompt"])
    assert f"{case['decode_rid']}.safetensors" not in _dump_files(dumps)
    assert case["decode_batch_result_passed_through"]


def test_warmup_rid_is_not_dumped(sglang_cases):
    results, dumps = sglang_cases
    case = results["warmup"]
    assert case["result_passed_through"]
    assert case["new_files"] == []


def test_aborted_request_is_dropped_after_timeout(sglang_cases):
    results, dumps = sglang_cases
    case = results["aborted"]
    assert case["pending_before"] == [case["rid"]]
    assert case["expired"] == [case["rid"]]
    assert case["pending_after"] == []
    assert f"{case['rid']}.safetensors" not in _dump_files(dumps)


def test_chunk_gap_marks_sample_incomplete(sglang_cases):
    results, dumps = sglang_cases
    case = results["gap"]
    assert f"{case['rid']}.safetensors" not in _dump_files(dumps)
    assert f"{case['late_rid']}.safetensors" not in _dump_files(dumps)


def test_tp_rank_not_zero_writes_nothing(sglang_cases):
    results, dumps = sglang_cases
    for rid in results["rank"]["rids"]:
        assert f"{rid}.safetensors" not in _dump_files(dumps)


def test_unsafe_rid_refused(sglang_cases):
    results, dumps = sglang_cases
    assert results["unsafe"]["new_files"] == []
    assert results["unsafe"]["outside"] == []


def test_without_native_final_states_the_logits_hook_supplies_them(sglang_cases):
    results, dumps = sglang_cases
    case = results["stash"]
    _check_dump(dumps, case["rid"], case["prompt"], dtype="bfloat16")


def test_five_layers_are_captured_and_dumped(sglang_cases):
    results, dumps = sglang_cases
    case = results["five_layers"]
    assert case["captured"] == [1, 2, 3, 5, 7]
    _check_dump(dumps, case["rid"], case["prompt"], layers=[1, 2, 3, 5, 7])


def test_capture_enabled_before_graphs(sglang_cases):
    results, _ = sglang_cases
    case = results["capture"]
    assert case["default"] == default_layer_ids(LAYERS)
    assert case["chosen"] == [3, 5, 6]
    assert case["already_on"] == default_layer_ids(LAYERS)  # the plugin's ids win over the server's


def test_fp8_asked_is_encoded_before_the_copy_with_the_stores_encoder(sglang_cases):
    """The same prompt dumped full width and fp8 in one forward: the fp8 dump holds exactly what the workers'
    encoder makes of the full-width one (the GPU runs the same code; bench/gpu checks the bits there)."""
    import torch

    from eaglet.shared.dumpfile import dump_path, read_dump, validate_dump
    from eaglet.shared.store import encode_fp8

    results, dumps = sglang_cases
    case = results["fp8"]
    wide = read_dump(dump_path(dumps, case["wide_rid"]))
    enc = read_dump(dump_path(dumps, case["fp8_rid"]))
    validate_dump(enc, rid=case["fp8_rid"], num_tokens=len(case["prompt"]), hidden_size=H)
    assert not wide.fp8 and enc.fp8 and enc.metadata["dtype"] == "bfloat16"
    for name in ("hidden_states", "aux_hidden_states"):
        values, scale = encode_fp8(getattr(wide, name))
        assert torch.equal(getattr(enc, name).view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(enc.scales[f"{name}_scale"], scale)


def test_topk_asked_is_computed_before_the_copy_from_the_model_directorys_head(sglang_cases):
    """Over a chunked prefill, beside a request that asks for none, alone and with fp8: the top-k of the stand-in's
    final states over the LM head as the trainer reads it from the model directory, as the reference server
    computes it; what the worker's own check of a top-k run accepts."""
    import torch

    from eaglet.shared.dumpfile import dump_path, read_dump, validate_dump
    from eaglet.shared.targettensors import load_target_tensors
    from eaglet.shared.topk import encode_topk

    results, dumps = sglang_cases
    case = results["topk"]
    assert case["exists_after_chunk"] == [False, False, True]
    head = load_target_tensors(Path(case["model_dir"]))["lm_head"]
    n = len(case["prompt"])
    _check_dump(dumps, case["plain_rid"], case["prompt"], dtype="bfloat16")
    plain = read_dump(dump_path(dumps, case["plain_rid"]))
    assert not plain.topk and "topk" not in plain.metadata
    for rid, k in case["rids"].items():
        dump = read_dump(dump_path(dumps, rid))
        validate_dump(dump, rid=rid, num_tokens=n, hidden_size=H, topk=k, vocab_size=head.shape[0])
        assert dump.fp8 == (k == 3) and dump.metadata["topk"] == str(k)
        assert dump.hidden_states is None  # the top-k replaces the final state: it never leaves the device
        ids, logp = encode_topk(plain.hidden_states, head, k)
        assert torch.equal(dump.topk["topk_ids"], ids)
        assert torch.equal(dump.topk["topk_logp"], logp)


def test_default_layout_asked_dumps_the_topk_and_4bit_aux_states_the_store_keeps(sglang_cases):
    """The default layout's request, over two chunks beside others: no final state, the aux states as the workers'
    4-bit encoder makes them of the full-width ones, the top-k as above; the worker's check of such a run accepts it,
    and the store keeps the dump's tensors as they are."""
    import torch

    from eaglet.shared.dumpfile import dump_path, read_dump, validate_dump
    from eaglet.shared.fp4 import encode_fp4
    from eaglet.shared.layout import Layout
    from eaglet.shared.store import FP4_AUX_TENSORS, encode_states
    from eaglet.shared.targettensors import load_target_tensors
    from eaglet.shared.topk import encode_topk

    results, dumps = sglang_cases
    case = results["topk"]
    head = load_target_tensors(Path(case["model_dir"]))["lm_head"]
    n = len(case["prompt"])
    plain = read_dump(dump_path(dumps, case["plain_rid"]))
    rid = case["default_rid"]
    dump = read_dump(dump_path(dumps, rid))
    validate_dump(dump, rid=rid, num_tokens=n, hidden_size=H, topk=4, vocab_size=head.shape[0], aux_fp4=True)
    assert dump.hidden_states is None and dump.aux_hidden_states is None and dump.hidden_size == H
    assert dump.metadata["aux_storage"] == "e2m1_b32" and dump.metadata["dtype"] == "bfloat16"
    for got, want in zip((dump.aux_fp4[k] for k in FP4_AUX_TENSORS), encode_fp4(plain.aux_hidden_states), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(dump.topk.values(), encode_topk(plain.hidden_states, head, 4), strict=True):
        assert torch.equal(got, want)
    tensors = {"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.uint8), **dump.states}
    stored, _ = encode_states(tensors, dump.metadata, "model", Layout(final="topk", topk=4, aux="fp4"))
    assert all(stored[k] is dump.states[k] for k in (*FP4_AUX_TENSORS, *dump.topk))
    with pytest.raises(Exception, match="4-bit was asked for|full width was asked for"):
        validate_dump(plain, rid=case["plain_rid"], num_tokens=n, hidden_size=H, aux_fp4=True)


def test_a_topk_asked_at_loss_positions_scores_those_rows_only_across_chunks(sglang_cases):
    """The default layout's request naming its loss spans, split across two forwards: the dump's top-k holds the
    spans' rows, in order, each as the top-k over every position gives it."""
    import torch

    from eaglet.shared.dumpfile import dump_path, read_dump, validate_dump
    from eaglet.shared.targettensors import load_target_tensors
    from eaglet.shared.topk import encode_topk

    results, dumps = sglang_cases
    case = results["topk"]
    head = load_target_tensors(Path(case["model_dir"]))["lm_head"]
    n = len(case["prompt"])
    plain = read_dump(dump_path(dumps, case["plain_rid"]))
    dump = read_dump(dump_path(dumps, case["loss_rid"]))
    rows = [p for a, b in case["loss_spans"] for p in range(a, b)]
    validate_dump(dump, rid=case["loss_rid"], num_tokens=n, hidden_size=H, topk=4, vocab_size=head.shape[0],
                  aux_fp4=True, topk_rows=len(rows))  # fmt: skip
    for got, want in zip(dump.topk.values(), encode_topk(plain.hidden_states, head, 4), strict=True):
        assert torch.equal(got, want[rows])


def test_topk_without_a_safetensors_model_path_writes_no_dump_and_says_why_once(sglang_cases):
    results, dumps = sglang_cases
    case = results["no_head"]
    for rid in case["asked"]:
        assert f"{rid}.safetensors" not in _dump_files(dumps)
    _check_dump(dumps, case["other_rid"], case["other_prompt"])
    assert case["results_passed_through"]
    [error] = case["errors"]
    assert case["model_path"] in error and "no safetensors files" in error


def test_writer_publishes_its_figures(sglang_cases):
    from eaglet.shared.dumpwriter import read_writer_stats

    _, dumps = sglang_cases
    [stats] = read_writer_stats(dumps, max_age_s=600)
    assert stats.written >= 8 and stats.failed == 0 and stats.queued_bytes == 0
    assert 0 < stats.peak_bytes <= stats.cap_bytes


def test_the_capture_logs_what_it_costs_the_forwards_once_an_interval(sglang_cases):
    results, _ = sglang_cases
    first, second = results["clock"]  # nothing while the interval ran; then one line a forward at interval 0
    assert first.startswith("capture: 2 forwards in ") and second.startswith("capture: 1 forwards in ")
    for line in (first, second):
        assert "ms of the scheduler's time" in line and "not timed (no GPU) of the device's (0 timed" in line
        assert line.endswith("on the forward stream)")


def test_a_side_stream_asked_on_a_cpu_captures_as_the_forwards_own_and_bad_settings_are_refused(sglang_cases):
    results, dumps = sglang_cases
    case = results["side_stream"]
    _check_dump(dumps, case["rid"], case["prompt"])
    assert "EAGLET_CAPTURE_STREAM='async'" in case["refused"] and "forward, side" in case["refused"]
    assert "EAGLET_CAPTURE_LOG_S=0.0" in case["log_every_refused"] and case["log_every_s"] == 10.0


def test_no_temp_files_left(sglang_cases):
    _, dumps = sglang_cases
    assert not [n for n in _dump_files(dumps) if n.endswith(".tmp")]
