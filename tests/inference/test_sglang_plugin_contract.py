"""Contract with SGLang: every name, signature and field the dump plugin relies on, read from the
released wheel of each supported version (``.venv-sglang/wheels``, fetched by ``make install``).

Nothing is imported from the wheels: their source is parsed. When SGLang moves one of these, this
fails naming it, before a server silently writes no dumps.
"""

import ast
import importlib.util
import re
import tomllib
import zipfile
from functools import cache
from pathlib import Path

import pytest

from eaglet.services.inference import sglang_launch

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".venv-sglang" / "wheels"
PLUGIN_DIR = ROOT / "services" / "inference" / "sglang_plugin" / "eaglet_sglang"


def _load_versions():
    # versions.py is plain Python; load it by path (the plugin package itself needs torch and SGLang).
    spec = importlib.util.spec_from_file_location("eaglet_sglang_versions", PLUGIN_DIR / "versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


versions = _load_versions()


class Wheel:
    def __init__(self, version: str):
        found = sorted(WHEELS.glob(f"sglang-{version}-*.whl"))
        if not found:
            pytest.fail(f"no sglang {version} wheel in {WHEELS.relative_to(ROOT)}: run `make install`")
        self.version = version
        self.zip = zipfile.ZipFile(found[0])

    @cache  # noqa: B019 (a handful of wheels per session)
    def source(self, path: str) -> str:
        return self.zip.read(f"sglang/srt/{path}").decode()

    def tree(self, path: str) -> ast.Module:
        return ast.parse(self.source(path))

    def cls(self, path: str, name: str) -> ast.ClassDef:
        for node in ast.walk(self.tree(path)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        pytest.fail(f"sglang {self.version}: class {name} not in srt/{path}")

    def method(self, path: str, cls: str, name: str) -> ast.FunctionDef:
        for node in self.cls(path, cls).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        pytest.fail(f"sglang {self.version}: {cls}.{name} not in srt/{path}")

    def function(self, path: str, name: str) -> ast.FunctionDef:
        for node in self.tree(path).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        pytest.fail(f"sglang {self.version}: function {name} not in srt/{path}")

    def fields(self, path: str, cls: str) -> set[str]:
        return {
            n.target.id
            for n in self.cls(path, cls).body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }

    def attrs_set_in(self, path: str, cls: str, method: str) -> set[str]:
        return {
            n.attr
            for n in ast.walk(self.method(path, cls, method))
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", "") == "self"
        }

    def server_flags(self) -> set[str]:
        """Every ``--flag`` of ``launch_server``: the ServerArgs fields, wherever this version keeps them."""
        names = set()
        for info in self.zip.infolist():
            p = info.filename
            if p == "sglang/srt/server_args.py" or p.startswith("sglang/srt/arg_groups/"):
                if p.endswith(".py"):
                    names |= set(re.findall(r"^    ([a-z][a-z0-9_]*): ", self.zip.read(p).decode(), re.M))
        return {"--" + n.replace("_", "-") for n in names}


def params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args]


@pytest.fixture(params=versions.SUPPORTED, scope="module")
def sglang_wheel(request) -> Wheel:
    return Wheel(request.param)


def _target(target: str) -> tuple[str, str, str]:
    """``sglang.srt.a.b.Cls.method`` -> (``a/b.py``, ``Cls``, ``method``)."""
    parts = target.split(".")
    return "/".join(parts[2:-2]) + ".py", parts[-2], parts[-1]


def test_plugin_entry_point_group_and_loading(sglang_wheel):
    src = sglang_wheel.source("plugins/__init__.py")
    assert 'GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"' in src
    body = ast.unparse(sglang_wheel.function("plugins/__init__.py", "load_plugins"))
    assert "HookRegistry.apply_hooks()" in body
    # every scheduler process loads the plugins first thing
    assert "load_plugins()" in ast.unparse(sglang_wheel.function("managers/scheduler.py", "run_scheduler_process"))


def test_hook_registry_around_contract(sglang_wheel):
    # the plugin calls register(target, fn, HookType.AROUND) positionally
    register = sglang_wheel.method("plugins/hook_registry.py", "HookRegistry", "register")
    assert params(register)[:4] == ["cls", "target", "hook", "hook_type"]
    assert 'AROUND = "around"' in ast.unparse(sglang_wheel.cls("plugins/hook_registry.py", "HookType")).replace(
        "'", '"'
    )
    wrap = ast.unparse(sglang_wheel.function("plugins/hook_registry.py", "_wrap_fn"))
    assert "hook(original_fn, *args, **kwargs)" in wrap, "AROUND no longer passes (original_fn, *args, **kwargs)"


def test_hooked_methods_and_signatures(sglang_wheel):
    path, cls, name = _target(versions.FORWARD)
    assert params(sglang_wheel.method(path, cls, name))[:2] == ["self", "batch"]
    assert "logits_output" in ast.unparse(sglang_wheel.method(path, cls, name))

    path, cls, name = _target(versions.INIT_ATTENTION)
    assert params(sglang_wheel.method(path, cls, name)) == ["self"]
    # capture is configured there, before any CUDA graph is captured
    assert "configure_aux_hidden_state_capture" in ast.unparse(sglang_wheel.method(path, cls, name))

    path, cls, name = _target(versions.LOGITS_FORWARD)
    assert params(sglang_wheel.method(path, cls, name))[:6] == [
        "self",
        "input_ids",
        "hidden_states",
        "lm_head",
        "logits_metadata",
        "aux_hidden_states",
    ]


def test_batch_and_request_fields(sglang_wheel):
    fields = sglang_wheel.fields("managers/schedule_batch.py", "ScheduleBatch")
    assert {"reqs", "forward_mode", "prefix_lens", "extend_lens", "decoding_reqs"} <= fields
    req_attrs = sglang_wheel.attrs_set_in("managers/schedule_batch.py", "Req", "__init__")
    assert {"rid", "origin_input_ids", "output_ids"} <= req_attrs
    mode = sglang_wheel.cls("model_executor/forward_batch_info.py", "ForwardMode")
    assert "is_decode_or_idle" in {n.name for n in mode.body if isinstance(n, ast.FunctionDef)}
    out_fields = sglang_wheel.fields("layers/logits_processor.py", "LogitsProcessorOutput")
    assert "hidden_states" in out_fields
    assert "logits_output" in sglang_wheel.fields("managers/utils.py", "GenerationBatchResult")
    runner = sglang_wheel.source("model_executor/model_runner.py")
    assert "self.is_draft_worker = " in runner and "self.model = " in runner


def test_writer_rank_functions(sglang_wheel):
    for name in ("get_attn_tensor_model_parallel_rank", "get_attn_context_model_parallel_rank"):
        sglang_wheel.function("distributed/parallel_state.py", name)


def test_eagle3_capture_convention(sglang_wheel):
    """The +1 and the default layers that the dumps' ``aux_layer_ids`` and the launch flags assume."""
    body = ast.unparse(sglang_wheel.method("models/llama.py", "LlamaForCausalLM", "set_eagle3_layers_to_capture"))
    assert "self.model.layers_to_capture = [2, num_layers // 2, num_layers - 3]" in body
    assert "self.model.layers_to_capture = [val + 1 for val in layer_ids]" in body
    assert "self.capture_aux_hidden_states = True" in body


def test_final_norm_states_reach_the_plugin(sglang_wheel):
    if versions.has_capture_flag(sglang_wheel.version):
        # capture-only mode hands the final-norm states back beside the aux states, also through the
        # prefill CUDA graph's trimmed output
        assert "last_hidden_states" in sglang_wheel.fields("layers/logits_processor.py", "LogitsProcessorOutput")
        assert "last_hidden_states=" in sglang_wheel.source("model_executor/runner/prefill_cuda_graph_runner.py")
        sglang_wheel.function("arg_groups/validation_hook.py", "handle_aux_hidden_state_capture")
    else:
        # the plugin reads them from the logits processor's input; the prefill graph runs the
        # logits processor eagerly (it captures only the transformer body)
        src = sglang_wheel.source("model_executor/runner/prefill_cuda_graph_runner.py")
        assert "not the LM head + logits_processor" in src


@pytest.mark.parametrize("attn_dp_size", [1, 8])
def test_launch_flags_exist(sglang_wheel, attn_dp_size):
    cfg = sglang_launch.LaunchConfig(
        model_path="m",
        dump_dir="d",
        sglang_version=sglang_wheel.version,
        dp_size=2 if attn_dp_size == 1 else 1,
        attn_dp_size=attn_dp_size,
        aux_layer_ids=[2, 16, 29],
        chunked_prefill_size=8192,
        mem_fraction_static=0.8,
    )
    flags = {a for a in sglang_launch.server_argv(cfg) if a.startswith("--")}
    missing = flags - sglang_wheel.server_flags()
    assert not missing, f"sglang {sglang_wheel.version} has no {sorted(missing)}"


def test_refused_flags_name_this_version_s_flags(sglang_wheel):
    src = "".join(  # aliases are spelled out where each version declares its flags
        sglang_wheel.zip.read(i.filename).decode()
        for i in sglang_wheel.zip.infolist()
        if i.filename == "sglang/srt/server_args.py" or i.filename.startswith("sglang/srt/arg_groups/")
    )
    named = set(sglang_launch.REFUSED_FLAGS) | set(sglang_launch.OWNED_FLAGS)
    if not versions.has_capture_flag(sglang_wheel.version):
        named |= set(sglang_launch.REFUSED_BEFORE_CAPTURE_FLAG) | sglang_launch.PREFILL_GRAPH_FLAGS
        named -= {"--enable-return-aux-hidden-states", "--return-aux-hidden-state-layer-ids"}
        named -= {"--attn-dp-size", "--attention-data-parallel-size"}
    missing = {f for f in named - sglang_wheel.server_flags() if f'"{f}"' not in src}
    assert not missing, f"sglang {sglang_wheel.version} has no {sorted(missing)}"


def test_modes_the_launcher_refuses(sglang_wheel):
    """Two-batch overlap runs DeepSeek's later layers without capture; 0.5.17's CP gathers only the final states."""
    body = ast.unparse(sglang_wheel.method("models/deepseek_v2.py", "DeepseekV2Model", "forward"))
    assert "can_run_tbo" in body and "captured_last_layer_outputs" in body
    if not versions.has_capture_flag(sglang_wheel.version):
        assert "cp_all_gather_rerange_output(hidden_states" in body
        assert f'TC_PIECEWISE = "{versions.TC_PIECEWISE}"' in sglang_wheel.source("model_executor/cuda_graph_config.py")


def test_family_conventions_the_plugin_translates(sglang_wheel):
    def body(path: str, cls: str) -> str:
        return ast.unparse(sglang_wheel.method(path, cls, "set_eagle3_layers_to_capture"))

    assert "layer_ids[0] == 1" in body("models/deepseek_v2.py", "DeepseekV2ForCausalLM")
    assert "max(layer_ids) == num_layers" in body("models/gpt_oss.py", "GptOssForCausalLM")
    assert "self.language_model.set_eagle3_layers_to_capture(layer_ids)" in body(
        "models/kimi_k25.py", "KimiK25ForConditionalGeneration"
    )


def test_versions_agree():
    assert versions.SUPPORTED == sglang_launch.SUPPORTED
    assert versions.CAPTURE_FLAG_SINCE == sglang_launch.CAPTURE_FLAG_SINCE
    group = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang-cpu"]
    (pin,) = [p for p in group if p.startswith("sglang==")]
    assert pin.removeprefix("sglang==") == versions.DEFAULT
    docker = (ROOT / "services" / "inference" / "Dockerfile.sglang").read_text()
    assert f"ARG SGLANG_VERSION={versions.DEFAULT}" in docker
