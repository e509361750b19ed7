"""The SGLang server command eaglet runs: ``python -m sglang.launch_server`` with the dump plugin's needs.

- Radix cache off: a cached prefix makes the prefill cover only the uncached suffix (1-2-token dumps).
- EAGLE-3 capture on, and every forward in full hidden-state mode so the prefill CUDA graph keeps
  running with it:
  * 0.5.23+: ``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3`` (capture only, no
    draft). The forward then hands back the aux states and, beside them, the final-norm states.
  * before (0.5.17): ``--enable-return-hidden-states``; the plugin turns capture on in the model
    (``set_eagle3_layers_to_capture``) before the CUDA graphs are captured, and takes the final-norm
    states from the logits processor's input.
  Requests never ask for ``return_hidden_states``: the states go to the dump dir, not into JSON.
- Pipeline parallelism, PD disaggregation, split prefill (pdmux) and HiCache are refused:
  with them one forward does not see the whole prompt's states, or sees none.

Layer ids. ``aux_layer_ids`` are in SGLang's convention, the one the dumps record: id i means the
residual stream entering layer i (the output of layer i-1). The default is [2, L//2, L-3]. vLLM and the
draft checkpoint's ``eagle_aux_hidden_state_layer_ids`` name the same layers one lower (i-1): the
default is [1, L//2-1, L-4] there. SGLang's ``--return-aux-hidden-state-layer-ids`` takes the lower
form and adds one; this module converts.

Environment of the server process (``server_env``): ``EAGLET_DUMP_DIR`` (where ``<rid>.safetensors``
appear), ``EAGLET_AUX_LAYER_IDS`` (the same ids, for versions where the plugin enables capture),
``SGLANG_PLUGINS=eaglet_dump`` (load only eaglet's plugin).
"""

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SUPPORTED = ("0.5.23", "0.5.17")  # the plugin's eaglet_sglang.versions.SUPPORTED; a test keeps them equal
CAPTURE_FLAG_SINCE = (0, 5, 23)
PLUGIN_NAME = "eaglet_dump"

# Flags that break "one request's prompt, whole, in the forwards the plugin sees".
REFUSED_FLAGS = {
    "--pp-size": "the aux layers live on other pipeline ranks than the final states",
    "--pipeline-parallel-size": "the aux layers live on other pipeline ranks than the final states",
    "--disaggregation-mode": "the prefill runs on another server",
    "--enable-pdmux": "split prefill produces no aux states",
    "--enable-hierarchical-cache": "HiCache restores prefixes without a forward",
    "--speculative-draft-model-path": "extraction runs the target alone",
}


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    model_path: str
    """Hugging Face model directory (or hub id) the server loads."""
    dump_dir: str
    """Where the dumps appear; shared memory on the host, mounted in the workers too."""
    sglang_version: str = SUPPORTED[0]
    """The installed SGLang version; picks the capture flags."""
    served_model_name: str | None = None
    """Recorded in every dump's metadata as ``model``; default: the model path."""
    host: str = "0.0.0.0"
    port: int = 30000
    tp_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    aux_layer_ids: list[int] | None = None
    """SGLang's convention (see the module doc); None: the model's default [2, L//2, L-3]."""
    chunked_prefill_size: int | None = None
    mem_fraction_static: float | None = None
    extra_args: list[str] = field(default_factory=list)
    """More ``launch_server`` flags, passed as given (the ones in ``REFUSED_FLAGS`` are refused)."""

    def __post_init__(self) -> None:
        if self.sglang_version not in SUPPORTED:
            raise ValueError(
                f"sglang_version {self.sglang_version!r} is not supported: use one of {', '.join(SUPPORTED)} "
                "(the plugin's contract test covers only those)"
            )
        if self.aux_layer_ids is not None and (len(self.aux_layer_ids) != 3 or min(self.aux_layer_ids) < 1):
            raise ValueError(
                f"aux_layer_ids {self.aux_layer_ids}: give three layer indices >= 1 in SGLang's convention "
                "(vLLM's ids plus one)"
            )
        for arg in self.extra_args:
            name = arg.split("=", 1)[0]
            if name in REFUSED_FLAGS:
                raise ValueError(f"extra_args: {name} is refused: {REFUSED_FLAGS[name]}")
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError(f"tp_size {self.tp_size} / dp_size {self.dp_size}: give sizes >= 1")


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:3])


def vllm_layer_ids(sglang_ids: list[int]) -> list[int]:
    """The same layers in vLLM's (and the draft config's) convention: one lower."""
    return [i - 1 for i in sglang_ids]


def server_argv(cfg: LaunchConfig) -> list[str]:
    """``python -m sglang.launch_server ...`` for ``cfg``, as an argv list."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path]
    argv += ["--host", cfg.host, "--port", str(cfg.port), "--tp-size", str(cfg.tp_size)]
    argv += ["--served-model-name", cfg.served_model_name or cfg.model_path]
    argv += ["--disable-radix-cache"]
    if version_tuple(cfg.sglang_version) >= CAPTURE_FLAG_SINCE:
        argv += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
        if cfg.aux_layer_ids is not None:
            argv += ["--return-aux-hidden-state-layer-ids", *map(str, vllm_layer_ids(cfg.aux_layer_ids))]
    else:
        argv += ["--enable-return-hidden-states"]
    if cfg.dp_size > 1:
        argv += ["--dp-size", str(cfg.dp_size)]
    if cfg.enable_dp_attention:
        argv += ["--enable-dp-attention"]
    if cfg.chunked_prefill_size is not None:
        argv += ["--chunked-prefill-size", str(cfg.chunked_prefill_size)]
    if cfg.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    return argv + list(cfg.extra_args)


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
    """Execs the SGLang server (the image's entry point). Unknown flags go to ``launch_server``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--dump-dir", default=os.environ.get("EAGLET_DUMP_DIR", "/dev/shm/eaglet-dumps"))
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--aux-layer-ids", type=int, nargs=3, help="SGLang's convention (vLLM's ids + 1)")
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--mem-fraction-static", type=float)
    args, extra = p.parse_known_args(argv)
    cfg = LaunchConfig(
        model_path=args.model_path,
        dump_dir=args.dump_dir,
        sglang_version=installed_sglang_version(),
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        enable_dp_attention=args.enable_dp_attention,
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
