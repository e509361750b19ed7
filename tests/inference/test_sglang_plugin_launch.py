"""The SGLang launch command: flags per version, the layer-id conventions, refused flags, the env."""

import pytest

from eaglet.services.inference.sglang_launch import LaunchConfig, server_argv, server_env, vllm_layer_ids


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
    # there the plugin enables capture, from the env
    assert (
        server_env(LaunchConfig(model_path="m", dump_dir="d", sglang_version="0.5.17", aux_layer_ids=[2, 16, 29]), {})[
            "EAGLET_AUX_LAYER_IDS"
        ]
        == "2,16,29"
    )


def test_layer_ids_are_passed_in_the_flag_s_convention():
    """Dumps record SGLang's ids (the layer whose input is captured); the flag takes them one lower."""
    assert vllm_layer_ids([2, 16, 29]) == [1, 15, 28]
    argv = server_argv(LaunchConfig(model_path="m", dump_dir="d", aux_layer_ids=[2, 16, 29]))
    i = argv.index("--return-aux-hidden-state-layer-ids")
    assert argv[i + 1 : i + 4] == ["1", "15", "28"]


def test_parallel_and_extra_flags():
    cfg = LaunchConfig(
        model_path="m", dump_dir="d", tp_size=8, dp_size=8, enable_dp_attention=True, extra_args=["--log-level=debug"]
    )
    argv = server_argv(cfg)
    assert argv[argv.index("--tp-size") + 1] == "8" and argv[argv.index("--dp-size") + 1] == "8"
    assert "--enable-dp-attention" in argv and argv[-1] == "--log-level=debug"


@pytest.mark.parametrize("flag", ["--pp-size", "--enable-pdmux", "--disaggregation-mode=prefill"])
def test_flags_that_break_dumps_are_refused(flag):
    with pytest.raises(ValueError, match="refused"):
        LaunchConfig(model_path="m", dump_dir="d", extra_args=[flag, "2"])


def test_bad_config_says_how_to_fix():
    with pytest.raises(ValueError, match="0.5.23, 0.5.17"):
        LaunchConfig(model_path="m", dump_dir="d", sglang_version="0.4.0")
    with pytest.raises(ValueError, match="three layer indices"):
        LaunchConfig(model_path="m", dump_dir="d", aux_layer_ids=[0, 1, 2])


def test_env_names_the_dump_dir_and_loads_only_the_plugin():
    env = server_env(LaunchConfig(model_path="m", dump_dir="/dev/shm/d"), {"EAGLET_AUX_LAYER_IDS": "1,2,3", "X": "1"})
    assert env["EAGLET_DUMP_DIR"] == "/dev/shm/d"
    assert env["SGLANG_PLUGINS"] == "eaglet_dump"
    assert "EAGLET_AUX_LAYER_IDS" not in env and env["X"] == "1"
