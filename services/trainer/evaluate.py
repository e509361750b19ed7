"""``eaglet eval``: speculative decoding with the target and the run's drafter on held-out prompts.

    python -m eaglet.services.trainer.evaluate --run RUN --prompts prompts-eval.jsonl [--k 4] [--max-new-tokens 128]
    python -m eaglet.services.trainer.evaluate --run RUN --prompts prompts-eval.jsonl --engine sglang \
        [--chain 3,1,4] [--target-quantization fp8] [--concurrency 16]

Reports mean acceptance length, acceptance rate per draft position and wall-clock speed-up over greedy decoding
with the target alone, and checks that both outputs are identical. Results go to the run's ``EvalResult`` record
(the Redis hash ``RunKeys(run).eval``) as they come.

Engines (``--engine``): ``reference`` decodes in this process with eaglet's own speculative decoding, one prompt at a
time, at ``--k`` draft tokens a round; ``sglang`` serves the target alone and then the target with the drafter in
SGLang's own server, the engine that will serve it (served.py: the chain, fp8 targets, requests in flight). Both
write the same record, its ``engine`` named.

Prompt lines: ``{"messages": [...]}`` (OpenAI), ``{"conversations": [{"from", "value"}]}`` (ShareGPT) or
``{"prompt": "..."}``. The conversation up to the first assistant turn is rendered with the target's chat
template and ``add_generation_prompt``.
"""

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path

import torch
from pydantic import Field
from redis import Redis
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglet.services.trainer.checkpoint import carried_heldout, is_dflash, load_dflash, load_drafter
from eaglet.services.trainer.dflash import DFlashDrafter
from eaglet.services.trainer.model import Drafter
from eaglet.services.trainer.served import Chain, ServedConfig, drafted_positions, serve_eval
from eaglet.services.trainer.speculative import SpecStats, dflash_generate, greedy_generate, speculative_generate
from eaglet.shared.acceptance import predicted_accept_length
from eaglet.shared.config import Settings
from eaglet.shared.connections import connect
from eaglet.shared.logs import setup_logging
from eaglet.shared.records import EvalResult
from eaglet.shared.runoptions import EvalEngine
from eaglet.shared.runstate import RunState
from eaglet.shared.store import drafter_dir, run_dir
from eaglet.shared.target import resolve_model_dir

log = logging.getLogger(__name__)


class EvalSettings(Settings):
    """How ``--engine sglang`` starts its servers: read by ``eaglet eval`` and by the trainer's hand-off."""

    sglang_python: str = ""
    """The Python whose SGLang serves the evaluation (``python -m sglang.launch_server``); empty: this process's."""

    eval_sglang_args: str = ""
    """More ``sglang.launch_server`` flags for both evaluation servers, shell-quoted, e.g.
    ``--mem-fraction-static 0.8 --tp-size 2``."""

    eval_startup_timeout_s: float = Field(1800.0, gt=0)
    """How long an evaluation server may take to answer its health check."""

    eval_service: bool = False
    """The trainer leaves what follows training (the checkpoint choice, the evaluation) to the evaluation service
    (services/trainer/evaluator.py), which runs where SGLang is: compose's gpu profile, in the inference image."""


def served_config(settings: EvalSettings, python: str | None = None, **given) -> ServedConfig:
    """The SGLang evaluation's config: ``python``, else the settings' (else this one), the settings' extra flags, and
    the fields ``given``; ValueError for a field out of range."""
    return ServedConfig(
        python=python or settings.sglang_python or sys.executable,
        extra=tuple(shlex.split(settings.eval_sglang_args)), startup_timeout_s=settings.eval_startup_timeout_s,
        **given,
    )  # fmt: skip


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def prompt_messages(record: dict) -> list[dict]:
    """The conversation up to (not including) the first assistant turn."""
    if "prompt" in record:
        return [{"role": "user", "content": record["prompt"]}]
    turns = record.get("messages")
    if turns is None:
        turns = [{"role": t["from"], "content": t["value"]} for t in record.get("conversations", [])]
    out = []
    for t in turns:
        role = ROLES.get(t["role"], t["role"])
        if role == "assistant":
            break
        out.append({"role": role, "content": t["content"]})
    if not out:
        raise ValueError("no turn before the first assistant turn")
    return out


def load_prompts(path: Path, tokenizer, limit: int = 0) -> list[list[int]]:
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = prompt_messages(json.loads(line))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("%s:%d: skipped: %s", path, n, e)
            continue
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids))
        if limit and len(prompts) >= limit:
            break
    return prompts


