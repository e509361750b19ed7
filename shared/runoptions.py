"""The options of a run: one shape from the request or the command line to the ingest that applies them.

A plain dataclass. The gateway validates request bodies against it directly (pydantic reads the field
constraints and the config below), the command line builds it from flags, and the run's record keeps it
as JSON, which the ingest reads back.
"""

import argparse
import json
import re
from dataclasses import asdict, dataclass
from typing import Annotated, Literal, TypedDict, get_args

from pydantic import Field

from .layers import (
    DFLASH_DEFAULT_DRAFT_LAYERS,
    EAGLE3_NUM_LAYERS,
    default_layer_ids,
    dflash_layer_ids,
    layer_ids_problem,
    parse_layer_ids,
)
from .layout import DEFAULT_LAYOUT, AuxStorage, FinalStorage, Layout, TopkRows

Overlong = Literal["truncate", "reject"]
StoreDtype = Literal["model", "bf16", "fp8"]
Reasoning = Literal["think_tags", "drop"]
Method = Literal["eagle3", "dflash"]
EvalEngine = Literal["reference", "sglang"]
SelectBy = Literal["last", "predicted", "served"]
MIN_MAX_TOKENS = 2
DEFAULT_TOPK = DEFAULT_LAYOUT.topk


class StoreOptions(TypedDict, total=False):
    """The storage fields of ``RunOptions``, as the command line's ``--store-*`` flags give them."""

    store_dtype: StoreDtype | None
    store_final: FinalStorage
    store_topk: int
    store_topk_rows: TopkRows
    store_aux: AuxStorage
    method: Method
    aux_layer_ids: list[int] | None


