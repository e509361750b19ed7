"""The result files on a real disk: a torn last line (a kill mid-write) is cut off and never glued to the next
answer; the final file is every batch in order, each sorted by prompt, without the prompts given up."""

import json

from eaglet.services.regenerate.results import ResultFile, assemble, read_batch


def entry(index: int, **extra) -> dict:
    return {"index": index, "line": index + 1, "id": f"p{index}", "messages": [{"role": "user", "content": "x"}],
            "tokens_in": 3, "tokens_out": 2, **extra}  # fmt: skip


def test_a_torn_last_line_is_cut_before_the_next_answer(tmp_path):
    path = tmp_path / "0000000.jsonl"
    results = ResultFile(path)
    assert results.open() == {}
    results.append(entry(1))
    results.append(entry(0))
    results.close()
    with open(path, "ab") as f:  # the kill landed in the middle of the third answer
        f.write(json.dumps(entry(2)).encode()[:25])
    again = ResultFile(path)
    assert sorted(again.open()) == [0, 1]
    again.append(entry(2))
    again.close()
    assert [e["index"] for e in read_batch(path)] == [0, 1, 2]
    assert all(line.startswith(b"{") for line in path.read_bytes().splitlines())


def test_assemble_keeps_the_input_order_and_leaves_out_failures(tmp_path):
    first, second = tmp_path / "0.jsonl", tmp_path / "1.jsonl"
    for path, entries in ((first, [entry(2), entry(0), entry(1, error="bad line")]), (second, [entry(4), entry(3)])):
        results = ResultFile(path)
        results.open()
        for e in entries:
            results.append(e)
        results.close()
    out = tmp_path / "regenerated.jsonl"
    assert assemble(iter([first, second]), out) == (4, 1)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["p0", "p2", "p3", "p4"]
    assert not list(tmp_path.glob("*.tmp"))
