"""The trainer's memory at one training step, accounted for on any machine (no GPU): every tensor the step
allocates at a real target shape and sample length, on fake tensors (no memory behind them), under bf16 autocast
as on the GPU, with FlexAttention's fused kernel standing in by what it allocates.

    .venv/bin/python -m bench.gpu.trainmem [--shapes kimi,l8b] [--lengths 2048,32768] [--flags "--checkpoint-steps 7"]

Per (shape, length, trainer flags): the peak of the live bytes, what was live at the peak grouped by kind (each
shape written in the drafter's symbols: T tokens, H hidden, I intermediate, Vd draft vocabulary, ...), the largest
single allocations, and the memory rule's estimate (the trainer's memory.py) beside it. The step is the
trainer's own objective and optimizer: forward, backward, gradient clipping and the optimizer's step, one packed
row of T tokens, every position a loss position (the rule's worst case), the next batch already on the device
(the trainer copies it during the step). Results: --out (default results/cpu-trainmem.json).

What it does not see: the CUDA caching allocator's rounding and fragmentation (the rule's margin covers them),
the compiled kernels' own scratch memory, and NCCL's buffers across processes.
"""

import argparse
import gc
import json
import shlex
import time
from collections import Counter
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.gpu.trainshapes import TEXT
from eaglet.services.trainer import data
from eaglet.services.trainer.config import TrainConfig
from eaglet.services.trainer.main import add_config_flags, config_from_args
from eaglet.services.trainer.memory import MemoryTracker, estimate, rule_shape
from eaglet.services.trainer.model import CausalAttention, Drafter
from eaglet.services.trainer.objective import TTTObjective
from eaglet.services.trainer.optimizer import build_optimizer
from eaglet.services.trainer.train import optimizer_step

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


