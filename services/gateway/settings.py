"""The gateway's settings: eaglet's status settings plus what only the gateway reads, all from ``EAGLET_*``."""

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from eaglet.shared.config import StatusSettings


class GatewaySettings(StatusSettings):
    host: str = "127.0.0.1"
    """Where ``python -m eaglet.services.gateway.main`` listens; 0.0.0.0 in a container."""

    port: int = Field(8000, ge=1, le=65535)

    gateway_workers: int = Field(1, ge=1)
    """Gateway processes behind the one port: the gateway keeps no state, so they answer alike."""

    dataset_roots: Annotated[list[Path], NoDecode] = [Path("var/datasets")]
    """``POST /runs`` accepts only datasets under one of these folders (comma-separated in the environment)."""

    series_interval_s: float = Field(2.0, gt=0)
    """Each run's figures are recorded this often for the page's charts; the interval doubles as a run's series
    fills, so a series keeps its fixed number of points whatever the run's length (shared/series.py)."""

    read_requires_token: bool = False
    """Ask for the bearer token on the GET endpoints too (the page, /status, /runs/{id}, /metrics)."""

    @field_validator("dataset_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        return [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_token(self) -> "GatewaySettings":
        if self.api_token == "changethis":
            raise ValueError("EAGLET_API_TOKEN is 'changethis': set a secret of your own (e.g. `openssl rand -hex 32`)")
        if self.read_requires_token and not self.api_token:
            raise ValueError("EAGLET_READ_REQUIRES_TOKEN is set but EAGLET_API_TOKEN is empty: set the token too")
        return self
