"""The head-to-head's CPU-side parts: Magpie prompt synthesis and its filters, eaglet's stored samples as
SpecForge's offline features, the SmolLM2 target as SpecForge's loaders read it, and the results table."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from bench.gpu import h2hreport, magpie
from bench.gpu.specforge_features import convert, run_config, target_view, to_specforge, training_split
from eaglet.services.trainer.data import load_sample
from eaglet.shared.store import write_sample


def test_magpie_prefix_is_the_template_up_to_the_user_content(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    first = magpie.user_prefix(tok, [])
    assert first.startswith("<|im_start|>system\n") and first.endswith("<|im_start|>user\n")
    history = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]
    later = magpie.user_prefix(tok, history)
    assert "Name a prime.<|im_end|>" in later and "Seven.<|im_end|>" in later and later.endswith("<|im_start|>user\n")


def test_turns_are_cut_at_template_markers_and_bad_lengths_dropped():
    assert magpie.clean_turn("  How do tides work on Earth?<|im_end|>\n<|im_start|>assistant\nThey") == (
        "How do tides work on Earth?"
    )
    assert magpie.clean_turn("") is None
    assert magpie.clean_turn("   <|im_end|>") is None
    assert magpie.clean_turn("Hi there") is None  # too short to be a prompt
    assert magpie.clean_turn("word " * 1000) is None  # past MAX_CHARS


def test_repeats_differing_in_case_punctuation_or_spacing_are_dropped():
    kept, stats = magpie.filter_prompts(
        ["What is the capital of France?", "what is the  capital of france", "", "Explain how a rainbow forms."],
        magpie.Deduper(),
    )
    assert kept == ["What is the capital of France?", "Explain how a rainbow forms."]
    assert stats == {"sampled": 4, "kept": 2, "empty_or_bad_length": 1, "repeats": 1}


def test_heldout_split_is_stable_about_its_fraction_and_apart_from_the_trainers():
    from eaglet.services.trainer.data import is_heldout as trainer_heldout

    ids = [f"mp-{i:06d}" for i in range(4000)]
    held = [i for i in ids if magpie.is_heldout(i, 0.05)]
    assert 120 < len(held) < 280 and held == [i for i in ids if magpie.is_heldout(i, 0.05)]
    assert set(held) != {i for i in ids if trainer_heldout(i, 0.05)}


def _sample(path, n=9, h=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "input_ids": torch.arange(100, 100 + n, dtype=torch.int32),
        "loss_mask": torch.tensor([0] * 4 + [1] * (n - 4), dtype=torch.uint8),
        "hidden_states": torch.randn(n, h, generator=g).to(torch.bfloat16),
        "aux_hidden_states": torch.randn(n, 3 * h, generator=g).to(torch.bfloat16),
    }
    write_sample(path, tensors, {"aux_layer_ids": json.dumps([1, 2, 3])})
    return tensors


def test_stored_sample_becomes_specforge_offline_features(tmp_path):
    stored = _sample(tmp_path / "s0.safetensors")
    out = tmp_path / "features"
    out.mkdir()
    assert convert([(7, "s0", str(tmp_path / "s0.safetensors"))], str(out)) == 9
    feats = torch.load(out / "00000007.ckpt", weights_only=False, mmap=True)  # as SpecForge's loader reads it
    assert set(feats) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert feats["input_ids"].tolist() == list(range(100, 109)) and feats["input_ids"].dtype == torch.long
    assert feats["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert feats["hidden_state"].shape == (1, 9, 8) and feats["aux_hidden_state"].shape == (1, 9, 24)
    assert torch.equal(feats["hidden_state"][0], stored["hidden_states"])
    assert torch.equal(feats["aux_hidden_state"][0], stored["aux_hidden_states"])
    # what SpecForge's normalize_offline_sample takes from it: [1, T, 3H] inputs, [1, T, H] target
    assert feats["aux_hidden_state"].squeeze(0)[:2048].unsqueeze(0).shape == (1, 9, 24)
    assert to_specforge(load_sample(tmp_path / "s0.safetensors", torch.bfloat16))["loss_mask"].sum() == 5


def test_specforge_trains_on_eaglets_training_split():
    rows = [(i, f"s{i}", 10) for i in range(400)]
    train = training_split(rows, 0.05)
    from eaglet.services.trainer.data import is_heldout

    assert [r[1] for r in train] == [r[1] for r in rows if not is_heldout(r[1], 0.05)] and len(train) < 400


def test_target_view_maps_the_tied_head_and_embedding(tmp_path, smollm2_dir):
    view = target_view(smollm2_dir, tmp_path / "view")
    index = json.loads((view / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"lm_head.weight", "model.embed_tokens.weight"}
    with safe_open(str(view / "heads.safetensors"), framework="pt") as f:
        head, embed = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    assert head.shape == (49152, 576) and torch.equal(head, embed)
    assert (view / "config.json").resolve() == (smollm2_dir / "config.json").resolve()


def test_run_config_keeps_specforge_defaults_but_epochs_and_batch(tmp_path):
    cfg = run_config(tmp_path / "t", tmp_path / "f", tmp_path / "o", epochs=3, batch_size=7, max_length=2048)
    assert cfg["training"] == {"num_epochs": 3, "batch_size": 7, "save_interval": 0}
    assert cfg["data"]["hidden_states_path"] == str(tmp_path / "f") and "learning_rate" not in cfg["training"]


def _write_phases(out, with_specforge=True):
    ev = {"chains": ["(3, 1, 4)"], "prompt_sets": ["humaneval"], "max_new_tokens": 256, "concurrency": 32,
          "baseline": {"humaneval": {"output_tokens_per_s": 1000.0}},
          "eaglet": {"(3, 1, 4)": {"humaneval": {"accept_length": 2.1, "output_tokens_per_s": 1500.0}}},
          "specforge": {"(3, 1, 4)": {"humaneval": {"accept_length": 2.0, "output_tokens_per_s": 1400.0}}}}  # fmt: skip
    (out / "h2h-eval.json").write_text(json.dumps(ev))
    (out / "h2h-eaglet.json").write_text(json.dumps({"tokens_per_s": 90000.0, "peak_gpu_GiB": 10.0, "wall_s": 100}))
    if with_specforge:
        (out / "h2h-specforge.json").write_text(json.dumps({"tokens_per_s": 45000.0, "peak_gpu_GiB": 20.0}))
    else:
        (out / "h2h-specforge.json").write_text(json.dumps({"error": "RuntimeError: boom", "rc": 1}))
        ev["specforge"]["(3, 1, 4)"]["humaneval"] = {"error": "no drafter"}
        (out / "h2h-eval.json").write_text(json.dumps(ev))


def test_report_table_and_ratios(tmp_path):
    _write_phases(tmp_path)
    s = h2hreport.write(tmp_path, tmp_path / "results")
    assert s["ratios"]["accept_length (3, 1, 4) humaneval"] == 1.05
    assert s["ratios"]["trainer tokens/s"] == 2.0 and s["ratios"]["trainer peak memory"] == 0.5
    assert s["rows"][0]["eaglet"]["speedup"] == 1.5
    md = (tmp_path / "results" / "gpu-headtohead.md").read_text()
    assert "| (3, 1, 4) | humaneval | 2.100 | 2.000 | 1.050 | 1,500 | 1,400 | 1,000 |" in md
    assert json.loads((tmp_path / "results" / "gpu-headtohead.json").read_text())["ratios"] == s["ratios"]


def test_report_of_a_partial_run_shows_what_failed(tmp_path):
    _write_phases(tmp_path, with_specforge=False)
    s = h2hreport.write(tmp_path, tmp_path)
    assert s["ratios"]["trainer tokens/s"] is None and s["ratios"]["accept_length (3, 1, 4) humaneval"] is None
    assert s["errors"] == {
        "h2h-specforge": "RuntimeError: boom",
        "h2h-eval specforge (3, 1, 4) humaneval": "no drafter",
    }
    assert "h2h-specforge: RuntimeError: boom" in (tmp_path / "gpu-headtohead.md").read_text()


@pytest.mark.parametrize("bad", ["", "{not json"])
def test_report_names_a_broken_phase_file(tmp_path, bad):
    (tmp_path / "h2h-eval.json").write_text(bad)
    with pytest.raises(ValueError, match="h2h-eval.json"):
        h2hreport.load(tmp_path)


def test_step_counts_read_back_from_redis_as_strings_are_formatted():
    assert h2hreport.fmt("4168") == "4,168" and h2hreport.fmt("16600.5", 0) == "16,600" and h2hreport.fmt(None) == "—"
    assert h2hreport.fmt("n/a") == "n/a"


def test_agreement_counts_equal_outputs_and_where_the_others_part():
    a = h2hreport.agreement(["abcdef", "xyz", "abcd", None], ["abcdef", "xbz", "abzz", "q"])
    assert a["same"] == 1 and a["of"] == 4
    assert a["first_difference_chars_median"] == 2 and a["first_difference_share_median"] == 0.5


def test_report_shows_each_evaluation_call_side_by_side(tmp_path):
    _write_phases(tmp_path)
    again = json.loads((tmp_path / "h2h-eval.json").read_text())
    again["eaglet"]["(3, 1, 4)"]["humaneval"]["output_tokens_per_s"] = 1300.0
    (tmp_path / "again.json").write_text(json.dumps(again))
    s = h2hreport.write(tmp_path, tmp_path / "results", [tmp_path / "again.json"])
    assert [r["eaglet tok/s"] for r in s["rows"][0]["runs"]] == [1500.0, 1300.0]
    md = (tmp_path / "results" / "gpu-headtohead.md").read_text()
    assert "| (3, 1, 4) | humaneval | 2 | 1,000 | 2.100 | 1,300 | 2.000 | 1,400 |" in md


def test_report_lists_each_recipe_beside_the_default_with_its_ratio_to_specforge(tmp_path):
    _write_phases(tmp_path)
    recipe = {"flags": "--aux-noise 0.05",
              "train": {"wall_s": 180.0, "trained_beside": 6,
                        "probe": {"final": {"step": "1666"}, "config": {"lr": 1e-3, "norm_before_fc": True,
                                                                        "aux_noise": 0.05}}},
              "score": {"heldout_acc": [0.41, 0.35]},
              "eval": {"humaneval": {"accept_length": 2.2, "accept_rate_per_position": [0.5, 0.2]}}}  # fmt: skip
    (tmp_path / "h2h-ablations.json").write_text(json.dumps({"noise": recipe, "lr": {"train": {"error": "boom"}}}))
    s = h2hreport.write(tmp_path, tmp_path / "results")
    names = [r["name"] for r in s["recipes"]]
    assert names == ["h2h-eaglet", "noise", "lr"]  # the head-to-head's own drafter first
    noise = s["recipes"][1]
    assert noise["humaneval"] == {
        "accept_length": 2.2,
        "ratio_to_specforge": 1.1,
        "accept_rate_per_position": [0.5, 0.2],
    }
    assert s["recipes"][0]["humaneval"]["ratio_to_specforge"] == 1.05 and noise["steps"] == 1666
    md = (tmp_path / "results" / "gpu-headtohead.md").read_text()
    assert (
        "| noise | --aux-noise 0.05 | lr 0.001, norm, noise 0.05 | 2.200 (1.100); 0.50 / 0.20 | 0.41 / 0.35 | "
        "1,666 | 180.0 (6) |"
    ) in md
    assert "| lr (boom) |" in md


def test_storage_run_shows_each_layouts_bytes_and_accept_length_against_base(tmp_path):
    # a storage run evaluates recipes without the head-to-head: no SpecForge rows, the recipes' own prompt sets
    def recipe(flags, humaneval, heldout):
        return {"flags": flags, "train": {"rc": 0},
                "eval": {"humaneval": {"accept_length": humaneval}, "heldout": {"accept_length": heldout}}}  # fmt: skip

    plain = "(default recipe)"
    ablations = {"base": recipe(plain, 1.6, 1.8), "layout-top24-fp4": recipe(plain, 1.6, 1.782),
                 "layout-top24-fp4.uniform": recipe("--topk-tail uniform", 1.64, 1.8),
                 "layout-fp4": {"flags": "(default recipe)", "train": {"error": "no run of layout fp4"}},
                 "noise": recipe("--aux-noise 0", 1.5, 1.7)}  # fmt: skip
    (tmp_path / "h2h-ablations.json").write_text(json.dumps(ablations))
    (tmp_path / "h2h-extract.json").write_text(json.dumps({"tokens": 1000, "counts": {"bytes": "4614500"}}))
    runs = {"top24-fp4": {"run_id": "r-top24-fp4", "spec": "topk:24:fp4", "bytes_per_token": 1123.2}}
    (tmp_path / "h2h-layouts.json").write_text(json.dumps({"runs": runs, "done": True}))
    s = h2hreport.write(tmp_path, tmp_path / "results")
    assert [r["name"] for r in s["layouts"]] == ["base", "layout-top24-fp4", "layout-top24-fp4.uniform", "layout-fp4"]
    top24, uniform = s["layouts"][1], s["layouts"][2]
    assert top24["ratio_to_bf16"] == 0.243 and s["layouts"][0]["bytes_per_token"] == 4614.5
    assert top24["heldout"] == {"accept_length": 1.782, "change": -0.01}
    assert uniform["humaneval"]["change"] == 0.025 and uniform["bytes_per_token"] == 1123.2
    md = (tmp_path / "results" / "gpu-headtohead.md").read_text()
    assert "| layout-top24-fp4 | topk:24:fp4 | 1,123.2 | 0.243 | 1.6000 (+0.0%) | 1.7820 (-1.0%) |" in md
    assert "| layout-top24-fp4.uniform | topk:24:fp4 --topk-tail uniform | 1,123.2 |" in md
    assert "| base | (default recipe) | — | 1.600 (—); — | 1.800 (—); — |" in md  # accept lengths with no SpecForge


def test_trainer_variants_median_leaves_a_cold_compile_out_and_is_set_against_specforge():
    def row(variant, repeat, tokens_per_s, cold=False, rc=0):
        return {"variant": variant, "repeat": repeat, "flags": f"--compile {variant}", "rc": rc, "cold_compile": cold,
                "tokens_per_s": tokens_per_s, "steady_tokens_per_s": 2 * (tokens_per_s or 0),
                "peak_allocated_GiB": 2.0, "heldout_acc": [0.5, 0.4]}  # fmt: skip

    R = {"variants": {"on": "--compile on", "off": "--compile off"},
         "rows": [row("on", "cold", 8000, cold=True), row("on", 0, 19000), row("on", 1, 18000),
                  row("off", 0, 20000), row("off", 1, None, rc=1)]}  # fmt: skip
    on, off = h2hreport.trainspeed(R, 10000)
    assert (on["median_tokens_per_s"], on["range"], on["spread"]) == (18500, [18000, 19000], 0.054)
    assert on["ratio_to_specforge"] == 1.85 and on["cold_compile"] == [True, False, False]
    assert (off["median_tokens_per_s"], off["failed"], off["ratio_to_specforge"]) == (20000, 1, 2.0)
    assert h2hreport.trainspeed({}, 10000) == []
