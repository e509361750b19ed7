"""The drafter measured in the engine that will serve it: SGLang's own server (``python -m sglang.launch_server``),
the target alone first, then the target with the drafter, on the same prompts, greedy (``eaglet eval --engine
sglang``).

- The target alone's texts are the reference: greedy speculative decoding changes the speed, not the text, so an
  output of the drafter's server that differs is counted (``mismatches``). Batches of other shapes may pick the other
  token at a near-tie in bf16, so a few may differ without the drafter being served wrong.
- The accept length is SGLang's: completion tokens over verify steps (a step yields the drafts it accepted and one
  token of the target's own). The acceptance at draft position k is the share of verify steps that accepted at
  least k drafts, from each request's histogram of drafts accepted per step (``position_acceptance``).
- Speed: the output tokens/s the client sees, every prompt ``concurrency`` at a time, after a few prompts of warm-up
  (the first batches compile kernels); the speed-up is the drafter's tokens/s over the target alone's.

The servers' flags (``sglang_command``):
- EAGLE-3: ``--speculative-algorithm EAGLE3`` at a chain (steps, topk, draft tokens), ``DEFAULT_CHAIN`` unless given.
- DFlash: ``--speculative-algorithm DFLASH``; the block size and the mask token come from the drafter's config.
- ``target_quantization="fp8"``: ``--quantization fp8`` quantizes the target, in both servers; the drafter keeps the
  dtype it was trained in (``--speculative-draft-model-quantization unquant``: SGLang would quantize it as the
  target otherwise).
- ``extra``: more ``launch_server`` flags, for both servers (``EAGLET_EVAL_SGLANG_ARGS``, shell-split). The flags
  this module sets (``OWNED_FLAGS``) may not be given again.

Each server writes its log under the run's folder (``<run>/eval/sglang-target.log``, ``sglang-drafter.log``); a
server that dies or does not come up fails the evaluation with ``EngineFailed``, naming the engine, its port and the
log's last lines.
"""

import json
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

from eaglet.services.trainer.checkpoint import is_dflash
from eaglet.shared.acceptance import position_acceptance
from eaglet.shared.redisserver import free_port

log = logging.getLogger(__name__)

Chain = tuple[int, int, int]
DEFAULT_CHAIN: Chain = (3, 1, 4)
"""EAGLE-3's (steps, topk, draft tokens) where none is given: the chain the benches serve."""
QUANTIZATIONS = ("fp8",)
OWNED_FLAGS = {
    "--model-path", "--model", "--host", "--port", "--quantization", "--speculative-algorithm",
    "--speculative-draft-model-path", "--speculative-draft-model", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--speculative-dflash-block-size",
    "--speculative-draft-model-quantization",
}  # fmt: skip
"""Set by ``sglang_command`` (and their aliases); refused in the extra flags."""
HEALTH_PATHS = ("/health_generate", "/health")
"""Ready once the first answers 200 (SGLang's runs one generation); a server without it (eaglet's reference
server) is asked the second."""
WARMUP_PROMPTS = 4
STOP_TIMEOUT_S = 30.0


class EngineFailed(RuntimeError):
    """An evaluation server died, did not come up in time, or failed a request."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServedConfig:
    """How ``eaglet eval --engine sglang`` serves the target and the drafter."""

    python: str
    """The Python whose SGLang serves (``python -m sglang.launch_server``)."""
    chain: Chain | None = None
    """EAGLE-3's (steps, topk, draft tokens); None: ``DEFAULT_CHAIN``. A DFlash drafter takes none: it drafts its
    block."""
    target_quantization: str | None = None
    """``fp8``: the target quantized by SGLang at load (the drafter is not); None: as stored."""
    concurrency: int = 16
    """Requests in flight."""
    extra: tuple[str, ...] = ()
    """More ``launch_server`` flags, for both servers."""
    startup_timeout_s: float = 1800.0
    """How long a server may take to answer its health check (a large target loads for minutes)."""

    def __post_init__(self) -> None:
        if self.chain is not None:
            check_chain(self.chain)
        check_quantization(self.target_quantization)
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency}: must be at least 1")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s={self.startup_timeout_s}: must be above 0")
        check_extra(self.extra)


def check_chain(chain: Chain) -> None:
    steps, topk, tokens = chain
    if steps < 1 or topk < 1 or tokens < 2:
        raise ValueError(f"chain {chain}: steps and topk must be at least 1, draft tokens at least 2")
    if topk == 1 and tokens != steps + 1:  # SGLang would change it to steps + 1 itself, with only a log line
        raise ValueError(f"chain {chain}: with topk 1 the draft tokens are steps + 1 ({steps},1,{steps + 1})")


def check_quantization(target_quantization: str | None) -> None:
    if target_quantization is not None and target_quantization not in QUANTIZATIONS:
        raise ValueError(
            f"target_quantization={target_quantization!r}: the evaluation quantizes the target to "
            f"{' or '.join(QUANTIZATIONS)} only (--target-quantization fp8), or not at all"
        )


def check_extra(extra: Sequence[str]) -> None:
    owned = [a for a in extra if a.split("=", 1)[0] in OWNED_FLAGS]
    if owned:
        raise ValueError(
            f"extra SGLang flags {' '.join(owned)}: the evaluation sets these itself (the target, the drafter, the "
            "port; the target's quantization through --target-quantization)"
        )


def check_no_chain(drafter_dir: Path, chain: Chain | None) -> None:
    if chain is not None:
        raise ValueError(f"chain {chain}: a DFlash drafter takes none, it drafts its block (block_size in "
                         f"{Path(drafter_dir) / 'config.json'})")  # fmt: skip


def drafter_method(drafter_dir: Path) -> str:
    """``dflash`` or ``eagle3``, from the drafter's config."""
    return "dflash" if is_dflash(drafter_dir) else "eagle3"


