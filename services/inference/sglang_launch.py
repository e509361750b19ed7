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

Layer ids. ``aux_layer_ids`` are the ids the dumps record (shared/layers.py): id i means the
residual stream entering layer i (the output of layer i-1). Any number of ids, increasing, from 1 to L-1:
EAGLE-3 reads three, DFlash one per draft layer, and a server capturing both sets serves runs of either. The
default (the plugin's, EAGLE-3's): [2, L//2, L-3] for L >= 7, [L-3, L-2, L-1] below (SGLang's own rule repeats
layers there: [2, 2, 1] for L=4). vLLM reads the same ids; SGLang adds one to each id it reads. Model
families read the ids handed to ``set_eagle3_layers_to_capture`` differently (most add one, DeepSeek only
when the first id is 1, GPT-OSS not when the last is L), so the plugin, not this launcher, hands them over
in each family's form and refuses to start when the model would capture other layers.

Dump space (``dump_space``, checked before the server starts; ``--dump-space-check off`` skips it). The
dumps pass through the dump dir's filesystem (shared memory), which must hold the dumps in flight:
  tokens in flight x bytes per token, bytes per token = (1 + K) x hidden_size x dtype bytes
(the final-norm states and the K aux layers, three by default, in the model's 16-bit dtype unless
``--dtype float32``). A dump
is written when a request's whole prompt has been prefilled, by one writer thread per scheduler, and its
worker reads and deletes it as soon as it appears. So the filesystem holds, per scheduler (each data-parallel
replica or DP-attention rank), the prompts that finished in about two prefill steps: the step whose dumps the
workers are reading and the step whose dumps are being written. One step finishes at most
  min(chunk + context, max-total-tokens, max-running-requests x context)
