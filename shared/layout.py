"""What a stored sample keeps of the target's states: the run's storage layout, fixed at ingest with its dtype.

A drafter's training reads the auxiliary states at every position, and the final state only to form the target's
next-token distribution at loss positions. So the final state may be kept

- ``all``: at every position (as dumped);
- ``loss``: only at the positions whose next token is under the loss mask (position p predicts token p + 1, so the
  rows p with ``loss_mask[p + 1]``): ``hidden_states`` [N, H], N = ``loss_mask[1:].sum()``, in position order;
- ``topk``: not at all: the target's top-k distribution instead (shared/topk.py), at every position;

and the auxiliary states ``full`` (in the run's ``store_dtype``) or ``fp4`` (shared/fp4.py). The dtype
(``store_dtype``: model, bf16, fp8) applies to every state kept at full width.

``bytes_per_token`` is the one count of what each layout costs: the tables in BENCHMARKS.md and ``/status``'s
projection before the first sample is stored both come from it.
"""

from dataclasses import dataclass
from typing import Literal, cast, get_args

FinalStorage = Literal["all", "loss", "topk"]
TopkRows = Literal["all", "loss"]
AuxStorage = Literal["full", "fp4"]
NUM_AUX = 3
"""Aux states a token of a run that records no layers (EAGLE-3's three); a run's own count is its layers'."""
IDS_MASK_BYTES = 5  # int32 input id + uint8 loss mask a token
FP4_BLOCK = 32
"""Elements of a row sharing one scale in 4-bit storage (shared/fp4.py)."""
FP4_STORAGE = "e2m1_b32"
"""The aux states' metadata value (``aux_storage``) of 4-bit storage."""
MAX_TOPK = 1024
"""The most entries a token's top-k distribution may keep: beyond, the final state itself is cheaper at small hidden
sizes."""


class TopkError(ValueError):
    """A top-k distribution that must not be stored: wrong shape or dtype, ids outside the vocabulary, not a
    distribution."""


def check_k(k: int, vocab_size: int | None = None) -> None:
    """Raises ``TopkError`` unless ``k`` is a usable number of entries for a vocabulary of ``vocab_size``."""
    top = MAX_TOPK if vocab_size is None else min(MAX_TOPK, vocab_size)
    if not 1 <= k <= top:
        raise TopkError(f"top-k k={k}: give 1 to {top}" + (f" (vocabulary of {vocab_size})" if vocab_size else ""))


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    final: FinalStorage = "all"
    topk: int = 0
    """Entries kept a token when ``final`` is ``topk``; 0 otherwise."""
    aux: AuxStorage = "full"
    topk_rows: TopkRows = "all"
    """Where a ``topk`` layout keeps the distribution: at ``all`` positions, or at the ``loss`` positions only (the
    rows of ``loss_rows``, in order: all a loss reads), computed by the server at those rows only."""

    def __post_init__(self) -> None:
        if self.topk_rows not in get_args(TopkRows):
            raise ValueError(f"store_topk_rows={self.topk_rows!r}: use one of {', '.join(get_args(TopkRows))}")
        if self.topk_rows != "all" and self.final != "topk":
            raise ValueError(f"store_topk_rows={self.topk_rows}: only a run with store_final 'topk' keeps a top-k")
        if self.final not in get_args(FinalStorage):
            raise ValueError(f"store_final={self.final!r}: use one of {', '.join(get_args(FinalStorage))}")
        if self.aux not in get_args(AuxStorage):
            raise ValueError(f"store_aux={self.aux!r}: use one of {', '.join(get_args(AuxStorage))}")
        if self.final == "topk":
            check_k(self.topk)
        elif self.topk:
            raise ValueError(f"store_topk={self.topk}: only a run with store_final 'topk' keeps a top-k")

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> "Layout":
        """The layout a stored sample's metadata names (a sample written before layouts existed: the default)."""
        final = metadata.get("final_storage", "all")
        aux = "fp4" if metadata.get("aux_storage") == FP4_STORAGE else "full"
        topk = int(metadata.get("topk", 0)) if final == "topk" else 0
        rows = cast(TopkRows, metadata.get("topk_rows", "all"))
        return cls(final=cast(FinalStorage, final), topk=topk, aux=cast(AuxStorage, aux), topk_rows=rows)

    def metadata(self) -> dict[str, str]:
        """What a stored sample's metadata records of its layout (nothing for the default: files read as before)."""
        out: dict[str, str] = {}
        if self.final != "all":
            out["final_storage"] = self.final
        if self.final == "topk":
            out["topk"] = str(self.topk)
        if self.topk_rows != "all":
            out["topk_rows"] = self.topk_rows
        if self.aux == "fp4":
            out["aux_storage"] = FP4_STORAGE
        return out

    @property
    def name(self) -> str:
        """Short name of the layout, as tables and run names spell it: all, loss, top32 (at every position:
        top32@all), each with +fp4 aux."""
        final = f"top{self.topk}" + ("@all" if self.topk_rows == "all" else "") if self.final == "topk" else self.final
        return final + ("+fp4" if self.aux == "fp4" else "")


# The default layout: the target's top-24 distribution in place of the final state, the auxiliary states in 4 bits.
# 0.243x bf16's bytes, and the default recipe on it accepted as many tokens as on bf16 on SGLang (SmolLM2, the
# head-to-head's data: +2.0 % HumanEval, +1.6 % held-out) and on CPU (two seeds): BENCHMARKS.md section 4b. The
# top-k at loss positions only: the rows the trainer reads, so training is the same, the server scores fewer rows.
DEFAULT_LAYOUT = Layout(final="topk", topk=24, aux="fp4", topk_rows="loss")


def state_bytes(width: int, dtype: str, model_itemsize: int = 2) -> float:
    """Bytes of one token's state of ``width`` values at full width in ``dtype`` (fp8 adds its float32 scale)."""
    if dtype == "fp8":
        return width + 4
    return width * (2 if dtype == "bf16" else model_itemsize)


def bytes_per_token(
    hidden_size: int,
    layout: Layout,
    store_dtype: str,
    *,
    loss_fraction: float = 1.0,
    model_itemsize: int = 2,
    num_aux: int = NUM_AUX,
) -> float:
    """Stored bytes a token of a ``layout`` / ``store_dtype`` sample, headers aside: the ids and mask, the final state
    (or its top-k, or its share at loss positions: ``loss_fraction`` of the tokens), and the ``num_aux`` aux states."""
    if layout.final == "all":
        final = state_bytes(hidden_size, store_dtype, model_itemsize)
    elif layout.final == "loss":
        final = loss_fraction * state_bytes(hidden_size, store_dtype, model_itemsize)
    else:
        final = 6 * layout.topk * (loss_fraction if layout.topk_rows == "loss" else 1)  # int32 id + float16 logp
    width = num_aux * hidden_size
    if layout.aux == "fp4":
        aux = width / 2 + 2 * width / FP4_BLOCK  # 4-bit codes + one bfloat16 scale a block
    else:
        aux = state_bytes(width, store_dtype, model_itemsize)
    return IDS_MASK_BYTES + final + aux
