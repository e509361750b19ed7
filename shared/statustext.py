"""The status figures in words a person reads: one brief line per run, a verdict, and a line per stage.

Computed once, beside the figures (``shared/status.py`` calls ``describe``), so ``/status``, the page and
``eaglet status`` say the same thing the same way: durations and clock times instead of unix seconds, rates and
losses to three significant digits, a finished stage by what it did (its wall time and mean rates), a stage a run
does not have left out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .records import ACTIVE_STAGES, TRAINER_STAGES, EvalResult, GpuRole, RunMeta, Stage, TrainProgress

if TYPE_CHECKING:
    from .statusreport import Cluster, Extraction, GpuHostStatus, Regeneration, RunStatus, Storage

BRIEF_REASON_CHARS = 120
"""A failure's reason is cut to this in the brief line: the whole of it is in the run's ``error``."""


def count(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def figure(x: float | None) -> str:
    """Three significant digits, thousands separators from 1,000 on: 2,582 · 12.3 · 1.09 · 0.153."""
    if x is None:
        return "–"
    magnitude = abs(x)
    if magnitude >= 100:
        return f"{x:,.0f}"
    if magnitude >= 10:
        return f"{x:.1f}"
    if magnitude >= 1:
        return f"{x:.2f}"
    return "0" if x == 0 else f"{x:.3g}"


def percent(p: float | None) -> str:
    """34.5 % · 0.02 %; a stage short of its end never reads 100 %."""
    if p is None:
        return "–"
    if p >= 100:
        return "100 %"
    if p >= 1:
        return f"{min(p, 99.9):.1f} %"
    return "0 %" if p <= 0 else f"{p:.1g} %"


def size(n: float | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def duration(s: float | None) -> str:
    """2 d 3 h · 6 h 12 min · 24 min · 4 min 10 s · 45 s · 0.4 s."""
    if s is None:
        return "–"
    if s < 10:
        return f"{s:.1f} s"
    s = round(s)
    days, rest = divmod(s, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    if minutes >= 10:  # past ten minutes the seconds are noise
        return f"{minutes} min"
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def clock(ts: float | None, now: float) -> str:
    """A moment as a clock time (this machine's zone), with the date when it is not today's."""
    if ts is None:
        return "–"
    moment, today = time.localtime(ts), time.localtime(now)
    same_day = moment[:3] == today[:3]
    return time.strftime("%H:%M:%S" if same_day else "%b %d %H:%M", moment)


def describe(
    run: RunStatus,
    meta: RunMeta,
    progress: TrainProgress,
    evaluation: EvalResult,
    cluster: Cluster,
    now: float,
    earlier: Sequence[EvalResult] = (),
) -> tuple[str, str, dict[str, str]]:
    """The run's verdict, its brief line, and a line per stage it has, by stage name."""
    verdict = _verdict(run, now)
    lines: dict[str, str] = {}
    if run.regeneration is not None:
        lines["regeneration"] = _regeneration(run.regeneration, now)
    if _has_extraction(run, meta):
        lines["extraction"] = _extraction(run.extraction, now)
        lines["storage"] = _storage(run.storage)
    if progress.step is not None or run.stage in TRAINER_STAGES:
        lines["training"] = _training(run, progress)
    if evaluation.state is not None:
        lines["evaluation"] = _evaluation(evaluation)
        if done := [e for e in earlier if e.state == "done"]:
            more = f" and {len(done) - 3} more" if len(done) > 3 else ""
            lines["evaluation"] += " · earlier: " + ", ".join(_earlier(e) for e in done[:3]) + more
    return verdict, _brief(run, meta, progress, evaluation, verdict, cluster, now), lines


def _has_extraction(run: RunStatus, meta: RunMeta) -> bool:
    """A run that only regenerates (``stop_after``) never ingests: it has no extraction to show."""
    return meta.extraction_started_at is not None or meta.total is not None or run.stage not in (
        Stage.regenerating, Stage.done, Stage.failed, Stage.cancelled
    )  # fmt: skip


def _verdict(run: RunStatus, now: float) -> str:
    """One word or a few: running, stalled for N min, waiting for GPUs, training, done, failed: reason."""
    if run.stage == Stage.failed:
        return f"failed: {_cut(run.error or 'no reason recorded')}"
    if run.stage in (Stage.done, Stage.cancelled):
        return str(run.stage)
    regenerating = run.stage == Stage.regenerating and run.regeneration is not None
    stalled = run.regeneration.stalled_since if regenerating and run.regeneration else run.extraction.stalled_since
    if run.stage in ACTIVE_STAGES and stalled is not None:
        return f"stalled for {duration(now - stalled)} (nothing finished since {clock(stalled, now)})"
    if any(a.kind == "trainer_lost" for a in run.alerts):
        if run.training.evaluation_attempts == 0:
            return "waiting for the evaluation service"
        return "stalled: the " + ("evaluator" if run.training.evaluation_attempts else "trainer") + " is lost"
    return {
        Stage.extracted: "extracted, waiting for the trainer",
        Stage.waiting_for_gpus: "waiting for GPUs",
        Stage.training: "training",
        Stage.evaluating: "evaluating",
    }.get(run.stage, "running")


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= BRIEF_REASON_CHARS else text[: BRIEF_REASON_CHARS - 1] + "…"


def _errors(errors: int, attempts: int) -> str:
    """Errors (transient ones included) and their share of the attempts."""
    if not errors:
        return "no errors"
    return f"{count(errors)} error{'s' if errors != 1 else ''} ({percent(100 * errors / max(attempts, errors))})"


def _eta(eta_s: float | None, stalled_since: float | None) -> str:
    if stalled_since is not None:
        return "ETA withheld (stalled)"
    return "ETA –" if eta_s is None else f"ETA ~{duration(eta_s)}"


def _regeneration(rg: Regeneration, now: float) -> str:
    if rg.completed_at is not None:
        return (
            f"{count(rg.done)} prompts regenerated in {duration(rg.wall_s)} ({figure(rg.mean_prompts_per_s)} prompts/s,"
            f" {figure(rg.mean_tokens_out_per_s)} tokens/s out on average) · {count(rg.failed)} failed · tokens in "
            f"{count(rg.tokens_in)}, out {count(rg.tokens_out)} · {count(rg.retries)} retries · finished "
            f"{clock(rg.completed_at, now)}"
        )
    return (
        f"{count(rg.done)} done, {count(rg.failed)} failed of {count(rg.total)} prompts ({percent(rg.percent)}) · "
        f"{figure(rg.prompts_per_s)} prompts/s, {figure(rg.tokens_out_per_s)} tokens/s out · "
        f"{_eta(rg.eta_s, rg.stalled_since)} · tokens in {count(rg.tokens_in)}, out {count(rg.tokens_out)} · "
        f"{count(rg.retries)} retries"
    )


def _extraction(ex: Extraction, now: float) -> str:
    errors = f"{_errors(ex.errors, ex.done + ex.errors)}, {count(ex.retries)} retries"
    if ex.completed_at is not None:
        return (
            f"{count(ex.done)} done, {count(ex.failed)} failed of {count(ex.total)} in {duration(ex.wall_s)} "
            f"({figure(ex.mean_samples_per_s)} samples/s, {figure(ex.mean_tokens_per_s)} tokens/s on average) · "
            f"{errors} · finished {clock(ex.completed_at, now)}"
        )
    total = count(ex.total) if ex.total is not None else "? (ingest still counting)"
    return (
        f"{count(ex.done)} done, {count(ex.failed)} failed of {total} ({percent(ex.percent)}) · "
        f"{count(ex.in_flight)} in flight · {figure(ex.samples_per_s)} samples/s, {figure(ex.tokens_per_s)} tokens/s · "
        f"{_eta(ex.eta_s, ex.stalled_since)} · {errors}"
    )


def _storage(st: Storage) -> str:
    per_token = f" ({size(st.bytes_per_token)}/token)" if st.bytes_per_token is not None else ""
    free = f"{size(st.disk_free)} free of {size(st.disk_total)}" if st.disk_free is not None else "free space unknown"
    projected = ""
    if st.projected_remaining_bytes:  # nothing left to write: the projection is what was written
        projected = f" · projected {size(st.projected_total_bytes)}"
    return f"{size(st.bytes_written)} written, {count(st.tokens_written)} tokens{per_token}{projected} · {free}"


def _training(run: RunStatus, progress: TrainProgress) -> str:
    tr = run.training
    if tr.step is None:
        return "waiting for GPUs" if run.stage == Stage.waiting_for_gpus else "waiting for the trainer"
    accuracy = f"accuracy {percent(100 * tr.accuracy)} (first position)" if tr.accuracy is not None else ""
    figures = " · ".join(filter(None, (f"loss {figure(tr.loss)}", accuracy)))
    if progress.finished_at is not None and progress.started_at is not None:
        heldout = f" · held-out loss {figure(progress.heldout_loss)}" if progress.heldout_loss is not None else ""
        chosen = f" · exported the drafter of {tr.selection}" if tr.selection else ""
        return (
            f"{count(tr.step)} steps in {duration(progress.finished_at - progress.started_at)} · final {figures}"
            f"{heldout}{chosen}"
        )
    if tr.state == "failed":
        return f"stopped at step {count(tr.step)} of {count(tr.total_steps)} · {figures}"
    tokens = f" · {figure(tr.tokens_per_s)} tokens/s" if tr.tokens_per_s is not None else ""
    checkpoint = f" · checkpoint {tr.last_checkpoint}" if tr.last_checkpoint else ""
    return (
        f"step {count(tr.step)} / {count(tr.total_steps)} ({percent(tr.percent)}) · {figures}{tokens} · "
        f"ETA ~{duration(tr.eta_s)}{checkpoint}"
    )


def _earlier(ev: EvalResult) -> str:
    quantized = f", {ev.target_quantization} target" if ev.target_quantization else ""
    return f"{figure(ev.accept_length)} ({ev.engine or 'reference'}{quantized})"


def _evaluation(ev: EvalResult) -> str:
    if ev.state == "failed":
        return f"failed: {ev.error or 'no reason recorded'}"
    quantized = f" ({ev.target_quantization} target)" if ev.target_quantization else ""
    served = f" in {ev.engine}{quantized}" if ev.engine not in (None, "reference") else ""
    on = f"at k {count(ev.k)} on {count(ev.prompts)} held-out prompts{served}"
    if ev.state != "done":
        done = f"{count(ev.prompts_done or 0)} / {count(ev.prompts)} prompts"
        so_far = f", accept length {figure(ev.accept_length)} so far" if ev.accept_length is not None else ""
        return f"evaluating {on}: {done}{so_far}"
    equal = (
        "outputs equal to plain greedy"
        if ev.mismatches == 0
        else f"{count(ev.mismatches)} outputs differ from plain greedy"
    )
    speed = f", {ev.speedup:.2f}× the target's speed here" if ev.speedup is not None else ""
    predicted = (
        f" (predicted {figure(ev.predicted_accept_length)} from held-out accuracy)"
        if ev.predicted_accept_length is not None
        else ""
    )
    return f"accept length {figure(ev.accept_length)}{predicted} {on}, {equal}{speed}"


def _brief(
    run: RunStatus,
    meta: RunMeta,
    progress: TrainProgress,
    evaluation: EvalResult,
    verdict: str,
    cluster: Cluster,
    now: float,
) -> str:
    """``12,880 / 37,312 samples — 34.5 % done · 1.09 samples/s, 2,582 tok/s · 3 errors (0.02 %) · disk 1.6 TB
    used, 9.4 TB free · ETA ~6 h 12 min · GPUs … · running``: the stage the run is in, then its verdict."""
    ex, st, tr, rg = run.extraction, run.storage, run.training, run.regeneration
    parts = [f"{run.run_id}:"]
    if run.stage == Stage.regenerating and rg is not None:
        parts[0] += f" {count(rg.done)} / {count(rg.total)} prompts regenerated — {percent(rg.percent)} done"
        parts += [f"{figure(rg.prompts_per_s)} prompts/s, {figure(rg.tokens_out_per_s)} tok/s out",
                  _errors(rg.failed, rg.done + rg.failed), _eta(rg.eta_s, rg.stalled_since)]  # fmt: skip
    elif run.stage in ACTIVE_STAGES:
        if ex.total is None:  # the ingest still streams samples in: no share of a whole not counted yet
            parts[0] += f" {count(ex.done)} samples so far, the total still being ingested"
        else:
            parts[0] += f" {count(ex.done)} / {count(ex.total)} samples — {percent(ex.percent)} done"
        parts += [f"{figure(ex.samples_per_s)} samples/s, {figure(ex.tokens_per_s)} tok/s",
                  _errors(ex.errors, ex.done + ex.errors), _disk(st), _eta(ex.eta_s, ex.stalled_since)]  # fmt: skip
    elif run.stage == Stage.evaluating:
        trained = f"{count(tr.step)} steps trained" if tr.step is not None else "trained"
        parts[0] += f" {trained}; " + (_evaluation(evaluation) if evaluation.state else "the evaluation starts")
    elif run.stage in TRAINER_STAGES and tr.step is not None:
        parts[0] += f" step {count(tr.step)} / {count(tr.total_steps)} — {percent(tr.percent)} trained"
        parts += [f"loss {figure(tr.loss)}"]
        if tr.tokens_per_s is not None:
            parts.append(f"{figure(tr.tokens_per_s)} tok/s")
        parts.append(f"ETA ~{duration(tr.eta_s)}")
    else:  # between stages, or finished: what it did
        parts[0] += " " + _totals(run, meta, progress, evaluation)
        if _has_extraction(run, meta) and run.stage not in (Stage.done, Stage.cancelled, Stage.failed):
            parts.append(_disk(st))
    gpus = _gpus(run, cluster)
    if gpus:
        parts.append(gpus)
    parts.append(verdict)
    return " · ".join(parts)


def _totals(run: RunStatus, meta: RunMeta, progress: TrainProgress, evaluation: EvalResult) -> str:
    done = []
    rg, ex = run.regeneration, run.extraction
    if rg is not None and rg.completed_at is not None:
        done.append(f"{count(rg.done)} prompts regenerated in {duration(rg.wall_s)}")
    if ex.completed_at is not None:
        failed = f" ({count(ex.failed)} failed)" if ex.failed else ""
        done.append(f"{count(ex.done)} samples extracted{failed} in {duration(ex.wall_s)}")
    elif _has_extraction(run, meta):
        done.append(f"{count(ex.done)} / {count(ex.total)} samples extracted")
    if progress.finished_at is not None and progress.started_at is not None:
        done.append(f"{count(progress.step)} steps trained in {duration(progress.finished_at - progress.started_at)}")
    if evaluation.state == "done":
        done.append(f"accept length {figure(evaluation.accept_length)}")
    return ", ".join(done) or "nothing done yet"


def _disk(st: Storage) -> str:
    free = f", {size(st.disk_free)} free" if st.disk_free is not None else ""
    return f"disk {size(st.bytes_written)} used{free}"


def _gpus(run: RunStatus, cluster: Cluster) -> str:
    """The GPUs working for the run now: the inference hosts' while it regenerates or extracts, its trainer's while
    it trains; nothing once it is finished."""
    if run.stage in ACTIVE_STAGES:
        hosts = [h for h in cluster.gpus if h.live and h.role == GpuRole.inference]
    elif run.stage in TRAINER_STAGES:
        hosts = [h for h in cluster.gpus if h.live and h.role == GpuRole.trainer and h.run == run.run_id]
    else:
        return ""
    return gpu_summary(hosts) if hosts else "GPUs: no report"


def gpu_summary(hosts: list[GpuHostStatus]) -> str:
    """``GPUs 8 × 97 % busy, 1.0 / 1.1 TB``: the mean utilization and the memory of the GPUs the hosts read;
    ``GPUs unknown (no NVML here)`` where none could be read."""
    gpus = [g for h in hosts if h.gpus is not None for g in h.gpus]
    if not gpus:
        reasons = sorted({h.detail.split(" (")[0] for h in hosts if h.gpus is None})  # the words, not the driver's
        return "GPUs: none in use" if not reasons else f"GPUs unknown ({'; '.join(reasons)})"
    used = [g.utilization for g in gpus if g.utilization is not None]
    busy = f"{percent(sum(used) / len(used)) if used else '?'} busy"
    memory = f"{size(sum(g.memory_used or 0 for g in gpus))} / {size(sum(g.memory_total or 0 for g in gpus))}"
    return f"GPUs {len(gpus)} × {busy}, {memory}"
