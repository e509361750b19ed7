"""The SGLang server command eaglet runs: ``python -m sglang.launch_server`` with the dump plugin's needs.

- Radix cache off: a cached prefix makes the prefill cover only the uncached suffix (1-2-token dumps).
- EAGLE-3 capture on, and every forward in full hidden-state mode so the prefill CUDA graph keeps
  running with it:
  * 0.5.23+: ``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3`` (capture only, no
    draft). The forward then hands back the aux states and, beside them, the final-norm states.
  * before (0.5.17): ``--enable-return-hidden-states``; the plugin takes the final-norm states from the
    logits processor's input. The launch adds ``--cuda-graph-backend-prefill disabled`` unless another
    prefill graph backend is named: 0.5.17 picks the ``tc_piecewise`` prefill graph on its own for some
    models (Kimi-K2.5 without DP attention), and that graph captures the logits processor, so the plugin
    would see no final states. ``breakable`` (the dense models' default) may be named; ``tc_piecewise``
    is refused.
  Requests never ask for ``return_hidden_states``: the states go to the dump dir, not into JSON.
- Refused (``REFUSED_FLAGS``, ``REFUSED_BEFORE_CAPTURE_FLAG``): modes where one forward does not see the
  whole prompt's aux states, or sees none: pipeline parallelism, PD disaggregation, split prefill
  (pdmux), HiCache, two-batch overlap (DeepSeek/Kimi run their MoE layers through a path that captures
  nothing), and on 0.5.17 context parallel (it gathers only the final states back).
- Owned (``OWNED_FLAGS``): the capture flags are eaglet's; given again they are refused, and a repeated
  ``--disable-radix-cache`` is dropped with a log line. Every other ``launch_server`` flag passes through
  as given (``--trust-remote-code``, EP/DeepEP, quantization, model-specific flags, ...), also from
  ``EAGLET_SGLANG_ARGS`` (shell-split, before the command line's own flags).
- DP attention: ``--attn-dp-size N`` here (or SGLang 0.5.17's ``--dp-size N --enable-dp-attention``);
  emitted as the installed version spells it: ``--dp-size N --enable-dp-attention`` on 0.5.17,
  ``--attn-dp-size N`` on 0.5.23 (where the old spelling is deprecated).

Layer ids. ``aux_layer_ids`` are the ids the dumps record (eaglet/shared/layers.py): id i means the
residual stream entering layer i (the output of layer i-1). Three ids, increasing, from 1 to L-1. The
default (the plugin's): [2, L//2, L-3] for L >= 7, [L-3, L-2, L-1] below (SGLang's own rule repeats
layers there: [2, 2, 1] for L=4). vLLM reads the same ids; SGLang adds one to each id it reads. Model
families read the ids handed to ``set_eagle3_layers_to_capture`` differently (most add one, DeepSeek only
when the first id is 1, GPT-OSS not when the last is L), so the plugin, not this launcher, hands them over
in each family's form and refuses to start when the model would capture other layers.

Environment of the server process (``server_env``): ``EAGLET_DUMP_DIR`` (where ``<rid>.safetensors``
appear), ``EAGLET_AUX_LAYER_IDS`` (the ids; unset: the default), ``SGLANG_PLUGINS=eaglet_dump`` (load only
eaglet's plugin).
"""

import argparse
import logging
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.shared.layers import layer_ids_problem
from eaglet.shared.target import text_config

log = logging.getLogger(__name__)

SUPPORTED = ("0.5.23", "0.5.17")  # the plugin's eaglet_sglang.versions.SUPPORTED; a test keeps them equal
CAPTURE_FLAG_SINCE = (0, 5, 23)
PLUGIN_NAME = "eaglet_dump"
EXTRA_ARGS_ENV = "EAGLET_SGLANG_ARGS"

