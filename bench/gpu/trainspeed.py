"""eaglet's trainer at long samples on one GPU: tokens/s, MFU and peak memory per target shape and sample length.

    GPUBENCH_SCRIPT=trainspeed.py bash bench/gpu/run.sh PARTS trainspeed [trainspeed-b]     (bench/gpu/README.md)

Phases (through harness.py's runner: deadlines, results in $OUT/<phase>.json):
  trainspeed    every shape of TRAINSPEED_SHAPES (kimi,l8b,smol) at every length of TRAINSPEED_LENGTHS, with the
                trainer options TRAINSPEED_FLAGS (the trainer's own flags, e.g. "--loss-chunk 0")
  trainspeed-b  the same rows with TRAINSPEED_FLAGS_B: a change measured against the first in the same call
                (at TRAINSPEED_LENGTHS_B if set: e.g. only the lengths the change is for)
  trainspeed-compile  each row of TRAINSPEED_COMPILE_ROWS (smol:2048,smol:8192,l8b:8192) with --compile off and on,
                interleaved, TRAINSPEED_REPEATS (3) times each, with TRAINSPEED_FLAGS: the median tokens/s of each
                and their spread, and on's ratio to off
All three also write $OUT/trainspeed.md, a table per phase.

A row is the real trainer, ``train(redis=None, ...)`` with its loader, on a synthetic run: a target directory with
the shape's config.json and random bf16 embedding and LM head (all the trainer reads of a target), and samples of
exactly T tokens written by the store's own writers. TRAINSPEED_STEPS (6) optimizer steps of one sample each
(tokens_per_batch = max_len = T), the first WARMUP_STEPS (2) untimed: they compile FlexAttention and fill the
loader. A row has one sample a step (one epoch, the loader's read-ahead as in a long run) within TRAINSPEED_DISK_GB
(24) of samples, at least 2. Its samples, checkpoints and drafter are removed behind it; the targets stay for later
rows and calls.

The samples make the trainer do a real run's work: input ids drawn from as many vocabulary ids as the draft
vocabulary holds, and final states whose target top token is the next input id (recorded per row as
``target_top_is_next_token``), so the OOV mask keeps every loss position, as on text a target predicts well.

An out-of-memory is a row (what the allocator tried to allocate and held), and so is the trainer's refusal of a
length its memory rule says would not fit (the trainer's memory.py, the rule's estimate in every row
beside the measured peak); the shape's longer lengths are then skipped. A row whose estimate would pass the call's
GPUBENCH_DEADLINE_S is skipped, with its estimate. Rows of earlier calls stay in the phase's record unless measured
again (rows of other flags are dropped).
"""

import argparse
import functools
import gc
import json
import os
import re
import shlex
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.gpu import harness as P
from bench.gpu import mkmodel
from bench.gpu.h2h import time_left
from bench.gpu.trainshapes import KIMI, TEXT
from eaglet.services.trainer import train as trainer
from eaglet.services.trainer.compiled import compile_on
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.distributed import init_distributed
from eaglet.services.trainer.main import add_config_flags, config_from_args
from eaglet.services.trainer.memory import MemoryRuleError, estimate, rule_shape
from eaglet.services.trainer.model import drafter_config
from eaglet.services.trainer.objective import objective_options
from eaglet.services.trainer.train import train
from eaglet.shared.layers import default_layer_ids
from eaglet.shared.logs import setup_logging
from eaglet.shared.samples import SampleWriter
from eaglet.shared.store import run_dir, sample_path, samples_dir, write_sample
from eaglet.shared.targettensors import load_target_tensors


def lengths_from(env: str, default: str) -> list[int]:
    """Sample lengths from ``env``, comma-separated, else ``default``."""
    return sorted(int(x) for x in (os.environ.get(env) or default).split(","))


