"""The options of a run: one shape from the request or the command line to the ingest that applies them.

A plain dataclass. The gateway validates request bodies against it directly (pydantic reads the field
constraints and the config below), the command line builds it from flags, and the run's record keeps it
as JSON, which the ingest reads back.
"""

import json
from dataclasses import asdict, dataclass
from typing import Annotated, Literal, get_args

from pydantic import Field

Overlong = Literal["truncate", "reject"]
MIN_MAX_TOKENS = 2


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    # Read by pydantic only: a request body with a field this class lacks is refused, not silently ignored.
    __pydantic_config__ = {"extra": "forbid"}

    max_tokens: Annotated[int, Field(ge=MIN_MAX_TOKENS)] = 4096
    """Longest sample kept; longer ones are truncated or rejected (``overlong``). Capped at the model's context."""
    overlong: Overlong = "reject"
    limit: Annotated[int, Field(ge=1)] | None = None
    """Stop after this many samples (for trials)."""

    def __post_init__(self) -> None:
        # The command line and a stored record build options without pydantic: the same limits, checked here.
        if self.max_tokens < MIN_MAX_TOKENS:
            raise ValueError(f"max_tokens={self.max_tokens}: must be at least {MIN_MAX_TOKENS}")
        if self.overlong not in get_args(Overlong):
            raise ValueError(f"overlong={self.overlong!r}: use 'truncate' or 'reject'")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit}: must be at least 1")

    def to_json(self) -> str:
        return json.dumps(asdict(self))