def drafted_positions(drafter_dir: Path, chain: Chain | None) -> int:
    """Draft positions one verify step checks: a DFlash drafter's block less the verified token, EAGLE-3's steps."""
    if is_dflash(drafter_dir):
        check_no_chain(drafter_dir, chain)
        return int(json.loads((Path(drafter_dir) / "config.json").read_text())["block_size"]) - 1
    return (chain or DEFAULT_CHAIN)[0]


def sglang_command(
    python: str,
    target_dir: Path,
    drafter_dir: Path | None,
    method: str | None,
    chain: Chain | None,
    port: int,
    target_quantization: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The argv of an SGLang server of ``target_dir`` on 127.0.0.1:``port``, with the drafter ``drafter_dir``
    (``method`` ``eagle3`` at ``chain``, or ``dflash``), or the target alone (``drafter_dir`` None)."""
    check_quantization(target_quantization)
    check_extra(extra)
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(target_dir), "--host", "127.0.0.1",
            "--port", str(port)]  # fmt: skip
    if target_quantization is not None:
        argv += ["--quantization", target_quantization]
    if drafter_dir is not None:
        argv += drafter_flags(Path(drafter_dir), method, chain)
        if target_quantization is not None:
            argv += ["--speculative-draft-model-quantization", "unquant"]
    return argv + list(extra)


def drafter_flags(drafter_dir: Path, method: str | None, chain: Chain | None) -> list[str]:
    if method == "dflash":
        check_no_chain(drafter_dir, chain)
        return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(drafter_dir)]
    if method != "eagle3":
        raise ValueError(f"method={method!r}: use 'eagle3' or 'dflash'")
    steps, topk, tokens = chain or DEFAULT_CHAIN
    check_chain((steps, topk, tokens))
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter_dir),
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(tokens)]  # fmt: skip


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


@contextmanager
def serving(
    argv: list[str], *, port: int, log_path: Path, engine: str = "sglang", timeout_s: float = 1800.0,
    env: dict[str, str] | None = None,
) -> Iterator[str]:  # fmt: skip
    """Starts the server ``argv`` (listening on 127.0.0.1:``port``), its output in ``log_path``; yields its base URL
    once it answers, and stops it on leaving (EngineFailed if it dies or does not answer within ``timeout_s``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        # its own process group: SGLang's scheduler and detokenizer are children, stopped with it
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log_path, engine=engine, timeout_s=timeout_s)
        yield url
    finally:
        stop(proc)


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path, *, engine: str, timeout_s: float) -> None:
    deadline, paths = time.monotonic() + timeout_s, list(HEALTH_PATHS)
    with httpx.Client(base_url=url, timeout=30) as client:
        while True:
            if proc.poll() is not None:
                raise EngineFailed(f"{engine} on {url} exited with {proc.returncode} before it answered; the end of "
                                   f"{log_path}:\n{log_tail(log_path)}")  # fmt: skip
            if time.monotonic() > deadline:
                raise EngineFailed(f"{engine} on {url} did not answer {paths[0]} within {timeout_s:.0f}s; the end of "
                                   f"{log_path}:\n{log_tail(log_path)}")  # fmt: skip
            with suppress(httpx.HTTPError):  # not listening yet
                code = client.get(paths[0]).status_code
                if code == 200:
                    return
                if code == 404 and len(paths) > 1:
                    paths.pop(0)
            time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after STOP_TIMEOUT_S; then to what is left of the group, so
    no child keeps the GPU memory the next server needs."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("server pid %d: no exit %.0fs after SIGTERM; killing it", proc.pid, STOP_TIMEOUT_S)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass(frozen=True, kw_only=True, slots=True)