WARMUP_STEPS = 2
STEPS = int(os.environ.get("TRAINSPEED_STEPS", "6"))
SHAPE_NAMES = os.environ.get("TRAINSPEED_SHAPES", "kimi,l8b,smol").split(",")
LENGTHS = lengths_from("TRAINSPEED_LENGTHS", "2048,8192,16384,32768,65536")
COMPILE_ROWS = [(name, int(T)) for name, T in (row.split(":") for row in
                os.environ.get("TRAINSPEED_COMPILE_ROWS", "smol:2048,smol:8192,l8b:8192").split(","))]  # fmt: skip
REPEATS = int(os.environ.get("TRAINSPEED_REPEATS", "3"))
# One epoch of distinct samples when the disk allows: with fewer, every epoch restarts the loader's workers and
# its first batch is read while the GPU waits, which a real run (thousands of samples an epoch) never does.
DISK_BUDGET_BYTES = float(os.environ.get("TRAINSPEED_DISK_GB", "24")) * 1e9
MIN_SAMPLES = 2
PEAK_FLOPS = 989e12  # H200 dense bf16
TOP_LOGIT = 10.0  # the target's logit of the next token in the synthetic final states: peaked, as a trained target
ROOT = P.ROOT / "trainspeed"
TARGETS, DATA = ROOT / "targets", ROOT / "data"

# Row time estimates (the deadline): the samples and the checkpoint finish() writes (fp32 weights and AdamW's two
# moments in torch.save, the bf16 drafter: 14 bytes a parameter) at the rate the rows wrote them on one H200
# (2026-12-04: about 0.65 GB/s, half the disk's fsync probe of 1.29-1.43 GB/s), the trainer's start (a few seconds,
# plus the target's embedding and LM head read and moved to the GPU), FlexAttention's compile the first time a head
# size comes up (about 20 s there), and a row's first step, which costs about FIRST_STEP more steps.
DISK_BYTES_PER_S = 0.65e9
START_S = 10.0
TARGET_LOAD_BYTES_PER_S = 2e9
COMPILE_S = 25.0
FIRST_STEP = 3
STEP_COMPILE_S = 60.0  # --compile on: the TTT step's and the loss chunk's graphs, forward and backward (a guess)
CHECKPOINT_BYTES_PER_PARAM = 14
RECOMPUTE = 1 / 3  # a checkpointed TTT step's forward again in the backward pass: a third more of its compute
COMPILED_HEAD_DIMS: set[int] = set()  # FlexAttention compiled in this process, for these head sizes (both phases)
COMPILED_STEPS: set[str] = set()  # shapes whose compiled TTT step this process has (its graphs serve later rows)


@dataclass(frozen=True, slots=True)
class Shape:
    config: dict  # the target's config.json as written
    tokens_per_s: float  # for estimates only: the 2026-11 hand-run's figure, else a guess below it
    prefix: str = ""  # of the tensor names: a wrapper (Kimi-K2.5) holds its language model under language_model.

    @property
    def text(self) -> dict:
        return self.config.get("text_config", self.config)


SHAPES = {
    "kimi": Shape(KIMI, 11_000, "language_model."),
    "l8b": Shape(TEXT["l8b"], 21_000),
    "smol": Shape(TEXT["smol"], 50_000),
    "tiny": Shape(TEXT["tiny"], 2_000),
}

FLOPS_FORMULA = """\
Per sample of T tokens and S TTT steps (the drafter's shape from eaglet's drafter_config: hidden H, intermediate I,
heads h x head_dim d, KV heads k, draft vocabulary Vd, target hidden Ht, target vocabulary V):
  forward = T * fc + S * T * (layer + attention_causal) + T * attention_ttt_diagonal + lm_head_positions * lm_head
    fc                     2 * 3Ht * H              once a token: the first step's fused auxiliary states
    layer                  2 * (2H * (h + 2k) * d + h * d * H + 3 * H * I)   q/k/v on [embedding; hidden], o, MLP
    attention_causal       2 * 2 * (T + 1) / 2 * h * d   QK^T and PV over the step-0 keys up to the query
    attention_ttt_diagonal 2 * 2 * h * d * S(S - 1) / 2  step i's query also sees its own position at steps 1..i
    lm_head                2 * H * Vd               only where the loss needs logits: the loss positions of each step
                                                    (T - max(2 + i, T / 2) with the second half masked in)
  train = 3 * forward (backward counted as 2 x forward)
  target (no grad, apart) = T * 2 * H * Vd (the target's log-probs over the draft vocabulary)
                            + T * 2 * H * V with the OOV mask on or an LK loss (the target's logits over its full
                              vocabulary: its top token, its normalizer)
mfu = train FLOPs of the timed steps / their wall time / 989e12 (H200 dense bf16); mfu_with_target adds the target's.
Model FLOPs: work done again to save memory (checkpointed loss chunks or TTT steps) is not counted, nor are norms,
RoPE, softmax and the loss's elementwise work."""