# Flags that break "one request's prompt, whole, in the forwards the plugin sees" (a size flag only above 1).
REFUSED_FLAGS = {
    "--pp-size": "the aux layers live on other pipeline ranks than the final states",
    "--pipeline-parallel-size": "the aux layers live on other pipeline ranks than the final states",
    "--disaggregation-mode": "the prefill runs on another server",
    "--enable-pdmux": "split prefill produces no aux states",
    "--enable-hierarchical-cache": "HiCache restores prefixes without a forward",
    "--speculative-draft-model-path": "extraction runs the target alone",
    "--enable-two-batch-overlap": (
        "DeepSeek/Kimi run the layers after the dense ones through the two-batch path, which captures no aux states"
    ),
}
_CP = "context parallel gathers only the final states back in this version, not the aux states"
_TC = "the tc_piecewise prefill graph captures the logits processor, where the plugin takes the final states"
REFUSED_BEFORE_CAPTURE_FLAG = {
    "--attn-cp-size": _CP,
    "--attention-context-parallel-size": _CP,
    "--enable-prefill-cp": _CP,
    "--enable-prefill-context-parallel": _CP,
    "--enable-dsa-prefill-context-parallel": _CP,
    "--enable-nsa-prefill-context-parallel": _CP,
    "--enforce-piecewise-cuda-graph": _TC,
}
SIZE_FLAGS = {"--pp-size", "--pipeline-parallel-size", "--attn-cp-size", "--attention-context-parallel-size"}
PREFILL_GRAPH_FLAGS = {
    "--cuda-graph-backend-prefill",
    "--enable-breakable-cuda-graph",
    "--disable-piecewise-cuda-graph",
}
# Set by this launcher: from LaunchConfig's fields, or the capture mode.
OWNED_FLAGS = {
    "--model-path": "model_path",
    "--model": "model_path",
    "--served-model-name": "served_model_name",
    "--host": "host",
    "--port": "port",
    "--tp-size": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--dp-size": "dp_size",
    "--data-parallel-size": "dp_size",
    "--attn-dp-size": "attn_dp_size",
    "--attention-data-parallel-size": "attn_dp_size",
    "--enable-dp-attention": "attn_dp_size",
    "--chunked-prefill-size": "chunked_prefill_size",
    "--mem-fraction-static": "mem_fraction_static",
    "--enable-return-hidden-states": "the capture mode",
    "--enable-return-aux-hidden-states": "the capture mode",
    "--return-aux-hidden-state-layer-ids": "aux_layer_ids",
    "--speculative-algorithm": "the capture mode",
}


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    model_path: str
    """Hugging Face model directory (or hub id) the server loads."""
    dump_dir: str
    """Where the dumps appear; shared memory on the host, mounted in the workers too."""
    sglang_version: str = SUPPORTED[0]
    """The installed SGLang version; picks the capture flags and the DP-attention spelling."""
    served_model_name: str | None = None
    """Recorded in every dump's metadata as ``model``; default: the model path."""
    host: str = "0.0.0.0"
    port: int = 30000
    tp_size: int = 1
    dp_size: int = 1
    """Data-parallel replicas (each a whole model)."""
    attn_dp_size: int = 1
    """DP attention: attention data-parallel groups inside the TP group (1: off)."""
    aux_layer_ids: list[int] | None = None
    """SGLang's convention (see the module doc); None: the plugin's default."""
    chunked_prefill_size: int | None = None
    mem_fraction_static: float | None = None
    extra_args: list[str] = field(default_factory=list)
    """More ``launch_server`` flags, passed as given (refused: see the module doc)."""

    def __post_init__(self) -> None:
        if self.sglang_version not in SUPPORTED:
            raise ValueError(
                f"sglang_version {self.sglang_version!r} is not supported: use one of {', '.join(SUPPORTED)} "
                "(the plugin's contract test covers only those)"
            )
        if min(self.tp_size, self.dp_size, self.attn_dp_size) < 1:
            raise ValueError(f"tp_size {self.tp_size} / dp_size {self.dp_size} / attn_dp_size: give sizes >= 1")
        if self.attn_dp_size > 1 and self.dp_size > 1:
            raise ValueError(
                f"dp_size {self.dp_size} with attn_dp_size {self.attn_dp_size}: SGLang runs DP attention or "
                "data-parallel replicas, not both"
            )
        if self.aux_layer_ids is not None:
            problem = layer_ids_problem(self.aux_layer_ids, model_num_layers(self.model_path))
            if problem:
                raise ValueError(f"aux_layer_ids {self.aux_layer_ids}: {problem}")
        capture_flag = version_tuple(self.sglang_version) >= CAPTURE_FLAG_SINCE
        for name, value in flag_values(self.extra_args):
            if name in SIZE_FLAGS and value is not None and value.isdigit() and int(value) <= 1:
                continue
            if name in OWNED_FLAGS:
                raise ValueError(f"extra_args: {name} is set by eaglet: give {OWNED_FLAGS[name]} instead")
            reason = REFUSED_FLAGS.get(name) or (None if capture_flag else REFUSED_BEFORE_CAPTURE_FLAG.get(name))
            if not capture_flag and name in ("--cuda-graph-backend-prefill", "--cuda-graph-config"):
                reason = _TC if "tc_piecewise" in (value or "") else None
            if name == "--disaggregation-mode" and value == "null":
                reason = None
            if reason:
                raise ValueError(f"extra_args: {name} is refused on SGLang {self.sglang_version}: {reason}")


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:3])


