"""Settings for every eaglet process, read from the environment (prefix ``EAGLET_``) or ``.env``.

Entry points build one ``Settings`` and pass plain values down; nothing below them reads the
environment.
"""

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from .alerts import StatusConfig
from .records import HEARTBEAT_INTERVAL_S, LOST_AFTER_BEATS


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EAGLET_", env_file=".env", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Run state and the job queue. Shared by every host of a run."""

    data_dir: Path = Path("var/data")
    """The durable data volume: ingested samples, hidden states, drafters."""

    dump_dir: Path = Path("var/dump")
    """Where the inference server writes one dump per request. Local to a host; tmpfs in production."""

    model: str = "smollm2"
    """Target model: a Hugging Face model directory, or a bundled model: ``smollm2`` (SmolLM2-135M-Instruct) or
    ``gemma3`` (Gemma 3 270M, after `make gemma3`)."""

    model_cache_dir: Path = Path("var/models")
    """Where the bundled model is converted to safetensors, once."""

    inference_url: str = "http://127.0.0.1:30000"
    """The inference server this host's workers talk to."""

    host_name: str = ""
    """This host's name in the status (its workers and its inference server). Empty: the machine's host name; give
    each host its own where every host's workers name their server by the same URL (containers, several hosts)."""

    request_timeout_s: float = Field(600.0, gt=0)
    """How long a worker waits for one prefill; a 32K-token prompt on a busy server takes a while."""

    dump_wait_s: float = Field(60.0, gt=0)
    """How long a worker waits for the dump to appear after the response (SGLang writes it from a thread)."""

    store_dtype: Literal["model", "bf16", "fp8"] = "model"
    """How the hidden states are stored: ``model`` (as dumped), ``bf16``, or ``fp8`` (e4m3 with per-token scales,
    half of bf16's bytes; measured against bf16 in BENCHMARKS.md). Read by the workers, decoded by the trainer."""

    max_attempts: int = Field(4, ge=1)
    """Tries per sample before it is recorded as failed."""

    heartbeat_interval_s: float = Field(HEARTBEAT_INTERVAL_S, gt=0)

    lost_heartbeats: float = Field(LOST_AFTER_BEATS, gt=0)
    """A worker or a trainer is lost when its heartbeat is older than this many heartbeat intervals."""

    release_gpus_when_done: bool = False
    """One GPU set serves both services in turn: the inference service frees it once no run is extracting (and
    sets ``gpus_released`` on the runs that wait), and the trainer waits for that before it trains."""

    api_token: str = ""
    """Bearer token for the gateway's run-control endpoints. Empty disables them."""

    @property
    def status_host(self) -> str:
        """This host's name in the status: ``host_name``, else the machine's."""
        return self.host_name or socket.gethostname()

    @property
    def lost_after_s(self) -> float:
        """Seconds without a heartbeat after which a worker or a trainer is taken for dead."""
        return self.lost_heartbeats * self.heartbeat_interval_s


class StatusSettings(Settings):
    """How the status figures are judged: read by the gateway and by ``eaglet status``."""

    status_window_s: float = Field(60.0, gt=0)
    """Rates and the recent error rate are taken over this many seconds."""

    stall_factor: float = Field(5.0, gt=0)
    """Stalled: no completion for this many times the usual interval between completions..."""

    stall_min_s: float = Field(60.0, gt=0)
    """...and never for less than this."""

    error_rate_threshold: float = Field(0.05, ge=0, le=1)

    status_max_runs: int = Field(100, ge=1)
    """Most runs one /status page or one /metrics scrape reads."""

    def status_config(self) -> StatusConfig:
        return StatusConfig(
            window_s=self.status_window_s,
            stall_factor=self.stall_factor,
            stall_min_s=self.stall_min_s,
            lost_after_s=self.lost_after_s,
            error_rate_threshold=self.error_rate_threshold,
        )
