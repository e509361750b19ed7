"""The SGLang launch command: flags per version, the layer-id conventions, refused flags, the env."""

import json
import sys

import pytest

from eaglet.services.inference import sglang_launch
from eaglet.services.inference.sglang_launch import LaunchConfig, server_argv, server_env
from eaglet.shared.layers import sglang_arg_ids


def _flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def test_0_5_23_uses_capture_only_mode():
    argv = server_argv(LaunchConfig(model_path="/models/llama", dump_dir="/dev/shm/d", sglang_version="0.5.23"))
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert "--disable-radix-cache" in argv
    i = argv.index("--speculative-algorithm")
    assert argv[i + 1] == "EAGLE3" and "--enable-return-aux-hidden-states" in argv
    assert "--enable-return-hidden-states" not in argv
    assert "--return-aux-hidden-state-layer-ids" not in argv  # the model's default [2, L//2, L-3]
    assert argv[argv.index("--served-model-name") + 1] == "/models/llama"


def test_0_5_17_uses_full_hidden_state_mode():
    argv = server_argv(LaunchConfig(model_path="m", dump_dir="d", sglang_version="0.5.17", aux_layer_ids=[2, 16, 29]))
    assert "--enable-return-hidden-states" in argv and "--disable-radix-cache" in argv
    assert "--enable-return-aux-hidden-states" not in argv and "--speculative-algorithm" not in argv
    # the plugin enables capture, from the env
    assert (
        server_env(LaunchConfig(model_path="m", dump_dir="d", sglang_version="0.5.17", aux_layer_ids=[2, 16, 29]), {})[
            "EAGLET_AUX_LAYER_IDS"
        ]
        == "2,16,29"
    )


def test_0_5_17_prefill_graph_kept_off_the_logits_processor():
    argv = server_argv(LaunchConfig(model_path="m", dump_dir="d", sglang_version="0.5.17"))
    assert argv[argv.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    chosen = ["--cuda-graph-backend-prefill", "breakable"]
    argv = server_argv(LaunchConfig(model_path="m", dump_dir="d", sglang_version="0.5.17", extra_args=chosen))
    assert argv.count("--cuda-graph-backend-prefill") == 1 and argv[-2:] == chosen
    for extra in (["--cuda-graph-backend-prefill=tc_piecewise"], ["--enforce-piecewise-cuda-graph"]):
        with pytest.raises(ValueError, match="tc_piecewise prefill graph captures the logits processor"):
            LaunchConfig(model_path="m", dump_dir="d", sglang_version="0.5.17", extra_args=extra)
    # 0.5.23 hands the final states back itself: nothing forced
    assert "--cuda-graph-backend-prefill" not in server_argv(LaunchConfig(model_path="m", dump_dir="d"))


def test_layer_ids_are_left_to_the_plugin():
    """Families read the flag's ids differently: the plugin hands them over, the launcher only checks them."""
    assert sglang_arg_ids([2, 16, 29]) == [1, 15, 28]
    cfg = LaunchConfig(model_path="m", dump_dir="d", aux_layer_ids=[2, 16, 29])
    assert "--return-aux-hidden-state-layer-ids" not in server_argv(cfg)
    assert server_env(cfg, {})["EAGLET_AUX_LAYER_IDS"] == "2,16,29"


@pytest.mark.parametrize(
    ("ids", "reason"),
    [
        ([2, 2, 1], "distinct layer ids in increasing order"),
        ([3, 2, 5], "distinct layer ids in increasing order"),
        ([0, 1, 2], "start at 1"),
        ([], "at least one layer id"),
        ([2, 4, 8], "the model has 8 layers: give ids from 1 to 7"),
    ],
)
def test_bad_layer_ids_refused(tmp_path, ids, reason):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 8}}))
    with pytest.raises(ValueError, match=reason):
        LaunchConfig(model_path=str(tmp_path), dump_dir="d", aux_layer_ids=ids)
    LaunchConfig(model_path=str(tmp_path), dump_dir="d", aux_layer_ids=[1, 4, 7])
    LaunchConfig(model_path=str(tmp_path), dump_dir="d", aux_layer_ids=[1, 2, 4, 6, 7])  # any number: DFlash's five


@pytest.mark.parametrize(
    ("version", "flags"), [("0.5.17", ["--dp-size", "8", "--enable-dp-attention"]), ("0.5.23", ["--attn-dp-size", "8"])]
)
def test_dp_attention_spelled_per_version(version, flags):
    argv = server_argv(LaunchConfig(model_path="m", dump_dir="d", sglang_version=version, tp_size=8, attn_dp_size=8))
    i = argv.index(flags[0])
    assert argv[i : i + len(flags)] == flags
    assert ("--enable-dp-attention" in argv) == (version == "0.5.17")
    with pytest.raises(ValueError, match="not both"):
        LaunchConfig(model_path="m", dump_dir="d", sglang_version=version, dp_size=2, attn_dp_size=4)