EVERY_STATE: StoreOptions = {"store_final": "all", "store_aux": "full"}
"""The options of a run that keeps every state as the server dumps it (the layout before ``DEFAULT_LAYOUT``)."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


@dataclass(frozen=True, kw_only=True)
class RegenerateOptions:
    """How a run regenerates its dataset's assistant turns with the target before ingest
    (services/regenerate/)."""

    __pydantic_config__ = {"extra": "forbid"}

    endpoint: str | None = None
    """Base URL of an OpenAI-compatible API (``.../v1``: SGLang, vLLM, a hosted API); None: the workers' own
    inference server (``EAGLET_INFERENCE_URL`` + ``/v1``)."""
    model: str = "default"
    """The ``model`` field of each request (SGLang and the reference server ignore it)."""
    api_key_env: str | None = None
    """NAME of the environment variable that holds the endpoint's key, in the workers' environment; the key
    itself is never stored or logged."""
    temperature: Annotated[float, Field(ge=0)] = 0.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    max_tokens: Annotated[int, Field(ge=1)] = 1024
    """Most new tokens of one answer."""
    concurrency: Annotated[int, Field(ge=1, le=1024)] = 8
    """Requests in flight per worker."""
    batch_prompts: Annotated[int, Field(ge=1)] = 64
    """Prompts per job: the unit a worker takes, and at most what a killed worker leaves to do again."""
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    max_tries: Annotated[int, Field(ge=1)] = 8
    """Tries of one request on 429, 5xx, timeouts and lost connections, with backoff, before its prompt fails."""
    reasoning: Reasoning = "think_tags"
    """A reasoning model's reasoning (``reasoning_content``): ``think_tags`` keeps it in the answer as
    ``<think>\n...\n</think>\n\n`` before the content, as such templates render a generated turn; ``drop``
    keeps only the content."""
    stop_after: bool = False
    """Stop once the regenerated file is written (the run ends ``done``), instead of ingesting it."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: give a value in (0, 1]")
        for name in ("max_tokens", "concurrency", "batch_prompts", "max_tries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.reasoning not in get_args(Reasoning):
            raise ValueError(f"reasoning={self.reasoning!r}: use 'think_tags' or 'drop'")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"endpoint={self.endpoint!r}: give an http:// or https:// URL")
        if self.api_key_env is not None and not ENV_NAME.fullmatch(self.api_key_env):
            # Not echoed: a key pasted here by mistake must not land in an error message or a log.
            raise ValueError("api_key_env: give the NAME of an environment variable ([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    # Read by pydantic only: a request body with a field this class lacks is refused, not silently ignored.
    __pydantic_config__ = {"extra": "forbid"}

    max_tokens: Annotated[int, Field(ge=MIN_MAX_TOKENS)] = 4096
    """Longest sample kept; longer ones are truncated or rejected (``overlong``). Capped at the model's context."""
    overlong: Overlong = "reject"
    limit: Annotated[int, Field(ge=1)] | None = None
    """Stop after this many samples (for trials)."""
    regenerate: RegenerateOptions | None = None
    """Regenerate the dataset's assistant turns with the target first; None: ingest the dataset as it is."""
    store_dtype: StoreDtype | None = None
    """How the run's hidden states are stored (shared/store.py); None: the ingesting process's
    ``EAGLET_STORE_DTYPE``. Fixed in the run's record at ingest, so every worker, on any host, stores it the same."""
    store_final: FinalStorage = DEFAULT_LAYOUT.final
    """What is kept of the target's final state (shared/layout.py): ``all`` positions, only the ``loss``
    positions, or the target's ``topk`` distribution instead. Fixed at ingest, as ``store_dtype``."""
    store_topk: Annotated[int, Field(ge=0)] = 0
    """Entries of the top-k distribution a token keeps (``store_final: topk``: 1 to 1024; 24 when left 0)."""
    store_topk_rows: TopkRows = DEFAULT_LAYOUT.topk_rows
    """Where the top-k is kept: at the ``loss`` positions only (what the trainer reads) or at ``all``; ignored
    unless ``store_final: topk``."""
    store_aux: AuxStorage = DEFAULT_LAYOUT.aux
    """The auxiliary states at ``full`` width (``store_dtype``) or block-scaled 4-bit (``fp4``)."""
    method: Method = "eagle3"
    """The drafter the run trains: ``eagle3`` (three target layers) or ``dflash`` (one per draft layer)."""
    aux_layer_ids: list[int] | None = None
    """The target layers whose states the run stores, eaglet's ids (the input of layer i, shared/layers.py), in the
    order the drafter reads them; each worker takes them out of what its server captures (``EAGLET_AUX_LAYER_IDS``),
    which may be more. None: the method's default for the target, fixed here at ingest (``eagle3``:
    ``default_layer_ids(L)``; ``dflash``: ``dflash_layer_ids(L, DFLASH_DEFAULT_DRAFT_LAYERS)``)."""
    eval_engine: EvalEngine = "reference"
    """The engine the evaluation after training decodes in (``eaglet eval --engine``): ``reference`` (eaglet's own
    speculative decoding) or ``sglang`` (the drafter served by SGLang, beside the target alone)."""
    select_by: SelectBy = "last"
    """Which epoch's drafter the run exports (``eaglet train --select-by``, services/trainer/selection.py): the
    ``last``, the best ``predicted`` by its held-out accuracy, or the best ``served`` of the ``select_top`` best
    predicted, each decoded by ``eval_engine`` (needs the trainer's evaluation prompts)."""
    select_top: Annotated[int, Field(ge=1)] = 2
    """Epochs serve-tested with ``select_by: served``."""

    def __post_init__(self) -> None:
        if isinstance(self.regenerate, dict):  # read back from the run's record (JSON)
            object.__setattr__(self, "regenerate", RegenerateOptions(**self.regenerate))
        # The command line and a stored record build options without pydantic: the same limits, checked here.
        if self.max_tokens < MIN_MAX_TOKENS:
            raise ValueError(f"max_tokens={self.max_tokens}: must be at least {MIN_MAX_TOKENS}")
        if self.overlong not in get_args(Overlong):
            raise ValueError(f"overlong={self.overlong!r}: use 'truncate' or 'reject'")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit}: must be at least 1")
        if self.store_dtype is not None and self.store_dtype not in get_args(StoreDtype):
            raise ValueError(f"store_dtype={self.store_dtype!r}: use one of {', '.join(get_args(StoreDtype))}")
        if self.store_topk_rows not in get_args(TopkRows):
            raise ValueError(f"store_topk_rows={self.store_topk_rows!r}: use one of {', '.join(get_args(TopkRows))}")
        if self.store_final == "topk" and self.store_topk == 0:
            object.__setattr__(self, "store_topk", DEFAULT_TOPK)
        self.layout()  # checks the three store_ fields together
        if self.method not in get_args(Method):
            raise ValueError(f"method={self.method!r}: use one of {', '.join(get_args(Method))}")
        if self.aux_layer_ids is not None:
            count = EAGLE3_NUM_LAYERS if self.method == "eagle3" else None  # EAGLE-3's fc reads exactly three
            problem = layer_ids_problem(self.aux_layer_ids, None, count)
            if problem:
                raise ValueError(f"aux_layer_ids={self.aux_layer_ids} (method {self.method}): {problem}")
        if self.select_by not in get_args(SelectBy):
            raise ValueError(f"select_by={self.select_by!r}: use one of {', '.join(get_args(SelectBy))}")
        if self.select_top < 1:
            raise ValueError(f"select_top={self.select_top}: serve-test at least 1 epoch")
        if self.eval_engine not in get_args(EvalEngine):
            raise ValueError(f"eval_engine={self.eval_engine!r}: use one of {', '.join(get_args(EvalEngine))}")

    def layer_ids(self, num_layers: int) -> list[int]:
        """The layers the run stores for a target of ``num_layers`` layers; ``ValueError`` for ids it lacks."""
        if self.aux_layer_ids is not None:
            ids = list(self.aux_layer_ids)
        elif self.method == "dflash":
            ids = dflash_layer_ids(num_layers, DFLASH_DEFAULT_DRAFT_LAYERS)
        else:
            ids = default_layer_ids(num_layers)
        problem = layer_ids_problem(ids, num_layers)
        if problem:
            raise ValueError(f"aux_layer_ids {ids} (method {self.method}): {problem}")
        return ids

    def layout(self) -> Layout:
        """The storage layout these options name."""
        rows = self.store_topk_rows if self.store_final == "topk" else "all"
        return Layout(final=self.store_final, topk=self.store_topk, aux=self.store_aux, topk_rows=rows)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunOptions":
        """The options a run's record keeps; a run recorded before layouts existed stored every state."""
        return cls(**(EVERY_STATE | json.loads(text)))


