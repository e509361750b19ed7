"""The family drafters' verdict: a drafter that loads and accepts nothing, or changes the greedy output other than at
the target's near-ties, fails."""

import json

from bench.gpu import familydrafters, h2hreport


def decoded(accept_length, same=32, of=32, at_tie=0, **extra):
    agreement = {"same": same, "of": of, "differ_at_near_tie": at_tie, "differ_otherwise": of - same - at_tie,
                 "tie_nats": familydrafters.TIE_NATS}  # fmt: skip
    return {"accept_length": accept_length, "errors": 0, "same_ids_as_target_alone": agreement, **extra}


def test_a_drafter_that_is_accepted_and_keeps_the_text_passes():
    assert familydrafters.verdict({"errors": 0}, decoded(1.8)) == ("ok", [])


def test_a_drafter_loaded_but_never_accepted_fails():
    status, why = familydrafters.verdict({"errors": 0}, decoded(1.0))
    assert status == "failed" and "accept length 1.0" in why[0] and "not accepted" in why[0]


def test_other_output_than_the_target_alone_fails_even_when_accepted():
    status, why = familydrafters.verdict({"errors": 0}, decoded(2.0, same=29, at_tie=1))
    assert status == "failed" and why[0].startswith("2 of 32 greedy outputs differ from the target alone's where")


def test_outputs_that_part_only_at_the_target_s_near_ties_pass():
    assert familydrafters.verdict({"errors": 0}, decoded(2.0, same=29, at_tie=3)) == ("ok", [])


def test_where_outputs_first_part_is_judged_by_the_reference_s_top_two_gap():
    reference = [[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 2]]
    gaps = [[3.0, 0.1, 2.0], [3.0, 2.0, 2.0], [1.0, 1.0, 1.0], [0.5, 0.5]]
    got = h2hreport.tie_agreement([[5, 9, 9], [5, 9, 7], [5, 6, 7], None], reference, gaps, 0.25)
    assert got == {"same": 1, "of": 4, "differ_at_near_tie": 1, "differ_otherwise": 1, "tie_nats": 0.25,
                   "first_difference_gaps": [0.1, 2.0]}  # fmt: skip


def test_a_case_s_near_tie_widens_to_where_the_target_alone_parts_from_itself():
    assert familydrafters.case_tie({"same_ids_again": {"first_difference_gaps": [0.0, 0.0625]}}) == 0.25
    assert familydrafters.case_tie({"same_ids_again": {"first_difference_gaps": [0.4375, 0.625, None]}}) == 0.625
    assert familydrafters.case_tie({"error": "no server"}) == familydrafters.TIE_NATS


def test_a_server_that_did_not_come_up_fails_with_its_error():
    status, why = familydrafters.verdict({"errors": 0}, {"error": "RuntimeError: fam exited (1)"})
    assert status == "failed" and why == ["with the drafter: RuntimeError: fam exited (1)"]


def test_every_tp1_family_is_a_case_and_the_table_names_each():
    assert familydrafters.tp1_cases() == ["llama-tp1", "qwen3-tp1", "deepseek-tp1", "qwen3moe-tp1", "kimi-tp1",
                                          "gptoss-tp1", "gemma3-tp1", "smollm2real-tp1",
                                          "gemma3real-tp1"]  # fmt: skip
    results = {"steps": 300, "prompts": 32, "tokens": 64, "cases": {
        "llama-tp1": {"architecture": "LlamaForCausalLM", "status": "ok", "drafted": decoded(1.9, same=31, at_tie=1),
                      "train": {"probe": {"final": {"heldout_acc": [0.8, 0.5]}}}},
        "gptoss-tp1": {"architecture": "GptOssForCausalLM", "skipped": "skipped: no extraction"}}}  # fmt: skip
    md = familydrafters.markdown(results)
    assert "| llama-tp1 | LlamaForCausalLM | ok | 0.80 / 0.50 | 1.900 | — | 31/32 (1 / 0) | — | 0.250 |" in md
    assert "| gptoss-tp1 | GptOssForCausalLM | skipped: no extraction |" in md


def test_the_report_joins_calls_and_a_decoded_case_wins_over_a_skipped_one(tmp_path):
    first = {
        "steps": 300,
        "prompts": 32,
        "tokens": 64,
        "cases": {
            "llama-tp1": {"architecture": "LlamaForCausalLM", "status": "ok", "drafted": decoded(1.9)},
            "kimi-tp1": {"architecture": "KimiK25ForConditionalGeneration", "skipped": "skipped: 500s gone of 540s"},
        },
    }
    second = {"steps": 300, "prompts": 32, "tokens": 64, "cases": {
        "kimi-tp1": {"architecture": "KimiK25ForConditionalGeneration", "status": "failed",
                     "why": ["boom"]}}}  # fmt: skip
    paths = []
    for i, rec in enumerate((first, second)):
        paths.append(tmp_path / f"call{i}.json")
        paths[-1].write_text(json.dumps(rec))
    assert familydrafters.report([str(p) for p in paths], tmp_path) == 0
    merged = json.loads((tmp_path / "familydrafters.json").read_text())
    assert merged["cases"]["llama-tp1"]["status"] == "ok" and merged["cases"]["kimi-tp1"]["status"] == "failed"
    assert "| kimi-tp1 | KimiK25ForConditionalGeneration | failed |" in (tmp_path / "familydrafters.md").read_text()


def test_a_parting_beyond_the_tie_is_put_to_the_target_on_its_own_prefix():
    prompts = [[1, 2], [1, 2], [3]]
    reference = [[5, 6, 7], [5, 6, 7], [8, 9]]
    gaps = [[1.0, 0.9, 1.0], [1.0, 0.1, 1.0], [1.0, 1.0]]
    rows = h2hreport.beyond_tie([[5, 4, 7], [5, 4, 7], [8]], reference, gaps, 0.25, prompts)
    # the second parts at a near-tie; the third is a prefix of its reference: a length, not a token, differs
    assert rows == [{"output": 0, "at": 1, "prefix": [1, 2, 5], "token": 4, "reference_token": 6,
                     "reference_gap": 0.9}]  # fmt: skip
    picked = h2hreport.target_choices(rows, [[4]], [[0.8]], 0.25)
    assert (picked["agree"], picked["of"], picked["rows"][0]["target_chose"]) == (1, 1, 4)
    assert h2hreport.target_choices(rows, [[6]], [[0.8]], 0.25)["agree"] == 0
    assert h2hreport.target_choices(rows, [[6]], [[0.1]], 0.25)["agree"] == 1  # the target's own near-tie there


def test_partings_the_target_picks_itself_on_the_prefix_pass():
    rescored = {"agree": 2, "of": 2, "rows": []}
    assert familydrafters.verdict({"errors": 0}, decoded(2.0, same=28, at_tie=2, rescored=rescored)) == ("ok", [])
    one = {"agree": 1, "of": 2, "rows": []}
    status, why = familydrafters.verdict({"errors": 0}, decoded(2.0, same=28, at_tie=2, rescored=one))
    assert status == "failed" and why[0].startswith("1 of 32 greedy outputs differ") and "does not pick" in why[0]