def test_parallel_and_extra_flags_pass_through():
    extra = ["--trust-remote-code", "--ep-size", "8", "--moe-a2a-backend", "deepep", "--quantization=fp8"]
    extra += ["--log-level=debug", "--attn-cp-size", "1"]
    cfg = LaunchConfig(model_path="m", dump_dir="d", tp_size=8, dp_size=2, extra_args=extra)
    argv = server_argv(cfg)
    assert argv[argv.index("--tp-size") + 1] == "8" and argv[argv.index("--dp-size") + 1] == "2"
    assert argv[-len(extra) :] == extra


def test_repeated_radix_flag_dropped_owned_flags_refused(caplog):
    with caplog.at_level("INFO"):
        argv = server_argv(LaunchConfig(model_path="m", dump_dir="d", extra_args=["--disable-radix-cache"]))
    assert argv.count("--disable-radix-cache") == 1 and "given again" in caplog.text
    for flag in (
        "--speculative-algorithm",
        "--return-aux-hidden-state-layer-ids",
        "--enable-dp-attention",
        "--tp-size",
    ):
        with pytest.raises(ValueError, match="set by eaglet"):
            LaunchConfig(model_path="m", dump_dir="d", extra_args=[flag, "1"])


@pytest.mark.parametrize(
    ("flag", "reason"),
    [
        (["--pp-size", "2"], "pipeline ranks"),
        (["--enable-pdmux"], "split prefill"),
        (["--disaggregation-mode=prefill"], "another server"),
        (["--enable-two-batch-overlap"], "captures no aux states"),
        (["--speculative-draft-model-path", "x"], "target alone"),
    ],
)
@pytest.mark.parametrize("version", ["0.5.23", "0.5.17"])
def test_flags_that_break_dumps_are_refused(flag, reason, version):
    with pytest.raises(ValueError, match=f"refused on SGLang {version}: .*{reason}"):
        LaunchConfig(model_path="m", dump_dir="d", sglang_version=version, extra_args=flag)


@pytest.mark.parametrize(
    "flag", [["--attn-cp-size", "2"], ["--enable-prefill-cp"], ["--enable-nsa-prefill-context-parallel"]]
)
def test_context_parallel_refused_where_aux_is_not_gathered(flag):
    with pytest.raises(ValueError, match="gathers only the final states"):
        LaunchConfig(model_path="m", dump_dir="d", sglang_version="0.5.17", extra_args=flag)
    LaunchConfig(model_path="m", dump_dir="d", sglang_version="0.5.23", extra_args=flag)


def test_main_takes_extra_args_from_env(monkeypatch, tmp_path):
    ran = {}
    monkeypatch.setattr(sglang_launch, "installed_sglang_version", lambda: "0.5.17")
    monkeypatch.setattr(sglang_launch.os, "execvpe", lambda file, argv, env: ran.update(argv=argv, env=env))
    monkeypatch.setenv(
        "EAGLET_SGLANG_ARGS", "--trust-remote-code --dp-size 4 --enable-dp-attention --kv-cache-dtype fp8_e5m2"
    )
    sglang_launch.main(["--model-path", "m", "--dump-dir", str(tmp_path), "--tensor-parallel-size", "4", "--ep", "4"])
    argv = ran["argv"]
    assert argv[0] == sys.executable and argv[argv.index("--tp-size") + 1] == "4"
    i = argv.index("--enable-dp-attention")
    assert argv[i - 2 : i] == ["--dp-size", "4"] and argv.count("--dp-size") == 1
    assert argv[-5:] == ["--trust-remote-code", "--kv-cache-dtype", "fp8_e5m2", "--ep", "4"]
    assert ran["env"]["SGLANG_PLUGINS"] == "eaglet_dump"


def test_bad_config_says_how_to_fix():
    with pytest.raises(ValueError, match="0.5.23, 0.5.17"):
        LaunchConfig(model_path="m", dump_dir="d", sglang_version="0.4.0")
    with pytest.raises(ValueError, match="start at 1"):
        LaunchConfig(model_path="m", dump_dir="d", aux_layer_ids=[0, 1, 2])


def test_env_names_the_dump_dir_and_loads_only_the_plugin():
    env = server_env(LaunchConfig(model_path="m", dump_dir="/dev/shm/d"), {"EAGLET_AUX_LAYER_IDS": "1,2,3", "X": "1"})
    assert env["EAGLET_DUMP_DIR"] == "/dev/shm/d"
    assert env["SGLANG_PLUGINS"] == "eaglet_dump"
    assert "EAGLET_AUX_LAYER_IDS" not in env and env["X"] == "1"