prompt tokens: the step's new tokens (``--chunked-prefill-size``; unset: 16384, the largest chunk SGLang picks
on its own) plus the earlier chunks of the one prompt it completes (at most ``--context-length``, default
the model's ``max_position_embeddings``); every finishing prompt sits in the KV pool (``--max-total-tokens``)
and is one of the running requests (``--max-running-requests``), when those are given. The server refuses to
start when the filesystem is smaller, and says the size to give (compose: ``EAGLET_DUMP_SIZE``). The
context length dominates: ``--context-length`` at the longest prompt of the data shrinks the need most.
``EAGLET_SGLANG_ARGS`` and the command line may not give one launcher flag two values (compose passes
``--tp-size``/``--dp-size`` from its own variables: a second value in the extra args would be overridden).

Environment of the server process (``server_env``): ``EAGLET_DUMP_DIR`` (where ``<rid>.safetensors``
appear), ``EAGLET_AUX_LAYER_IDS`` (the ids; unset: the default), ``SGLANG_PLUGINS=eaglet_dump`` (load only
eaglet's plugin).
"""

import argparse
import logging
import math
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.shared.layers import EAGLE3_NUM_LAYERS, layer_ids_problem
from eaglet.shared.logs import setup_logging
from eaglet.shared.target import text_config

log = logging.getLogger(__name__)

SUPPORTED = ("0.5.23", "0.5.17")  # the plugin's eaglet_sglang.versions.SUPPORTED; a test keeps them equal
CAPTURE_FLAG_SINCE = (0, 5, 23)
PLUGIN_NAME = "eaglet_dump"
EXTRA_ARGS_ENV = "EAGLET_SGLANG_ARGS"
DUMP_SIZE_ENV = "EAGLET_DUMP_SIZE"  # compose sizes the dump volume's tmpfs from it

STEPS_ON_DISK = 2  # one prefill step's dumps being read while the next step's are written
UNSET_CHUNK = 16384  # the largest prefill chunk SGLang picks by itself (it scales with GPU memory)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}

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
        name, eq, given = arg.partition("=")
        value: str | None = given
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


@dataclass(frozen=True, slots=True)
class DumpSpace:
    """The bytes the dump dir's filesystem must hold, and where the number comes from."""

    hidden_size: int
    dtype_bytes: int
    step_tokens: int
    """Prompt tokens one scheduler finishes in one prefill step (the smallest bound that applies)."""
    bound: str
    """Which bound ``step_tokens`` is, in words."""
    schedulers: int
    num_aux: int = EAGLE3_NUM_LAYERS
    """Aux layers a dump holds beside the final-norm states."""

    @property
    def bytes_per_token(self) -> int:
        return (1 + self.num_aux) * self.hidden_size * self.dtype_bytes

    @property
    def tokens(self) -> int:
        return STEPS_ON_DISK * self.step_tokens * self.schedulers

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def explain(self) -> str:
        return (
            f"{STEPS_ON_DISK} steps x {self.step_tokens} tokens ({self.bound}) x {self.schedulers} scheduler(s) = "
            f"{self.tokens} tokens x {self.bytes_per_token} B/token ({1 + self.num_aux} x {self.hidden_size} hidden x "
            f"{self.dtype_bytes} B) = {gib(self.bytes)}"
        )


def gib(n: int) -> str:
    """Bytes in GiB, or in MiB below one GiB (where one decimal of GiB says little)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def last_int(extra: list[str], *names: str) -> int | None:
    """The last integer value given to any of ``names`` in ``extra`` (launch_server keeps the last one too)."""
    found = None
    for name, value in flag_values(extra):
        if name in names and value is not None and value.lstrip("-").isdigit():
            found = int(value)
    return found


def dump_space(cfg: LaunchConfig) -> DumpSpace | str:
    """What the dumps in flight need (see the module doc), or why it cannot be known here."""
    config_file = Path(cfg.model_path) / "config.json"
    if not config_file.is_file():
        return f"no config.json in {cfg.model_path}"
    text = text_config(Path(cfg.model_path))
    hidden = text.get("hidden_size")
    if not isinstance(hidden, int):
        return f"no hidden_size in {config_file}"
    extra = cfg.extra_args
    context = last_int(extra, "--context-length") or text.get("max_position_embeddings")
    if not isinstance(context, int):
        return f"no max_position_embeddings in {config_file}: give --context-length"
    chunk = cfg.chunked_prefill_size
    if chunk is None or chunk <= 0:  # unset, or chunking off: a step's new tokens are the prefill budget
        chunk = last_int(extra, "--max-prefill-tokens") or UNSET_CHUNK
    bounds = [(chunk + context, f"{chunk}-token prefill step + {context}-token context")]
    pool = last_int(extra, "--max-total-tokens")
    if pool:
        bounds.append((pool, "--max-total-tokens: the KV pool holds every finishing prompt"))
    running = last_int(extra, "--max-running-requests")
    if running:
        bounds.append((running * context, f"{running} running requests x {context}-token context"))
    step_tokens, bound = min(bounds)
    dtype = next((v for n, v in reversed(flag_values(extra)) if n == "--dtype"), None) or "auto"
    if dtype == "auto":
        # SGLang runs a float32 checkpoint in 16 bits under auto; a 16-bit one as it is
        dtype_bytes = 2
    elif dtype in DTYPE_BYTES:
        dtype_bytes = DTYPE_BYTES[dtype]
    else:
        return f"--dtype {dtype}: unknown size"
    return DumpSpace(
        hidden_size=hidden,
        dtype_bytes=dtype_bytes,
        step_tokens=step_tokens,
        bound=bound,
        schedulers=cfg.dp_size * cfg.attn_dp_size,
        num_aux=len(cfg.aux_layer_ids or ()) or EAGLE3_NUM_LAYERS,
    )


class DumpSpaceTooSmall(ValueError):
    pass


def check_dump_space(cfg: LaunchConfig, statvfs: Callable[[str], os.statvfs_result] | None = None) -> None:
    """Refuses a dump dir whose filesystem cannot hold the dumps in flight: a full tmpfs fails every write,
    and every sample with it, long after the start."""
    need = dump_space(cfg)
    if isinstance(need, str):
        log.warning("dump space not checked: %s", need)
        return
    st = (statvfs or os.statvfs)(cfg.dump_dir)
    size = st.f_blocks * st.f_frsize
    if size >= need.bytes:
        log.info("dump space: %s available of %s needed (%s)", gib(size), gib(need.bytes), need.explain())
        return
    give = f"{math.ceil(need.bytes / 2**30)}g"
    now = os.environ.get(DUMP_SIZE_ENV)
    raise DumpSpaceTooSmall(
        f"the dump dir {cfg.dump_dir} is on a {gib(size)} filesystem; the dumps in flight need {gib(need.bytes)}: "
        f"{need.explain()}. Give it at least {give}: in compose set {DUMP_SIZE_ENV}={give} "
        f"({'now ' + now if now else 'unset'}; an existing dump volume keeps its size: remove it after "
        "`docker compose down`), with docker run a tmpfs of that size. Or lower the need: --context-length "
        "(the longest prompt of the data), --chunked-prefill-size, --max-running-requests. "
        "--dump-space-check off skips this check."
    )


def installed_sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def launcher_parser(*, given_only: bool = False) -> argparse.ArgumentParser:
    """The launcher's own flags; ``given_only``: no defaults, nothing required (to see what one source gives)."""
    none = argparse.SUPPRESS

    def default(value: object) -> object:
        return none if given_only else value

    p = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0], allow_abbrev=False, argument_default=none if given_only else None
    )
    p.add_argument("--model-path", "--model", required=not given_only)
    p.add_argument("--dump-dir", default=default(os.environ.get("EAGLET_DUMP_DIR", "/dev/shm/eaglet-dumps")))
    p.add_argument("--dump-space-check", choices=("on", "off"), default=default("on"))
    p.add_argument("--served-model-name")
    p.add_argument("--host", default=default("0.0.0.0"))
    p.add_argument("--port", type=int, default=default(30000))
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=default(1))
    p.add_argument("--dp-size", "--data-parallel-size", type=int, default=default(1))
    p.add_argument("--attn-dp-size", "--attention-data-parallel-size", type=int, default=default(1))
    p.add_argument("--enable-dp-attention", action="store_true", help="0.5.17's spelling: --dp-size is the DP width")
    p.add_argument("--aux-layer-ids", type=int, nargs="+",
                   help="ids 1 to L-1, any number (EAGLE-3's, DFlash's, both): the inputs of those layers")  # fmt: skip
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--mem-fraction-static", type=float)
    return p