def add_store_flags(parser: argparse.ArgumentParser) -> None:
    """The ``--store-*`` flags of every command that starts a run (``eaglet ingest``, ``eaglet regenerate``)."""
    defaults = RunOptions()
    parser.add_argument("--store-dtype", choices=get_args(StoreDtype), default=defaults.store_dtype,
                        help="how the run's hidden states are stored (default: EAGLET_STORE_DTYPE)")  # fmt: skip
    parser.add_argument("--store-final", choices=get_args(FinalStorage), default=defaults.store_final,
                        help="the final state at all positions, at loss positions only, or the top-k distribution "
                        f"(default {defaults.store_final})")  # fmt: skip
    # 0, not the built default's k: a k given with --store-final all or loss is refused
    parser.add_argument("--store-topk", type=int, default=0,
                        help=f"entries a token of --store-final topk keeps (default {DEFAULT_TOPK})")  # fmt: skip
    parser.add_argument("--store-topk-rows", choices=get_args(TopkRows), default=defaults.store_topk_rows,
                        help="with --store-final topk: the distribution at loss positions only (what training "
                        f"reads) or at all (default {defaults.store_topk_rows})")  # fmt: skip
    parser.add_argument("--store-aux", choices=get_args(AuxStorage), default=defaults.store_aux,
                        help="the auxiliary states at full width or block-scaled 4-bit "
                        f"(default {defaults.store_aux})")  # fmt: skip
    parser.add_argument("--method", choices=get_args(Method), default=defaults.method,
                        help=f"the drafter the run trains (default {defaults.method})")  # fmt: skip
    parser.add_argument("--aux-layer-ids", type=_layer_ids_flag, default=None, metavar="1,9,17",
                        help="the target layers the run stores, out of those the server captures (default: the "
                        "method's: EAGLE-3's three, DFlash's five)")  # fmt: skip


def _layer_ids_flag(text: str) -> list[int]:
    try:
        return parse_layer_ids(text, "--aux-layer-ids")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def store_flags(args: argparse.Namespace) -> StoreOptions:
    """What the flags of ``add_store_flags`` set, as ``RunOptions`` fields."""
    return StoreOptions(store_dtype=args.store_dtype, store_final=args.store_final, store_topk=args.store_topk,
                        store_topk_rows=args.store_topk_rows, store_aux=args.store_aux, method=args.method,
                        aux_layer_ids=args.aux_layer_ids)  # fmt: skip