def flag_values(args: list[str]) -> list[tuple[str, str | None]]:
    """``--flag`` / ``--flag=value`` / ``--flag value`` -> (flag, value or None), in order."""
    out: list[tuple[str, str | None]] = []
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        if not eq:
            following = args[i + 1] if i + 1 < len(args) else None
            value = following if following is not None and not following.startswith("--") else None
        out.append((name, value))
    return out


def model_num_layers(model_path: str) -> int | None:
    """The text model's layer count from a local ``config.json`` (None for a hub id: the plugin checks)."""
    if not (Path(model_path) / "config.json").is_file():
        return None
    layers = text_config(Path(model_path)).get("num_hidden_layers")
    return int(layers) if layers is not None else None


def server_argv(cfg: LaunchConfig) -> list[str]:
    """``python -m sglang.launch_server ...`` for ``cfg``, as an argv list."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path]
    argv += ["--host", cfg.host, "--port", str(cfg.port), "--tp-size", str(cfg.tp_size)]
    argv += ["--served-model-name", cfg.served_model_name or cfg.model_path]
    argv += ["--disable-radix-cache"]
    named = {name for name, _ in flag_values(cfg.extra_args)}
    capture_flag = version_tuple(cfg.sglang_version) >= CAPTURE_FLAG_SINCE
    if capture_flag:
        # no layer ids here: the plugin sets them in the model family's own form
        argv += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
    else:
        argv += ["--enable-return-hidden-states"]
        if not named & PREFILL_GRAPH_FLAGS:
            argv += ["--cuda-graph-backend-prefill", "disabled"]
    if cfg.dp_size > 1:
        argv += ["--dp-size", str(cfg.dp_size)]
    if cfg.attn_dp_size > 1:
        if capture_flag:
            argv += ["--attn-dp-size", str(cfg.attn_dp_size)]
        else:
            argv += ["--dp-size", str(cfg.attn_dp_size), "--enable-dp-attention"]
    if cfg.chunked_prefill_size is not None:
        argv += ["--chunked-prefill-size", str(cfg.chunked_prefill_size)]
    if cfg.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    extra = [a for a in cfg.extra_args if a != "--disable-radix-cache"]
    if len(extra) != len(cfg.extra_args):
        log.info("--disable-radix-cache given again: eaglet sets it already")
    return argv + extra


def server_env(cfg: LaunchConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default: this process's) plus what the plugin reads."""
    env = dict(os.environ if base is None else base)
    env["EAGLET_DUMP_DIR"] = cfg.dump_dir
    env["SGLANG_PLUGINS"] = PLUGIN_NAME
    if cfg.aux_layer_ids is not None:
        env["EAGLET_AUX_LAYER_IDS"] = ",".join(map(str, cfg.aux_layer_ids))
    else:
        env.pop("EAGLET_AUX_LAYER_IDS", None)
    return env


def installed_sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def main(argv: list[str] | None = None) -> None:
    """Execs the SGLang server (the image's entry point). ``EAGLET_SGLANG_ARGS`` (shell-split) come
    first, then the command line; unknown flags go to ``launch_server``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0], allow_abbrev=False)
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--dump-dir", default=os.environ.get("EAGLET_DUMP_DIR", "/dev/shm/eaglet-dumps"))
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", type=int, default=1)
    p.add_argument("--attn-dp-size", "--attention-data-parallel-size", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true", help="0.5.17's spelling: --dp-size is the DP width")
    p.add_argument("--aux-layer-ids", type=int, nargs="+", help="three ids, 1 to L-1: the inputs of those layers")
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--mem-fraction-static", type=float)
    env_args = shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
    args, extra = p.parse_known_args(env_args + (sys.argv[1:] if argv is None else argv))
    attn_dp_size, dp_size = args.attn_dp_size, args.dp_size
    if args.enable_dp_attention:  # --dp-size N --enable-dp-attention: N attention DP groups, one replica
        attn_dp_size, dp_size = max(attn_dp_size, dp_size), 1
    cfg = LaunchConfig(
        model_path=args.model_path,
        dump_dir=args.dump_dir,
        sglang_version=installed_sglang_version(),
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        tp_size=args.tp_size,
        dp_size=dp_size,
        attn_dp_size=attn_dp_size,
        aux_layer_ids=args.aux_layer_ids,
        chunked_prefill_size=args.chunked_prefill_size,
        mem_fraction_static=args.mem_fraction_static,
        extra_args=extra,
    )
    os.makedirs(cfg.dump_dir, exist_ok=True)
    cmd = server_argv(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("starting SGLang %s: %s", cfg.sglang_version, " ".join(cmd))
    os.execvpe(cmd[0], cmd, server_env(cfg))


if __name__ == "__main__":
    main()