class Decoded:
    """One pass over the prompts, the figures the server gives per request summed."""

    texts: list[str]
    completion_tokens: int
    verify_steps: int
    """0 without a drafter."""
    histogram: list[int]
    """Entry n: verify steps that accepted exactly n drafts, over every request."""
    wall_s: float

    @property
    def accept_length(self) -> float | None:
        return self.completion_tokens / self.verify_steps if self.verify_steps else None

    @property
    def accept_rate(self) -> list[float]:
        """The share of verify steps that accepted the draft at each position (1, 2, ...)."""
        return position_acceptance([self.histogram]).get("accept_rate_per_position", [])

    @property
    def tok_s(self) -> float:
        return self.completion_tokens / max(self.wall_s, 1e-9)


def decode(
    base_url: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int, *, timeout_s: float = 600.0
) -> Decoded:
    """Greedy decoding of every prompt through SGLang's ``/generate``, ``concurrency`` requests in flight."""
    limits = httpx.Limits(max_connections=concurrency)
    with httpx.Client(base_url=base_url, timeout=timeout_s, limits=limits) as client:

        def one(ids: list[int]) -> dict:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
            try:
                r = client.post("/generate", json=body)
            except httpx.HTTPError as e:
                raise EngineFailed(f"{base_url}/generate: {type(e).__name__}: {e}") from e
            if r.status_code != 200:
                raise EngineFailed(f"{base_url}/generate answered {r.status_code}: {r.text[:500]}")
            return r.json()

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            outs = list(pool.map(one, prompts))
        wall_s = time.perf_counter() - t0
    metas = [o["meta_info"] for o in outs]
    # the histogram's name differs between SGLang versions
    hists = [m.get("spec_accept_histogram") or m.get("spec_correct_drafts_histogram") or [] for m in metas]
    return Decoded(
        texts=[o["text"] for o in outs],
        completion_tokens=sum(int(m["completion_tokens"]) for m in metas),
        verify_steps=sum(int(m.get("spec_verify_ct") or 0) for m in metas),
        histogram=position_acceptance(hists).get("accepted_drafts_histogram", []),
        wall_s=wall_s,
    )


def serve_eval(
    *,
    target_dir: Path,
    drafter_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    cfg: ServedConfig,
    log_dir: Path,
    report: Callable[[dict], None] | None = None,
) -> dict:
    """The target alone, then the target with the drafter, each in its own SGLang server on the same prompts;
    returns the figures (``EvalResult``'s fields), reporting them as they come."""
    method, positions = drafter_method(drafter_dir), drafted_positions(drafter_dir, cfg.chain)
    ports = {"target": free_port(), "drafter": free_port()}
    # both commands first: a flag the drafter's server would refuse fails before the target alone has run
    argvs = {name: sglang_command(cfg.python, target_dir, drafter, method if drafter else None, cfg.chain,
                                  ports[name], cfg.target_quantization, cfg.extra)
             for name, drafter in (("target", None), ("drafter", drafter_dir))}  # fmt: skip
    runs: dict[str, Decoded] = {}
    for name, argv in argvs.items():
        log.info("evaluation: SGLang, %s: %s", "the target alone" if name == "target" else "with the drafter",
                 shlex.join(argv))  # fmt: skip
        log_path, timeout_s = log_dir / f"sglang-{name}.log", cfg.startup_timeout_s
        with serving(argv, port=ports[name], log_path=log_path, timeout_s=timeout_s) as url:
            decode(url, prompts[:WARMUP_PROMPTS], max_new_tokens, cfg.concurrency)
            runs[name] = decode(url, prompts, max_new_tokens, cfg.concurrency)
        if name == "target" and report is not None:
            report({"target_s": round(runs[name].wall_s, 3), "target_tok_s": round(runs[name].tok_s, 2)})
    alone, spec = runs["target"], runs["drafter"]
    rates = spec.accept_rate + [0.0] * (positions - len(spec.accept_rate))  # positions never accepted
    figures = {
        "prompts_done": len(prompts),
        "accept_length": None if spec.accept_length is None else round(spec.accept_length, 4),
        "accept_rate": rates, "rounds": spec.verify_steps, "new_tokens": alone.completion_tokens,
        "target_s": round(alone.wall_s, 3), "spec_s": round(spec.wall_s, 3),
        "speedup": round(spec.tok_s / max(alone.tok_s, 1e-9), 4),
        "target_tok_s": round(alone.tok_s, 2), "spec_tok_s": round(spec.tok_s, 2),
        "mismatches": sum(a != b for a, b in zip(alone.texts, spec.texts, strict=True)),
        "engine": "sglang", "engine_flags": shlex.join(argvs["drafter"][3:]),  # after python -m sglang.launch_server
        "target_quantization": cfg.target_quantization,
    }  # fmt: skip
    if report is not None:
        report(figures)
    return figures