def flops(text: dict, cfg: TrainConfig, T: int, oov: bool) -> dict:
    """The FLOP count of one training step on one sample of ``T`` tokens (FLOPS_FORMULA), term by term, and the
    drafter's matmul parameters. ``oov``: the OOV mask is on."""
    V = text["vocab_size"]
    d = drafter_config(text, vocab_size=V, draft_vocab_size=min(cfg.draft_vocab_size, V),
                       head_dim=cfg.draft_head_dim, kv_heads=cfg.draft_kv_heads)  # fmt: skip
    H, inter, h, k, hd, Vd = (d.hidden_size, d.intermediate_size, d.num_attention_heads, d.num_key_value_heads,
                              d.head_dim, d.draft_vocab_size)  # fmt: skip
    S = cfg.ttt_steps
    fc_params = d.num_aux_hidden_states * d.target_hidden_size * H
    layer_params = 2 * H * (h + 2 * k) * hd + h * hd * H + 3 * H * inter
    terms = {
        "fc": 2 * fc_params,
        "layer": 2 * layer_params,
        "attention_causal": 2 * 2 * (T + 1) / 2 * h * hd,
        "attention_ttt_diagonal": 2 * 2 * h * hd * S * (S - 1) / 2,
        "lm_head": 2 * H * Vd,
        "lm_head_positions": sum(max(0, T - max(2 + i, T // 2)) for i in range(S)),
    }
    forward = (T * terms["fc"] + S * T * (terms["layer"] + terms["attention_causal"])
               + T * terms["attention_ttt_diagonal"] + terms["lm_head_positions"] * terms["lm_head"])  # fmt: skip
    # the LK losses (a trainer with a `loss` option) also take the target's normalizer over its whole vocabulary
    full_vocab = oov or getattr(cfg, "loss", "kl") != "kl"
    target = T * 2 * H * Vd + (T * 2 * H * V if full_vocab else 0)
    return {
        "terms": terms,
        "train_per_sample": 3 * forward,
        "target_per_sample": target,
        "train_per_token": 3 * forward / T,
        "drafter": {"hidden": H, "heads": h, "kv_heads": k, "head_dim": hd, "intermediate": inter, "draft_vocab": Vd},
        "drafter_matmul_params": fc_params + layer_params + H * Vd,
    }


def trainer_config(flags: str) -> TrainConfig:
    """TrainConfig from trainer flags, parsed by the trainer's own parser helpers. An option this trainer lacks is
    a ValueError (the phase's error), never an exit that would end the whole call."""
    parser = argparse.ArgumentParser(prog="trainer flags", add_help=False, exit_on_error=False)
    add_config_flags(parser, TrainConfig)
    args, unknown = parser.parse_known_args(shlex.split(flags))
    if unknown:
        raise ValueError(f"trainer options this trainer does not have: {' '.join(unknown)}")
    return config_from_args(TrainConfig, args)


def ensure_target(name: str) -> Path:
    """The shape's target directory: config.json and one safetensors file of random bf16 embedding and LM head
    (the embedding alone when tied) and a final norm of ones, drawn on the GPU when there is one."""
    shape, folder = SHAPES[name], TARGETS / name
    if (folder / "config.json").exists():  # written last: a folder with it is whole
        return folder
    text = shape.text
    V, H = text["vocab_size"], text["hidden_size"]
    g = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
    tensors = {
        f"{shape.prefix}model.embed_tokens.weight": mkmodel.random_bf16(g, V, H),
        f"{shape.prefix}model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
    }
    if not text["tie_word_embeddings"]:
        tensors[f"{shape.prefix}lm_head.weight"] = mkmodel.random_bf16(g, V, H)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(shape.config, indent=2))
    return folder


@functools.lru_cache(maxsize=1)
def target_head(folder: Path) -> torch.Tensor:
    """The target's LM head [V, H] as the trainer finds it (one shape's rows after another: kept for the next)."""
    return load_target_tensors(folder, ("lm_head",))["lm_head"]


@torch.no_grad()
def write_samples(folder: Path, text: dict, run_id: str, T: int, n: int, vocab: int) -> float:
    """``n`` samples of exactly ``T`` tokens in the store's format, registered as the run's ingested samples:
    input ids from ``vocab`` of the target's ids, the second half loss-masked, auxiliary states [T, 3H] random,
    final states [T, H] pointing the target's top token at the next input id. Returns the share of loss positions
    (up to 4,096 checked) where the target's top token over its full vocabulary is indeed the next input id."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(T)
    head = target_head(folder).to(device)
    keep = torch.randperm(text["vocab_size"], generator=g, device=device)[:vocab]
    layers = default_layer_ids(text["num_hidden_layers"])
    writer = SampleWriter(samples_dir(DATA, run_id))
    mask = (torch.arange(T, device=device) >= T // 2).to(torch.uint8)
    for i in range(n):
        ids = keep[torch.randint(len(keep), (T,), generator=g, device=device)]
        rows = head[torch.roll(ids, -1)].float()  # the next token's LM-head row at each position
        hidden = (rows * (TOP_LOGIT / rows.pow(2).sum(-1, keepdim=True))).to(torch.bfloat16)
        aux = torch.randn(T, 3 * text["hidden_size"], generator=g, device=device, dtype=torch.bfloat16)
        sample_id = f"s{i:03d}"
        writer.append(sample_id, ids.tolist(), mask.tolist())
        tensors = {"input_ids": ids.to(torch.int32), "loss_mask": mask, "hidden_states": hidden,
                   "aux_hidden_states": aux}  # fmt: skip
        write_sample(sample_path(DATA, run_id, sample_id), {k: v.cpu() for k, v in tensors.items()},
                     {"aux_layer_ids": json.dumps(layers)}, store_dtype="bf16")  # fmt: skip
    writer.close({"model": str(folder), "source": "bench/gpu/trainspeed.py: synthetic"})
    checked = slice(T // 2, min(T - 1, T // 2 + 4096))
    top = (hidden[checked] @ head.T).argmax(-1)
    return round((top == ids[checked.start + 1 : checked.stop + 1]).float().mean().item(), 4)


def step_clock(marks: list[tuple[float, int]]) -> Callable[[trainer.Session, trainer.data.Batch], None]:
    """The trainer's step hook that appends (time, tokens) to ``marks`` at the end of each optimizer step.
    ``train()`` reports tokens/s only to Redis and its log, over windows of ``log_every`` steps that do not start at
    the warm-up's end. The trainer's steps read nothing back from the GPU (the host queues the next one while it
    runs): the clock waits for the GPU only at the timed window's ends, the warm-up's last step and the last one,
    so the window is the GPU's real time and the steps between keep the trainer's overlap; the marks between are
    the host's."""

    def mark(s: trainer.Session, batch: trainer.data.Batch) -> None:
        if torch.cuda.is_available() and s.step in (WARMUP_STEPS, s.total):
            torch.cuda.synchronize()
        marks.append((time.perf_counter(), batch["input_ids"].shape[1]))  # a packed row's length: no GPU read

    return mark


def significant(x: float) -> float:
    """Four significant digits: an MFU on a GPU (0.3127) and on the CPU test's tiny shape (2.3e-07) alike."""
    return float(f"{x:.4g}")


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def memory() -> dict:
    """Torch's peak allocated and reserved GPU memory since the row's reset."""
    if not torch.cuda.is_available():
        return {"peak_allocated_GiB": None, "peak_reserved_GiB": None}
    return {"peak_allocated_GiB": gib(torch.cuda.max_memory_allocated()),
            "peak_reserved_GiB": gib(torch.cuda.max_memory_reserved())}  # fmt: skip


def oom_figures(e: torch.cuda.OutOfMemoryError) -> dict:
    """What an out-of-memory tried to allocate (its message) and what the allocator held when it was raised."""
    units = {"GiB": 1, "MiB": 2**-10, "KiB": 2**-20, "bytes": 2**-30}
    tried = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|bytes)", str(e))
    in_use = re.search(r"this process has ([\d.]+) (GiB|MiB|KiB|bytes) memory in use", str(e))
    cuda = torch.cuda.is_available()
    return {
        "outcome": "oom",
        "tried_to_allocate_GiB": round(float(tried[1]) * units[tried[2]], 2) if tried else None,
        "process_in_use_GiB": round(float(in_use[1]) * units[in_use[2]], 2) if in_use else None,
        "allocated_at_oom_GiB": gib(torch.cuda.memory_allocated()) if cuda else None,
        "reserved_at_oom_GiB": gib(torch.cuda.memory_reserved()) if cuda else None,
        "message": str(e)[:600],
        **memory(),
    }


def samples_for(text: dict, T: int) -> int:
    """Distinct samples of the row: one a step (one epoch) within the disk budget, at least MIN_SAMPLES."""
    return max(MIN_SAMPLES, min(STEPS, int(DISK_BUDGET_BYTES // sample_bytes(text, T))))


def sample_bytes(text: dict, T: int) -> int:
    return T * 4 * text["hidden_size"] * 2 + T * 5  # the states in bf16 [T, 4H]; the ids and the mask


def estimate_s(name: str, T: int, cfg: TrainConfig) -> float:
    """A row's wall time: the target (when not yet written), its samples, the trainer's start, the steps at the
    shape's known rate, FlexAttention's compile for a new head size, the final checkpoint."""
    shape = SHAPES[name]
    text = shape.text
    f = flops(text, cfg, T, False)
    target_bytes = (1 if text["tie_word_embeddings"] else 2) * text["vocab_size"] * text["hidden_size"] * 2
    new_target = not (TARGETS / name / "config.json").exists()
    write = samples_for(text, T) * sample_bytes(text, T) + CHECKPOINT_BYTES_PER_PARAM * f["drafter_matmul_params"]
    write += target_bytes if new_target else 0
    compile_s = COMPILE_S if torch.cuda.is_available() and f["drafter"]["head_dim"] not in COMPILED_HEAD_DIMS else 0
    compiled = compile_on(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    compile_s += STEP_COMPILE_S if compiled and name not in COMPILED_STEPS else 0
    rate = shape.tokens_per_s / (1 + RECOMPUTE * min(cfg.checkpoint_steps, cfg.ttt_steps) / cfg.ttt_steps)
    return (START_S + target_bytes / TARGET_LOAD_BYTES_PER_S + write / DISK_BYTES_PER_S + compile_s
            + (STEPS + FIRST_STEP) * T / rate)  # fmt: skip


def measure(name: str, T: int, cfg: TrainConfig, env: trainer.Dist) -> dict:
    """One row: the synthetic run written, the trainer on it, its speed and memory; the run removed behind it."""
    start = time.time()
    text = SHAPES[name].text
    folder = ensure_target(name)
    run_id = f"trainspeed-{name}-{T}"
    shutil.rmtree(run_dir(DATA, run_id), ignore_errors=True)  # a killed call's leftovers would be resumed from
    n = samples_for(text, T)
    row_cfg = replace(cfg, max_steps=STEPS, tokens_per_batch=T, max_len=T, heldout_fraction=0.0)
    _, oov = objective_options(row_cfg, env.device)
    f = flops(text, row_cfg, T, oov)
    rule = estimate(rule_shape(text, row_cfg), T, row_cfg)
    row = {"shape": name, "T": T, "samples": n, "steps": STEPS, "warmup_steps": WARMUP_STEPS, "oov_mask": oov,
           "flops": f, "rule_GiB": round(rule.total_gib, 2), "rule_terms_GiB": rule.terms_gib()}  # fmt: skip
    try:
        t = time.time()
        row["target_top_is_next_token"] = write_samples(folder, text, run_id, T, n, f["drafter"]["draft_vocab"])
        row["write_s"] = round(time.time() - t, 1)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the sample writer's tensors: out of the trainer's peak
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        marks: list[tuple[float, int]] = []
        try:
            train(redis=None, run_id=run_id, data_dir=DATA, target_dir=folder, cfg=row_cfg, env=env,
                  on_step=step_clock(marks))  # fmt: skip
        except torch.cuda.OutOfMemoryError as e:
            row.update(oom_figures(e), steps_done=len(marks))
        except MemoryRuleError as e:  # the trainer's own refusal, before its first step
            row.update(outcome="refused", message=str(e), **memory())
        row["train_wall_s"] = round(time.perf_counter() - t, 1)
        if "outcome" not in row:
            row.update(speed(marks, t, f), **memory())
    finally:
        shutil.rmtree(run_dir(DATA, run_id), ignore_errors=True)
        gc.collect()  # the failed step's frames hold its tensors until collected
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row["wall_s"] = round(time.time() - start, 1)  # beside estimated_s: how good the estimates are
    return row


def speed(marks: list[tuple[float, int]], start: float, f: dict) -> dict:
    """tokens/s and MFU over the timed steps (after the warm-up's last step), each step's time."""
    timed = marks[WARMUP_STEPS:]
    window = marks[-1][0] - marks[WARMUP_STEPS - 1][0]
    tokens = sum(n for _, n in timed)
    train_flops = f["train_per_sample"] * len(timed) / window
    return {
        "outcome": "measured",
        "tokens_per_s": round(tokens / window, 1),
        "timed_steps": len(timed),
        "timed_s": round(window, 3),
        "mfu": significant(train_flops / PEAK_FLOPS),
        "mfu_with_target": significant((train_flops + f["target_per_sample"] * len(timed) / window) / PEAK_FLOPS),
        "first_step_s": round(marks[0][0] - start, 2),  # the trainer's start, compile and the first step
        "step_s": [round(b[0] - a[0], 3) for a, b in zip(marks, marks[1:], strict=False)],
    }


def run_phase(phase: str, flags_env: str, lengths_env: str = "TRAINSPEED_LENGTHS") -> None:
    flags = os.environ.get(flags_env, "")
    lengths = lengths_from(lengths_env, ",".join(map(str, LENGTHS)))
    cfg = trainer_config(flags)
    if STEPS <= WARMUP_STEPS:
        raise ValueError(f"TRAINSPEED_STEPS ({STEPS}) must be more than the {WARMUP_STEPS} warm-up steps")
    R = P.RESULTS.setdefault(phase, {})
    for stale in ("error", "traceback", "skipped"):
        R.pop(stale, None)
    if R.get("flags") != flags:
        R["rows"] = []  # rows of other options do not compare
    env = init_distributed()
    # done: the runner keeps a finished phase's record between calls (phases.fresh), so rows of calls add up
    R.update(flags=flags, flags_env=flags_env, config=asdict(cfg), flops_formula=FLOPS_FORMULA,
             device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
             peak_flops=PEAK_FLOPS, done=True)  # fmt: skip
    for name in SHAPE_NAMES:
        stopped = None  # why the longer lengths are skipped: an out-of-memory, or the trainer's refusal
        for T in lengths:
            if stopped is not None:
                row = {"shape": name, "T": T, "outcome": "skipped", "why": stopped}
            elif (est := estimate_s(name, T, cfg)) > (left := time_left()):
                row = {"shape": name, "T": T, "outcome": "skipped", "why": f"estimated {est:.0f} s, {left:.0f} s left"}
            else:
                P.log(f"{phase}: {name} T={T} (estimated {est:.0f} s)")
                row = measure(name, T, cfg, env)
                remember_compiled(name, row, cfg)
                row["estimated_s"] = round(est)
                if row["outcome"] in ("oom", "refused"):
                    stopped = f"{'out of memory' if row['outcome'] == 'oom' else 'refused'} at {T} tokens"
                P.log(f"{phase}: {name} T={T}: {describe(row)}")
            keep(R["rows"], row)
            P.save(phase)
            write_table()


def run_compile_phase() -> None:
    """Compile off against on at the rows of TRAINSPEED_COMPILE_ROWS, in one call: off, on, off, on, ...
    TRAINSPEED_REPEATS times a row, so a drift of the machine (clocks, another tenant) falls on both alike. Each
    run is a row as ``measure`` makes it (the first of a process's compiled runs compiles in its warm-up steps,
    untimed); the record's ``summary`` gives each row and mode's median tokens/s, its spread and on's ratio to off."""
    flags = os.environ.get("TRAINSPEED_FLAGS", "")
    R = P.RESULTS["trainspeed-compile"] = {"flags": flags, "repeats": REPEATS, "runs": [], "summary": []}
    env = init_distributed()
    R.update(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", done=True)
    for name, T in COMPILE_ROWS:
        for repeat in range(REPEATS):
            for mode in ("off", "on"):
                cfg = trainer_config(f"{flags} --compile {mode}")
                if (est := estimate_s(name, T, cfg)) > (left := time_left()):
                    row = {
                        "shape": name,
                        "T": T,
                        "outcome": "skipped",
                        "why": f"estimated {est:.0f} s, {left:.0f} s left",
                    }
                else:
                    P.log(f"trainspeed-compile: {name} T={T} compile {mode} #{repeat + 1} (estimated {est:.0f} s)")
                    row = measure(name, T, cfg, env)
                    remember_compiled(name, row, cfg)
                    row["estimated_s"] = round(est)
                R["runs"].append({**row, "compile": mode, "repeat": repeat})
                R["summary"] = compile_summary(R["runs"])
                P.save("trainspeed-compile")
                write_table()


def remember_compiled(name: str, row: dict, cfg: TrainConfig) -> None:
    """What the row compiled, for the later rows' estimates: FlexAttention for its head size, the TTT step."""
    COMPILED_HEAD_DIMS.add(row["flops"]["drafter"]["head_dim"])
    if compile_on(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        COMPILED_STEPS.add(name)


def compile_summary(runs: list[dict]) -> list[dict]:
    """Per row: each mode's measured tokens/s (median, min, max, spread = (max - min) / median) and on / off."""
    out = []
    for name, T in dict.fromkeys((r["shape"], r["T"]) for r in runs):
        row: dict = {"shape": name, "T": T}
        for mode in ("off", "on"):
            key = (name, T, mode, "measured")
            speeds = sorted(r["tokens_per_s"] for r in runs if (r["shape"], r["T"], r["compile"], r["outcome"]) == key)
            if speeds:
                median = statistics.median(speeds)
                row[mode] = {"runs": len(speeds), "median": median, "min": speeds[0], "max": speeds[-1],
                             "spread": round((speeds[-1] - speeds[0]) / median, 4)}  # fmt: skip
        if "off" in row and "on" in row:
            row["on_over_off"] = round(row["on"]["median"] / row["off"]["median"], 3)
        out.append(row)
    return out


def keep(rows: list[dict], row: dict) -> None:
    """The row in place of an earlier one of its shape and length; a skip never replaces a measurement."""
    for i, old in enumerate(rows):
        if (old["shape"], old["T"]) == (row["shape"], row["T"]):
            if row["outcome"] != "skipped" or old["outcome"] == "skipped":
                rows[i] = row
            return
    rows.append(row)


def describe(row: dict) -> str:
    """The table's note: an OOM's figures, a skip's reason, the measured speed's MFU with the target's share."""
    if row["outcome"] == "oom":
        return (f"OOM: tried to allocate {row['tried_to_allocate_GiB']} GiB with {row['allocated_at_oom_GiB']} GiB "
                f"allocated ({row['process_in_use_GiB']} GiB in use)")  # fmt: skip
    if row["outcome"] == "skipped":
        return f"skipped: {row['why']}"
    if row["outcome"] == "refused":
        return f"refused by the trainer's memory rule ({row['rule_GiB']} GiB): {row['message'].split(': ', 1)[-1]}"
    return f"{row['samples']} samples; MFU {100 * row['mfu_with_target']:.1f} % with the target's projections"


def write_table() -> None:
    """$OUT/trainspeed.md: a table per phase run; trainspeed-b's notes give its ratio to trainspeed's row."""
    out = ["# eaglet trainer speed (bench/gpu/trainspeed.py)", ""]
    base = {(r["shape"], r["T"]): r for r in P.RESULTS.get("trainspeed", {}).get("rows", [])}
    for phase in PHASES:
        R = P.RESULTS.get(phase)
        if not R or not R.get("rows"):
            continue
        out += [
            f"## {phase}: trainer flags `{R['flags'] or '(defaults)'}` on {R['device']}",
            "",
            f"{STEPS} steps of one sample, {WARMUP_STEPS} untimed; MFU: the drafter's training FLOPs against "
            f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s, the target's no-grad projections not included (`flops_formula` in "
            f"{phase}.json).",
            "",
            "| shape | T | tokens/s | MFU | peak allocated GiB | reserved | rule GiB | note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in R["rows"]:
            measured = r["outcome"] == "measured"
            speed_cell, mfu_cell = (f"{r['tokens_per_s']:,.0f}", f"{100 * r['mfu']:.1f} %") if measured else ("-", "-")
            note = describe(r)
            b = base.get((r["shape"], r["T"]))
            if phase != "trainspeed" and measured and b and b["outcome"] == "measured":
                note += f"; x{r['tokens_per_s'] / b['tokens_per_s']:.2f} tokens/s vs trainspeed"
            peaks = " | ".join(str(r.get(k) or "-") for k in ("peak_allocated_GiB", "peak_reserved_GiB"))
            rule = r.get("rule_GiB", "-")
            out.append(f"| {r['shape']} | {r['T']:,} | {speed_cell} | {mfu_cell} | {peaks} | {rule} | {note} |")
        out.append("")
    out += compile_table(P.RESULTS.get("trainspeed-compile"))
    (P.OUT / "trainspeed.md").write_text("\n".join(out))


def compile_table(R: dict | None) -> list[str]:
    """trainspeed-compile's summary as a table: each mode's median tokens/s over its runs, their range, on / off."""
    if not R or not R.get("summary"):
        return []
    out = [f"## trainspeed-compile: `--compile off` against `on` on {R['device']}, trainer flags "
           f"`{R['flags'] or '(defaults)'}`, up to {R['repeats']} runs each, interleaved", "",
           "| shape | T | off tokens/s (median; min-max) | on tokens/s (median; min-max) | on / off |",
           "|---|---|---|---|---|"]  # fmt: skip

    def cell(m: dict | None) -> str:
        return f"{m['median']:,.0f}; {m['min']:,.0f}-{m['max']:,.0f} ({m['runs']})" if m else "-"

    for r in R["summary"]:
        ratio = f"x{r['on_over_off']:.2f}" if "on_over_off" in r else "-"
        out.append(f"| {r['shape']} | {r['T']:,} | {cell(r.get('off'))} | {cell(r.get('on'))} | {ratio} |")
    return [*out, ""]


def phase_estimate() -> float:
    """The phase starts when its first row fits; each row is checked again before it starts."""
    return estimate_s(SHAPE_NAMES[0], LENGTHS[0], TrainConfig())


PHASES: dict[str, Callable[[], None]] = {
    "trainspeed": functools.partial(run_phase, "trainspeed", "TRAINSPEED_FLAGS"),
    "trainspeed-b": functools.partial(run_phase, "trainspeed-b", "TRAINSPEED_FLAGS_B", "TRAINSPEED_LENGTHS_B"),
    "trainspeed-compile": run_compile_phase,
}
ESTIMATE_S = {phase: phase_estimate for phase in PHASES}

if __name__ == "__main__":
    setup_logging()
    from bench.gpu import phases

    raise SystemExit(P.main({**phases.PHASES, **PHASES}, {**phases.ESTIMATE_S, **ESTIMATE_S}))