def flag_clashes(env_args: list[str], cli_args: list[str]) -> list[str]:
    """Launcher flags that the extra args and the command line give different values: the command line's
    would win, silently (compose's command always gives --tp-size and --dp-size)."""
    env_given = vars(launcher_parser(given_only=True).parse_known_args(env_args)[0])
    cli_given = vars(launcher_parser(given_only=True).parse_known_args(cli_args)[0])
    return [
        f"--{k.replace('_', '-')} {env_given[k]} in {EXTRA_ARGS_ENV}, {cli_given[k]} on the command line"
        for k in sorted(env_given.keys() & cli_given.keys())
        if env_given[k] != cli_given[k]
    ]


def main(argv: list[str] | None = None) -> None:
    """Execs the SGLang server (the image's entry point). ``EAGLET_SGLANG_ARGS`` (shell-split) come
    first, then the command line; unknown flags go to ``launch_server``."""
    env_args = shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
    cli_args = sys.argv[1:] if argv is None else argv
    clashes = flag_clashes(env_args, cli_args)
    if clashes:
        sys.exit(
            f"{'; '.join(clashes)}: give each launcher flag once (compose: EAGLET_INFERENCE_TP / "
            f"EAGLET_INFERENCE_DP for the sizes, {EXTRA_ARGS_ENV} for the rest)"
        )
    args, extra = launcher_parser().parse_known_args(env_args + cli_args)
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
    setup_logging()
    os.makedirs(cfg.dump_dir, exist_ok=True)
    if args.dump_space_check == "on":
        try:
            check_dump_space(cfg)
        except DumpSpaceTooSmall as e:
            sys.exit(str(e))
    cmd = server_argv(cfg)
    log.info("starting SGLang %s: %s", cfg.sglang_version, " ".join(cmd))
    os.execvpe(cmd[0], cmd, server_env(cfg))


if __name__ == "__main__":
    main()
