"""The thresholds of the status figures and the rules that raise a run's alerts (stalled, workers or trainer lost,
disk, error rate, served acceptance far below its prediction) from its figures."""

from dataclasses import dataclass

from .acceptance import LIKELY_CAUSES, SERVED_FLOOR, served_shortfall
from .records import (
    ACTIVE_STAGES,
    HEARTBEAT_INTERVAL_S,
    LOST_AFTER_BEATS,
    TRAINER_STAGES,
    Stage,
    WorkerRole,
)
from .statusreport import Alert, Cluster, Extraction, RunStatus, Training
from .statustext import duration


@dataclass(kw_only=True, slots=True)
class StatusConfig:
    """Thresholds of the figures and alerts. Built from settings by the entry points."""

    window_s: float = 60.0
    """Rates (samples/s, tokens/s) and the recent error rate are taken over this many seconds."""
    stall_factor: float = 5.0
    """Stalled: no completion for this many times the usual interval between completions..."""
    stall_min_s: float = 60.0
    """...and never for less than this (a run of a few slow samples is not stalled)."""
    lost_after_s: float = LOST_AFTER_BEATS * HEARTBEAT_INTERVAL_S
    """A worker whose heartbeat is older than this is lost (a few heartbeat intervals)."""
    forget_after_s: float = 300.0
    """A worker, server or GPU report silent for this long past ``lost_after_s`` leaves the tables (a dead worker is
    then only counted, in ``workers_gone``): what died minutes ago is the run's history, not its present."""
    eta_hold_min_s: float = 15.0
    """The ETA is withheld (the run is stalled) while no completion came for ``stall_factor`` times the usual
    interval, and never sooner than this or ``stall_min_s``: a batching server finishes many samples at once, then
    none for a few seconds. The stalled alert waits for ``stall_min_s``."""
    error_rate_threshold: float = 0.05
    """Alert when the share of failed attempts goes above this."""
    error_rate_min_attempts: int = 10
    """...once at least this many attempts were made: two errors in the first three samples are noise."""
    last_errors: int = 10
    """How many of the newest errors each run shows."""

    def __post_init__(self):
        for name in ("window_s", "stall_factor", "stall_min_s", "lost_after_s", "forget_after_s", "eta_hold_min_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"status config {name}={getattr(self, name)}: must be > 0")
        if not 0 <= self.error_rate_threshold <= 1:
            raise ValueError(f"error_rate_threshold={self.error_rate_threshold}: give a share between 0 and 1")


def usual_interval(completions: list[tuple[float, int, int]], n: int = 100) -> float | None:
    """Mean time between the newest ``n`` completions: what "no completion for a while" is judged against."""
    newest = completions[:n]
    if len(newest) < 2:
        return None
    return (newest[0][0] - newest[-1][0]) / (len(newest) - 1)


def _lost_message(stage: Stage, tr: Training, age: str) -> str:
    """Whose heartbeat is missing: the trainer's, or the evaluation service's once the trainer left it the run."""
    if tr.evaluation_attempts == 0:
        return f"the run waits for the evaluation service, which has not claimed it ({age}): start the evaluator"
    if tr.evaluation_attempts is not None:
        return (f"the evaluation service is evaluating but has {age}: it died or hangs; another evaluator claims the "
                f"run once its lock expires (attempt {tr.evaluation_attempts} so far)")  # fmt: skip
    resume = f" (it resumes from {tr.last_checkpoint})" if tr.last_checkpoint else ""
    return f"the trainer is {stage} but has {age}: it died or hangs; start it again{resume}"


def run_alerts(
    run: RunStatus, completions: list[tuple[float, int, int]], cluster: Cluster, config: StatusConfig, now: float
) -> list[Alert]:
    """``completions``: those of the run's current stage (answered prompts while it regenerates, else samples)."""
    alerts = []
    ex, rg = run.extraction, run.regeneration
    regenerating = run.stage == Stage.regenerating and rg is not None and rg.remaining != 0
    extracting = run.stage in ACTIVE_STAGES and ex.remaining != 0 and run.stage != Stage.regenerating
    if regenerating and rg is not None:
        usual = usual_interval(completions)
        since = rg.last_done_at or rg.started_at or run.created_at or now
        limit = stall_limit(usual, config)
        if now - since > limit:
            alerts.append(Alert(kind="stalled", message=(
                f"no prompt regenerated for {duration(now - since)} (limit {duration(limit)})")))  # fmt: skip
    if extracting:
        usual = usual_interval(completions)
        since = ex.last_done_at or ex.started_at or run.created_at or now
        limit = stall_limit(usual, config)
        if now - since > limit:
            hint = "" if ex.total is not None else (
                f"; its ingest has not finished: if the process running `eaglet ingest` died, "
                f"`eaglet ingest --run {run.run_id} --resume` takes it up where it last flushed")  # fmt: skip
            alerts.append(Alert(kind="stalled", message=(
                f"no sample completed for {duration(now - since)} (limit {duration(limit)}){hint}")))  # fmt: skip
    if run.stage in ACTIVE_STAGES:
        lost = [w.name for w in cluster.workers if w.lost and w.run in ("", run.run_id)]
        if lost:
            alerts.append(Alert(kind="workers_lost", message=f"{len(lost)} worker(s) lost: {', '.join(lost[:8])}"))
        elif (extracting or regenerating) and not any(
            w.role == WorkerRole.extractor and not w.lost for w in cluster.workers
        ):
            alerts.append(Alert(kind="workers_lost", message="no live worker: start extractor workers"))
    tr = run.training
    if run.stage in TRAINER_STAGES and (tr.seconds_since_beat is None or tr.seconds_since_beat > config.lost_after_s):
        age = "no heartbeat" if tr.seconds_since_beat is None else f"heartbeat {tr.seconds_since_beat:.0f} s old"
        alerts.append(Alert(kind="trainer_lost", message=_lost_message(run.stage, tr, age)))
    st = run.storage
    if (
        st.projected_remaining_bytes is not None
        and st.projected_total_bytes is not None
        and st.disk_free is not None
        and st.projected_remaining_bytes > st.disk_free
    ):
        alerts.append(Alert(kind="disk", message=(
            f"projected {st.projected_total_bytes / 1e9:.1f} GB in all, {st.projected_remaining_bytes / 1e9:.1f} GB "
            f"still to write, but only {st.disk_free / 1e9:.1f} GB free")))  # fmt: skip
    rate = _alert_error_rate(ex, config)
    if rate is not None:
        alerts.append(
            Alert(kind="error_rate", message=f"error rate {rate:.1%} above {config.error_rate_threshold:.1%}")
        )
    if (
        rg is not None
        and rg.error_rate is not None
        and rg.done + rg.failed >= config.error_rate_min_attempts
        and rg.error_rate > config.error_rate_threshold
    ):
        given_up = f"regeneration: {rg.error_rate:.1%} of prompts given up"
        alerts.append(Alert(kind="error_rate", message=f"{given_up}, above {config.error_rate_threshold:.1%}"))
    ev = run.evaluation
    served, predicted = _number(ev.get("accept_length")), _number(ev.get("predicted_accept_length"))
    if ev.get("state") == "done" and served_shortfall(served, predicted):
        alerts.append(Alert(kind="served_acceptance", message=(
            f"served accept length {served:.2f} ({ev.get('engine') or 'engine'}) is below {SERVED_FLOOR:.0%} of the "
            f"{predicted:.2f} its held-out accuracy predicts: check {LIKELY_CAUSES}")))  # fmt: skip
    return alerts


def _number(value: float | str | None) -> float | None:
    return value if isinstance(value, (int, float)) else None


def stall_limit(usual: float | None, config: StatusConfig) -> float:
    """Seconds without a completion after which a stage is stalled."""
    return max(config.stall_factor * usual, config.stall_min_s) if usual else config.stall_factor * config.stall_min_s


def _alert_error_rate(ex: Extraction, config: StatusConfig) -> float | None:
    """The overall or the recent error rate when it is above the threshold over enough attempts, else None."""
    overall = ex.error_rate if ex.done + ex.failed >= config.error_rate_min_attempts else None
    recent = ex.recent_error_rate if ex.recent_attempts >= config.error_rate_min_attempts else None
    above = [r for r in (recent, overall) if r is not None and r > config.error_rate_threshold]
    return above[0] if above else None