def eos_set(tokenizer, target) -> set[int]:
    eos = target.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def run_eval(
    target,
    drafter,
    tokenizer,
    prompts: list[list[int]],
    *,
    k: int,
    max_new_tokens: int,
    layer_ids: list[int],
    report=None,
) -> dict:
    """Greedy and speculative decoding on every prompt; returns the figures (and reports them as it goes)."""
    device = next(target.parameters()).device
    eos = eos_set(tokenizer, target)
    total = SpecStats(k)
    target_s = spec_s = 0.0
    new_tokens = mismatches = 0
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids], device=device)
        t0 = time.perf_counter()
        ref = greedy_generate(target, x, max_new_tokens, eos)
        t1 = time.perf_counter()
        if isinstance(drafter, DFlashDrafter):
            got, stats = dflash_generate(target, drafter, x, max_new_tokens, eos)
        else:
            got, stats = speculative_generate(target, drafter, x, max_new_tokens, k, layer_ids, eos)
        t2 = time.perf_counter()
        target_s, spec_s = target_s + t1 - t0, spec_s + t2 - t1
        new_tokens += len(ref)
        total.accepted += stats.accepted
        total.rounds += stats.rounds
        if got != ref:
            mismatches += 1
            log.error("prompt %d: speculative output differs from greedy output", i)
        figures = {
            "prompts_done": i + 1, "accept_length": round(total.accept_length(), 4),
            "accept_rate": [round(r, 4) for r in total.position_rates()], "rounds": total.rounds,
            "new_tokens": new_tokens, "target_s": round(target_s, 3), "spec_s": round(spec_s, 3),
            "speedup": round(target_s / max(spec_s, 1e-9), 4),
            "target_tok_s": round(new_tokens / max(target_s, 1e-9), 2),
            "spec_tok_s": round(new_tokens / max(spec_s, 1e-9), 2), "mismatches": mismatches,
        }  # fmt: skip
        if report is not None:
            report(figures)
    return figures


def load_reference(target_dir: Path, folder: Path) -> tuple[torch.nn.Module, Drafter | DFlashDrafter, list[int]]:
    """The target and the drafter in this process (a GPU if there is one), and the target layers the drafter reads."""
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    # transformers types ``to`` as a method wrapper that takes the model first
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    embed = target.get_input_embeddings().weight.detach()
    drafter: Drafter | DFlashDrafter
    if is_dflash(folder):
        drafter = load_dflash(folder, embed.float()).to(device, dtype).eval()
        layer_ids = [i + 1 for i in drafter.cfg.target_layer_ids]
    else:
        config = json.loads((folder / "config.json").read_text())
        layer_ids = config["eagle_aux_hidden_state_layer_ids"]  # input of layer i = transformers' hidden_states[i]
        # the drafter's own plain RoPE, from its config, as the engines run it
        drafter = load_drafter(folder, embed.float()).to(device, dtype).eval()
    return target, drafter, layer_ids


def positions(drafter: Path, k: int, served: ServedConfig | None) -> int:
    """Draft positions a round verifies: a DFlash drafter's block less the verified token (in either engine, whatever
    ``k`` says), else ``k`` in the reference engine and the chain's steps in SGLang."""
    if served is not None:
        return drafted_positions(drafter, served.chain)
    return drafted_positions(drafter, None) if is_dflash(drafter) else k


def evaluate_run(
    *, redis: Redis | None, run_id: str, data_dir: Path, target_dir: Path, prompts: Path, k: int = 4,
    max_new_tokens: int = 128, num_prompts: int = 0, drafter_path: Path | None = None,
    served: ServedConfig | None = None, decoded: dict | None = None,
) -> dict:  # fmt: skip
    """Decodes with the target and the run's drafter, in this process (``served`` None: the reference engine) or in
    SGLang (``served``), and writes ``RunKeys(run).eval``; returns the figures. ``decoded``: the figures of a decode
    of this drafter on these prompts with these settings already made (a served selection's): recorded as they are."""
    engine: EvalEngine = "reference" if served is None else "sglang"
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    folder = Path(drafter_path or drafter_dir(data_dir, run_id))
    k = positions(folder, k, served)
    if served is None and decoded is None:
        target, drafter, layer_ids = load_reference(target_dir, folder)
    ids = load_prompts(prompts, tokenizer, num_prompts)
    state = RunState(redis, run_id) if redis is not None else None

    def report(figures: dict) -> None:
        if state is not None:
            state.update_eval(EvalResult(**figures, updated_at=time.time()))

    if state is not None:
        now = time.time()
        # the figure the drafter's training predicts for this chain, served beside it: far below, it was not
        # served as trained (shared/acceptance.py). From the figures the export carries; else, for the run's own
        # drafter, its train record's
        own = folder.resolve() == drafter_dir(data_dir, run_id).resolve()
        accuracy = (carried_heldout(folder) or {}).get("heldout_acc") or (state.train().heldout_acc if own else None)
        predicted = predicted_accept_length(accuracy, k)
        state.replace_eval(
            EvalResult(
                state="running", prompts=len(ids), k=k, max_new_tokens=max_new_tokens, engine=engine,
                target_quantization=None if served is None else served.target_quantization,
                predicted_accept_length=None if predicted is None else round(predicted, 4),
                started_at=now, updated_at=now,
            )
        )  # fmt: skip
    log.info("run %s: %s %d prompts in %s, k=%d, up to %d new tokens", run_id,
             "evaluating" if decoded is None else "recording the selection's decode of", len(ids), engine, k,
             max_new_tokens)  # fmt: skip
    try:
        if decoded is not None:
            figures = decoded
            report(figures)
        elif served is None:
            figures = run_eval(
                target, drafter, tokenizer, ids, k=k, max_new_tokens=max_new_tokens, layer_ids=layer_ids, report=report
            )
        else:
            # a trainer's cached blocks, freed before SGLang sizes its pool by what is free
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            figures = serve_eval(target_dir=target_dir, drafter_dir=folder, prompts=ids, max_new_tokens=max_new_tokens,
                                 cfg=served, log_dir=run_dir(data_dir, run_id) / "eval", report=report)  # fmt: skip
    except Exception as e:  # the record says so, whoever called: eaglet eval or the trainer's hand-off
        report({"state": "failed", "error": f"{type(e).__name__}: {e}", "finished_at": time.time()})
        raise
    report({"state": "done", "finished_at": time.time()})
    log.info(
        "run %s: acceptance length %s, per position %s, speed-up %.2fx, mismatches %d (%s)",
        run_id, figures["accept_length"], figures["accept_rate"], figures["speedup"], figures["mismatches"], engine,
    )  # fmt: skip
    return figures


