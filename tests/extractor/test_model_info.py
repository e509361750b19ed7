"""The inference server's model as the workers report it: from the server's /get_model_info, and what the server
does not say (SGLang names its model by path only) from the newest dump checked."""

import httpx

from eaglet.services.extractor.worker import _model_info, _with_dump


def test_model_info_from_the_reference_server(reference_server):
    with httpx.Client(base_url=reference_server.url, timeout=10) as http:
        info = _model_info(http)
    config = (reference_server.model_dir / "config.json").read_text()
    assert info["model"] == reference_server.model_dir.name
    assert f'"hidden_size": {info["hidden_size"]}' in config and f'"num_hidden_layers": {info["num_layers"]}' in config
    assert len(info["aux_layer_ids"]) == 3 and info["aux_layer_ids"] == sorted(info["aux_layer_ids"])
    # What the server said stands; the dump fills nothing in.
    assert _with_dump(info, (4096, [2, 16, 29])) == info


def test_what_sglang_does_not_say_comes_from_the_newest_dump():
    sglang = {"model": "Llama-3.1-8B-Instruct", "hidden_size": None, "num_layers": None, "aux_layer_ids": None}
    assert _with_dump(sglang, None) == sglang  # no dump checked yet: unknown
    filled = _with_dump(sglang, (4096, [2, 16, 29]))
    assert filled == {**sglang, "hidden_size": 4096, "aux_layer_ids": [2, 16, 29]}


def test_a_server_without_model_info_reports_none(reference_server):
    with httpx.Client(base_url=reference_server.url + "/no-such-prefix", timeout=10) as http:
        assert _model_info(http) == {}
