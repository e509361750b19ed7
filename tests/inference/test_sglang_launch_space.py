"""The dump space the launcher asks for: bytes per token from the model's config, tokens in flight from
SGLang's limits, and the refusal when the dump dir's filesystem is smaller."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from eaglet.services.inference import sglang_launch
from eaglet.services.inference.sglang_launch import (
    DumpSpace,
    DumpSpaceTooSmall,
    LaunchConfig,
    check_dump_space,
    dump_space,
)

GiB = 2**30


def _model(path: Path, config: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture
def llama_8b(tmp_path: Path) -> str:
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "max_position_embeddings": 131072}
    return _model(tmp_path / "llama-8b", {**config, "torch_dtype": "bfloat16"})


@pytest.fixture
def kimi(tmp_path: Path) -> str:
    """A wrapper class: the language model's numbers sit in text_config."""
    text = {"hidden_size": 7168, "num_hidden_layers": 61, "max_position_embeddings": 262144, "dtype": "bfloat16"}
    return _model(tmp_path / "kimi", {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text})


def _fs(size: int):
    """statvfs of a tmpfs of ``size`` bytes."""
    return lambda path: SimpleNamespace(f_blocks=size // 4096, f_frsize=4096, f_bavail=size // 4096)


def test_bytes_per_token_is_four_states_of_hidden_size(llama_8b):
    need = dump_space(LaunchConfig(model_path=llama_8b, dump_dir="d"))
    assert isinstance(need, DumpSpace)
    assert need.bytes_per_token == 4 * 4096 * 2 == 32768
    # unset chunk: 16384, the largest SGLang picks; plus one whole context; two steps; one scheduler
    assert need.step_tokens == 16384 + 131072 and need.tokens == 2 * (16384 + 131072)
    five = dump_space(LaunchConfig(model_path=llama_8b, dump_dir="d", aux_layer_ids=[2, 9, 16, 23, 30]))
    assert isinstance(five, DumpSpace) and five.bytes_per_token == 6 * 4096 * 2  # the final state and five layers
    assert need.bytes == need.tokens * 32768


def test_wrapper_config_and_dp_attention_ranks(kimi):
    cfg = LaunchConfig(
        model_path=kimi,
        dump_dir="d",
        tp_size=8,
        attn_dp_size=8,
        chunked_prefill_size=8192,
        extra_args=["--trust-remote-code", "--ep-size", "8", "--context-length", "8192"],
    )
    need = dump_space(cfg)
    assert isinstance(need, DumpSpace)
    assert need.bytes_per_token == 4 * 7168 * 2 == 57344
    assert need.schedulers == 8 and need.step_tokens == 8192 + 8192
    assert need.bytes == 2 * 16384 * 8 * 57344 == 15_032_385_536  # 14 GiB


def test_replicas_count_like_dp_attention_ranks(llama_8b):
    one = dump_space(LaunchConfig(model_path=llama_8b, dump_dir="d"))
    four = dump_space(LaunchConfig(model_path=llama_8b, dump_dir="d", dp_size=4))
    assert isinstance(one, DumpSpace) and isinstance(four, DumpSpace)
    assert four.bytes == 4 * one.bytes


@pytest.mark.parametrize(
    ("extra", "step_tokens", "bound"),
    [
        (["--max-total-tokens", "10000"], 10000, "KV pool"),
        (["--max-running-requests=2"], 2 * 4096, "2 running requests"),
        (["--max-running-requests", "64", "--max-total-tokens", "1000000"], 8192 + 4096, "prefill step"),
    ],
)
def test_the_smallest_given_bound_wins(llama_8b, extra, step_tokens, bound):
    cfg = LaunchConfig(
        model_path=llama_8b, dump_dir="d", chunked_prefill_size=8192, extra_args=["--context-length", "4096", *extra]
    )
    need = dump_space(cfg)
    assert isinstance(need, DumpSpace)
    assert need.step_tokens == step_tokens and bound in need.bound


def test_chunking_off_uses_the_prefill_budget(llama_8b):
    extra = ["--context-length", "4096", "--max-prefill-tokens", "32768"]
    need = dump_space(LaunchConfig(model_path=llama_8b, dump_dir="d", chunked_prefill_size=-1, extra_args=extra))
    assert isinstance(need, DumpSpace) and need.step_tokens == 32768 + 4096


def test_dtype_flag(llama_8b):
    need = dump_space(LaunchConfig(model_path=llama_8b, dump_dir="d", extra_args=["--dtype", "float32"]))
    assert isinstance(need, DumpSpace) and need.bytes_per_token == 4 * 4096 * 4
    # auto: 16-bit, also for a float32 checkpoint (SGLang runs it in 16 bits)
    cfg = LaunchConfig(model_path=llama_8b, dump_dir="d", extra_args=["--dtype", "auto"])
    assert dump_space(cfg).bytes_per_token == 4 * 4096 * 2  # type: ignore[union-attr]
    assert "unknown size" in dump_space(LaunchConfig(model_path=llama_8b, dump_dir="d", extra_args=["--dtype", "x"]))  # type: ignore[operator]


def test_small_filesystem_refused_with_the_size_to_give(llama_8b, monkeypatch):
    monkeypatch.setenv("EAGLET_DUMP_SIZE", "2g")
    cfg = LaunchConfig(model_path=llama_8b, dump_dir="/dump", extra_args=["--context-length", "32768"])
    need = dump_space(cfg)
    assert isinstance(need, DumpSpace) and need.bytes == 2 * (16384 + 32768) * 32768  # 3 GiB
    with pytest.raises(DumpSpaceTooSmall) as e:
        check_dump_space(cfg, statvfs=_fs(2 * GiB))
    msg = str(e.value)
    assert "2.0 GiB filesystem" in msg and "need 3.0 GiB" in msg
    assert "EAGLET_DUMP_SIZE=3g" in msg and "now 2g" in msg and "--dump-space-check off" in msg
    check_dump_space(cfg, statvfs=_fs(3 * GiB))  # exactly enough


def test_unknown_model_is_not_refused(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        check_dump_space(LaunchConfig(model_path="org/hub-id", dump_dir=str(tmp_path)), statvfs=_fs(1))
    assert "dump space not checked: no config.json" in caplog.text


@pytest.fixture
def launched(monkeypatch):
    ran: dict = {}
    monkeypatch.setattr(sglang_launch, "installed_sglang_version", lambda: "0.5.23")
    monkeypatch.setattr(sglang_launch.os, "execvpe", lambda file, argv, env: ran.update(argv=argv))
    monkeypatch.setattr(sglang_launch.os, "statvfs", _fs(64 * 2**20))  # a 64 MiB tmpfs, docker's /dev/shm
    monkeypatch.delenv("EAGLET_SGLANG_ARGS", raising=False)
    return ran


def test_main_refuses_a_small_dump_dir(llama_8b, tmp_path, launched):
    with pytest.raises(SystemExit, match="EAGLET_DUMP_SIZE=9g"):
        sglang_launch.main(["--model-path", llama_8b, "--dump-dir", str(tmp_path / "dump")])
    assert "argv" not in launched


def test_main_check_off_from_the_extra_args(llama_8b, tmp_path, launched, monkeypatch):
    monkeypatch.setenv("EAGLET_SGLANG_ARGS", "--dump-space-check off --context-length 8192")
    sglang_launch.main(["--model-path", llama_8b, "--dump-dir", str(tmp_path / "dump")])
    argv = launched["argv"]
    assert "--dump-space-check" not in argv and argv[argv.index("--context-length") + 1] == "8192"


def test_main_refuses_two_values_for_one_launcher_flag(llama_8b, tmp_path, launched, monkeypatch):
    monkeypatch.setenv("EAGLET_SGLANG_ARGS", "--tp-size 8 --attn-dp-size 8 --dump-space-check off")
    cli = ["--model-path", llama_8b, "--dump-dir", str(tmp_path), "--tp-size", "1", "--dp-size", "1"]
    with pytest.raises(SystemExit, match="--tp-size 8 in EAGLET_SGLANG_ARGS, 1 on the command line"):
        sglang_launch.main(cli)
    cli[cli.index("--tp-size") + 1] = "8"  # the same value twice is fine
    sglang_launch.main(cli)
    argv = launched["argv"]
    assert argv[argv.index("--tp-size") + 1] == "8" and argv[argv.index("--attn-dp-size") + 1] == "8"


def test_real_folder_statvfs(llama_8b, tmp_path):
    """No fake: the check reads the folder's own filesystem (tmp_path holds far more than 2 tokens)."""
    cfg = LaunchConfig(model_path=llama_8b, dump_dir=str(tmp_path), extra_args=["--max-total-tokens", "1"])
    assert os.statvfs(tmp_path).f_blocks > 0
    check_dump_space(cfg)