def chain_flag(text: str) -> Chain:
    try:
        steps, topk, tokens = (int(x) for x in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--chain {text!r}: give steps,topk,draft-tokens, e.g. 3,1,4") from e
    return steps, topk, tokens


SGLANG_ONLY = ("chain", "target_quantization", "concurrency", "sglang_python")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eaglet eval", description="Acceptance length of a run's drafter.")
    p.add_argument("--run", required=True)
    p.add_argument("--prompts", type=Path, required=True, help="JSONL of held-out prompts")
    p.add_argument("--engine", choices=("reference", "sglang"), default="reference",
                   help="reference: eaglet's own speculative decoding, in this process; sglang: the target alone, "
                   "then with the drafter, each in SGLang's server (default reference)")  # fmt: skip
    p.add_argument("--k", type=int, help="draft tokens per round (chain), reference engine (default 4)")
    p.add_argument(
        "--chain",
        type=chain_flag,
        metavar="S,K,N",
        help="EAGLE-3 in SGLang: steps, topk, draft tokens (default 3,1,4; a DFlash drafter takes none)",
    )
    p.add_argument("--target-quantization", choices=("fp8",),
                   help="sglang: the target quantized at load (fp8), the drafter not")  # fmt: skip
    p.add_argument("--concurrency", type=int, help="sglang: requests in flight (default 16)")
    p.add_argument("--sglang-python", help="sglang: the Python whose SGLang serves (default: EAGLET_SGLANG_PYTHON, "
                   "else this one)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=0, help="0: all")
    p.add_argument("--model", help="target model directory (default: the run's model_dir, else EAGLET_MODEL)")
    p.add_argument("--drafter", type=Path, help="drafter directory (default: the run's)")
    return p


def main(argv: list[str] | None = None) -> int:
    """0 when done (the reference engine: and every output equals greedy's, else 2); 1 when the evaluation failed."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or (args.k is not None and args.k < 1):
        p.error("--k and --max-new-tokens must be at least 1")
    settings = EvalSettings()
    served = None
    if args.engine == "reference":
        sglang_flags = [f"--{name.replace('_', '-')}" for name in SGLANG_ONLY if getattr(args, name) is not None]
        if sglang_flags:
            p.error(f"{', '.join(sglang_flags)}: only with --engine sglang (the reference engine decodes the target as "
                    "stored, one prompt at a time, at --k)")  # fmt: skip
    else:
        if args.k is not None:
            p.error("--k is the reference engine's: give SGLang's chain as --chain steps,topk,draft-tokens")
        given: dict = {"chain": args.chain, "target_quantization": args.target_quantization}
        if args.concurrency is not None:
            given["concurrency"] = args.concurrency
        try:
            served = served_config(settings, args.sglang_python, **given)
        except ValueError as e:
            p.error(str(e))
    setup_logging()
    redis = connect(settings.redis_url)
    state = RunState(redis, args.run)
    model = args.model or state.meta().model_dir or settings.model
    try:
        figures = evaluate_run(
            redis=redis, run_id=args.run, data_dir=settings.data_dir,
            target_dir=resolve_model_dir(model, settings.model_cache_dir), prompts=args.prompts, k=args.k or 4,
            max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts, drafter_path=args.drafter,
            served=served,
        )  # fmt: skip
    except Exception as e:
        log.error("run %s: evaluation failed", args.run, exc_info=True)
        state.update_eval(EvalResult(state="failed", error=f"{type(e).__name__}: {e}"))  # also before it started
        return 1
    if figures["mismatches"] and served is not None:  # other batch shapes may pick the other token at a near-tie
        log.warning("run %s: %d outputs differ from the target alone's in SGLang", args.run, figures["mismatches"])
    return 2 if figures["mismatches"] and served is None else 0


if __name__ == "__main__":
    raise SystemExit(main())