class FusedAttention(torch.autograd.Function):
    """What the compiled FlexAttention kernel allocates and keeps: its output and log-sum-exp, its inputs and
    outputs saved for the backward pass, which allocates the inputs' gradients and a [B, h, T] float32 buffer."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, _, lse = ctx.saved_tensors
        torch.empty_like(lse)  # the kernel's row sums of grad_out * out
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def fused(self: CausalAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return FusedAttention.apply(q, k, v)


def trainer_config(flags: str) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="trainer flags", add_help=False)
    add_config_flags(parser, TrainConfig)
    return config_from_args(TrainConfig, parser.parse_args(shlex.split(flags)))


def host_batch(T: int, cfg: TrainConfig, documents: list[int] | None = None, loss_share: float = 1.0) -> dict:
    """The host side of one packed row of T tokens (``documents``: their lengths, one document by default), the last
    ``loss_share`` of its positions loss positions, every one by default (the loss rows: real tensors, small)."""
    lengths = torch.tensor(documents or [T])
    mask = torch.arange(T)[None] >= round(T * (1 - loss_share))
    ids = torch.arange(len(lengths), dtype=torch.int32).repeat_interleave(lengths)[None]
    rows, counts = data.ttt_rows(mask, ids, cfg.ttt_steps)
    positions = torch.arange(T) - (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths)
    return {"loss_mask": mask, "position_ids": positions[None], "document_ids": ids, "loss_rows": rows,
            "loss_row_counts": counts}  # fmt: skip


INPUTS = ("input_ids", "loss_mask", "hidden_states", "aux_hidden_states", "topk_ids", "topk_logp", "position_ids",
          "document_ids", "loss_rows", "loss_row_counts")  # fmt: skip


def build(text: dict, host: dict, cfg: TrainConfig, device: str, attention: str) -> tuple:
    """The trainer's objective and optimizer at the target shape ``text`` (random weights, the frozen tensors in
    bf16 as the trainer holds them on a GPU) and a batch (``host_batch``'s row and random states), on ``device``
    (inside a FakeTensorMode: no memory behind it). Returns (objective, optimizer, the objective's inputs, the
    next batch)."""
    shape = rule_shape(text, cfg)
    V, H, Vd = shape.vocab_size, shape.hidden_size, shape.draft_vocab_size
    T = host["loss_mask"].shape[1]
    with torch.device(device):
        drafter = Drafter(shape, torch.randn(V, H, dtype=torch.bfloat16))
        objective = TTTObjective(drafter, torch.randn(V, H, dtype=torch.bfloat16), cfg, attention, oov=True)
        objective.set_vocab(torch.arange(Vd))
        b = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in host.items()}
        b["input_ids"] = torch.randint(0, Vd, (1, T))
        b["hidden_states"] = torch.randn(1, T, H, dtype=torch.bfloat16)
        b["aux_hidden_states"] = torch.randn(1, T, shape.num_aux_hidden_states * shape.target_hidden_size,
                                             dtype=torch.bfloat16)  # fmt: skip
    ahead = [torch.empty_like(v) for v in b.values() if isinstance(v, torch.Tensor)]
    opt = build_optimizer(cfg.optimizer, drafter, cfg.lr, cfg.weight_decay)
    return objective, opt, [b.get(k) for k in INPUTS], ahead


def step(objective: TTTObjective, opt: torch.optim.Optimizer, inputs: list, cfg: TrainConfig) -> torch.Tensor:
    """One training step, the trainer's own (``optimizer_step``), under bf16 autocast as on the GPU."""
    loss, *_ = optimizer_step(objective, objective.drafter, opt, tuple(inputs), cfg.grad_clip, bf16=True)
    return loss.detach()


def account(text: dict, T: int, cfg: TrainConfig, loss_share: float = 1.0) -> MemoryTracker:
    """The tracker after the second of two training steps (the first makes the gradients and the optimizer's
    state, which a long run's steps all hold) at the target shape ``text`` on one row of T tokens, the last
    ``loss_share`` of them loss positions."""
    tracker = MemoryTracker()
    host = host_batch(T, cfg, loss_share=loss_share)
    real_call = CausalAttention.__call__
    CausalAttention.__call__ = fused
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            objective, opt, inputs, ahead = build(text, host, cfg, "cpu", "flex")
            with tracker:
                tracker.hold([*objective.parameters(), *objective.buffers(), *inputs, *ahead])
                tracker.phase = "first step"
                step(objective, opt, inputs, cfg)
                tracker.reset_peak()
                tracker.phase = "step"
                step(objective, opt, inputs, cfg)
    finally:
        CausalAttention.__call__ = real_call
    return tracker


def on_gpu(text: dict, T: int, cfg: TrainConfig) -> dict:
    """The same two steps on the GPU, for real (FlexAttention compiled): torch's peak allocated and reserved
    memory over the second step, its time, or the out-of-memory."""
    gc.collect()
    torch.cuda.empty_cache()
    try:
        objective, opt, inputs, _ = build(text, host_batch(T, cfg), cfg, "cuda", "flex")
        step(objective, opt, inputs, cfg)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        step(objective, opt, inputs, cfg)
        torch.cuda.synchronize()
        took = time.perf_counter() - started
        return {"outcome": "measured", "peak_allocated_GiB": round(torch.cuda.max_memory_allocated() / GIB, 2),
                "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / GIB, 2), "step_s": round(took, 3),
                "tokens_per_s": round(T / took)}  # fmt: skip
    except torch.cuda.OutOfMemoryError as e:
        return {"outcome": "oom", "message": str(e)[:300]}


def check_flex() -> dict:
    """Compiled FlexAttention on the GPU against the math path, float32, one packed row of three documents: the
    loss and every gradient, their largest difference relative to the gradient's scale."""
    text = {**TEXT["tiny"], "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 1024, "vocab_size": 4096}  # fmt: skip
    cfg = TrainConfig(draft_vocab_size=1024)
    results = {}
    for attention in ("flex", "math"):
        torch.manual_seed(0)
        objective, _, inputs, _ = build(text, host_batch(2048, cfg, [300, 700, 1048]), cfg, "cuda", attention)
        objective.float()
        inputs = [x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
        loss, _, _ = objective(*inputs)
        loss.backward()
        results[attention] = (loss.item(), {n: p.grad for n, p in objective.named_parameters()})
    (flex_loss, flex), (math_loss, reference) = results["flex"], results["math"]
    worst = max(((flex[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in reference.items())
    return {"loss_flex": flex_loss, "loss_math": math_loss, "grad_max_relative_difference": worst}


def symbols(text: dict, T: int, cfg: TrainConfig) -> dict[int, str]:
    """Dimension sizes to the drafter's symbols; where two coincide both names (Kimi: H|h*d, and T|Vd at 32 K)."""
    s = rule_shape(text, cfg)
    named = [(T, "T"), (T - 1, "T"), (s.hidden_size, "H"), (2 * s.hidden_size, "2H"), (s.intermediate_size, "I"),
             (s.num_aux_hidden_states * s.target_hidden_size, "3Ht"), (s.vocab_size, "V"),
             (s.draft_vocab_size, "Vd"), (s.num_attention_heads, "h"), (s.num_key_value_heads, "kv"),
             (s.head_dim, "d"), (s.num_attention_heads * s.head_dim, "h*d"),
             (s.num_key_value_heads * s.head_dim, "kv*d"), (cfg.loss_chunk, "C"),
             (s.num_attention_heads // s.num_key_value_heads, "h/kv")]  # fmt: skip
    named += [(T - i, "T") for i in range(2, cfg.ttt_steps + 2)]  # the rows of step i: T - 2 - i loss positions
    out: dict[int, str] = {}
    for n, name in named:
        if name not in out.get(n, "").split("|"):
            out[n] = f"{out[n]}|{name}" if n in out else name
    return out


def describe(tracker: MemoryTracker, names: dict[int, str]) -> list[dict]:
    """What was live at the peak, grouped by (phase, op, symbolic shape, dtype), biggest first."""
    groups: Counter = Counter()
    counts: Counter = Counter()
    for a in tracker.at_peak:
        dims = "[" + ", ".join(names.get(x, str(x)) for x in a.shape if x != 1) + "]"
        key = (a.phase, a.op, dims, str(a.dtype).removeprefix("torch."))
        groups[key] += a.nbytes
        counts[key] += 1
    return [{"phase": k[0], "op": k[1], "shape": k[2], "dtype": k[3], "count": counts[k], "GiB": round(n / GIB, 3)}
            for k, n in groups.most_common() if n >= tracker.peak / 400]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="kimi,l8b,smol")
    parser.add_argument("--lengths", default="2048,8192,32768,65536")
    parser.add_argument("--flags", action="append", help="trainer flags of a configuration (repeatable)")
    parser.add_argument("--gpu", action="store_true", help="also run each row's steps on the GPU, for real")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "cpu-trainmem.json")
    args = parser.parse_args()
    rows = []
    record: dict = {"command": "bench/gpu/trainmem.py", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                    "rows": rows}  # fmt: skip
    if args.gpu:
        record["flex_vs_math"] = check_flex()
        print("flex vs math:", record["flex_vs_math"], flush=True)
    for flags in args.flags or ["", "--checkpoint-steps 7"]:
        cfg = trainer_config(flags)
        for name in args.shapes.split(","):
            for T in (int(x) for x in args.lengths.split(",")):
                started = time.time()
                tracker = account(TEXT[name], T, cfg)
                rule = estimate(rule_shape(TEXT[name], cfg), T, cfg)
                largest = [{"op": a.op, "shape": list(a.shape), "dtype": str(a.dtype), "phase": a.phase,
                            "GiB": round(a.nbytes / GIB, 3)} for a in tracker.largest(5)]  # fmt: skip
                row = {"shape": name, "T": T, "flags": flags, "peak_GiB": round(tracker.peak / GIB, 2),
                       "rule_GiB": round(rule.total_gib, 2), "rule_terms_GiB": rule.terms_gib(),
                       "at_peak": describe(tracker, symbols(TEXT[name], T, cfg)), "largest": largest,
                       "accounted_s": round(time.time() - started, 1)}  # fmt: skip
                if args.gpu:
                    row["gpu"] = on_gpu(TEXT[name], T, cfg)
                rows.append(row)
                big = largest[0]
                print(f"{name} T={T} {flags or '(defaults)'}: peak {row['peak_GiB']} GiB, rule {row['rule_GiB']} "
                      f"GiB; largest {big['shape']} {big['dtype']} {big['GiB']} GiB; {row.get('gpu', '')}",
                      flush=True)  # fmt: skip
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
