"""The dump an inference server writes for one request: ``<dump_dir>/<rid>.safetensors``.

Both servers (the reference server and the SGLang plugin) write it with ``write_dump``; the extractor
reads it with ``read_dump`` and checks it with ``validate_dump``. A dump exists only when complete: it
is written under a temporary name and renamed.

Tensors: ``hidden_states`` [T, H] (final layer, after the final norm: what the LM head reads) and
``aux_hidden_states`` [T, 3H] (the residual stream entering each EAGLE-3 layer, concatenated in layer
order), both in the model dtype. Metadata: ``rid``, ``num_tokens``, ``aux_layer_ids`` (SGLang's
convention: the index of the layer whose input was captured), ``model``, ``dtype`` (the model's).

A request may ask for its states fp8-encoded (``custom_params: {"eaglet_dump": "fp8"}``, sent when the run
stores fp8): the server then encodes them on its device with the store's encoder before the copy to the host
(shared/store.py ``encode_fp8``), the dump holds them as float8 e4m3 with ``hidden_states_scale`` and
``aux_hidden_states_scale`` [T, 1] float32 beside them and metadata ``storage: fp8_e4m3``, and the worker stores
them as they are: half the bytes through the dump folder, the copy and the disk.

A request may also ask for the target's top-k distribution (``custom_params: {"eaglet_topk": k}``, sent when the
run's layout keeps one instead of the final state): the dump then holds ``topk_ids`` int32 [T, k] and ``topk_logp``
float16 [T, k] beside the states, computed by the server from its LM head (shared/topk.py), metadata
``topk: k``. A server that cannot leaves them out, and the worker refuses the dump with that reason.
"""

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from .ids import check_rid
from .layout import TopkError, check_k
from .store import FP8, FP8_STORAGE, STATE_TENSORS
from .tensorfile import FileSlice, TensorFileError, map_tensors, read_header, row_blocks
from .topk import TOPK_PARAM, TOPK_TENSORS, check_topk

SUFFIX = ".safetensors"
FINITE_CHECK_BYTES = 8 << 20  # of float32: 4 MB of a bf16 dump a block
DUMP_ENCODING_PARAM = "eaglet_dump"
"""The request's ``sampling_params.custom_params`` key asking for an encoded dump; its one value is ``fp8``."""
FP8_ENCODING = "fp8"


class DumpInvalid(ValueError):
    """A dump that must not be stored: partial, unreadable, wrong shape, dtype or token count, not finite."""


@dataclass(frozen=True)
class DumpEncoding:
    """What a request asks its server to compute on its device before the copy to the host."""

    fp8: bool = False
    """The states fp8-encoded."""
    topk: int = 0
    """The target's top-k distribution beside the states (k entries a token; 0: none)."""

    def params(self) -> dict:
        """The request's ``sampling_params.custom_params`` entries asking for it."""
        return {
            **({DUMP_ENCODING_PARAM: FP8_ENCODING} if self.fp8 else {}),
            **({TOPK_PARAM: self.topk} if self.topk else {}),
        }

    @classmethod
    def from_params(cls, custom_params: dict | None, vocab_size: int) -> "DumpEncoding":
        """Read by a server from a request; ``ValueError`` naming the parameter for a k it cannot serve."""
        params = custom_params or {}
        topk = params.get(TOPK_PARAM, 0)
        if topk:
            if type(topk) is not int:
                raise ValueError(f"custom_params.{TOPK_PARAM}={topk!r}: give an integer k")
            try:
                check_k(topk, vocab_size)
            except TopkError as e:
                raise ValueError(f"custom_params.{TOPK_PARAM}={topk}: {e}") from e
        return cls(fp8=params.get(DUMP_ENCODING_PARAM) == FP8_ENCODING, topk=topk)


@dataclass
class Dump:
    hidden_states: torch.Tensor  # [T, H]
    aux_hidden_states: torch.Tensor  # [T, 3H]
    metadata: dict[str, str]
    slices: dict[str, FileSlice] = field(default_factory=dict)
    """Where the tensors lie in the dump file: a store that keeps them as they are copies these."""
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    """``hidden_states_scale`` and ``aux_hidden_states_scale`` [T, 1] of an fp8 dump; empty otherwise."""
    topk: dict[str, torch.Tensor] = field(default_factory=dict)
    """``topk_ids`` and ``topk_logp`` [T, k] of a dump that was asked for them; empty otherwise."""

    @property
    def fp8(self) -> bool:
        return self.metadata.get("storage") == FP8_STORAGE

    @property
    def aux_layer_ids(self) -> list[int]:
        return json.loads(self.metadata["aux_layer_ids"])


def dump_path(dump_dir: Path, rid: str) -> Path:
    return Path(dump_dir) / f"{check_rid(rid)}{SUFFIX}"


def write_dump(
    dump_dir: Path,
    rid: str,
    hidden_states: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    *,
    aux_layer_ids: list[int],
    model: str,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    model_dtype: torch.dtype | None = None,
    topk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Path:
    """Writes one request's dump atomically and returns its path. No fsync: the dump dir is shared memory.

    ``scales`` (of ``hidden_states``, of ``aux_hidden_states``): the states are fp8-encoded (``encode_fp8``);
    ``model_dtype`` then names the dtype they were encoded from. ``topk``: (ids, log-probs) [T, k] of the target's
    top-k distribution (``encode_topk``)."""
    final = dump_path(dump_dir, rid)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    metadata = {
        "rid": rid,
        "num_tokens": str(hidden_states.shape[0]),
        "aux_layer_ids": json.dumps(list(aux_layer_ids)),
        "model": model,
        "dtype": str(model_dtype or hidden_states.dtype).removeprefix("torch."),
    }
    tensors = {
        "hidden_states": hidden_states.contiguous(),
        "aux_hidden_states": aux_hidden_states.contiguous(),
    }
    if scales is not None:
        tensors["hidden_states_scale"], tensors["aux_hidden_states_scale"] = (t.contiguous() for t in scales)
        metadata["storage"] = FP8_STORAGE
    if topk is not None:
        tensors.update(zip(TOPK_TENSORS, (t.contiguous() for t in topk), strict=True))
        metadata["topk"] = str(topk[0].shape[1])
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o644)  # the reader may be another user (the extractor's container)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def read_dump(path: Path) -> Dump:
    """Maps a dump into memory (nothing is read until used); any unreadable file raises ``DumpInvalid``."""
    try:
        header = read_header(path)
        tensors = map_tensors(header)
        names = [*STATE_TENSORS, *(f"{k}_scale" for k in STATE_TENSORS if f"{k}_scale" in tensors)]
        slices = {k: header.slices[k] for k in names}
        scales = {k: tensors[k] for k in names[len(STATE_TENSORS) :]}
        topk = {k: tensors[k] for k in TOPK_TENSORS if k in tensors}
        return Dump(tensors["hidden_states"], tensors["aux_hidden_states"], header.metadata, slices, scales, topk)
    except (TensorFileError, KeyError, ValueError, OSError) as e:
        raise DumpInvalid(f"dump {path.name}: unreadable ({type(e).__name__}: {e})") from e


def validate_dump(
    dump: Dump, *, rid: str, num_tokens: int, hidden_size: int, num_aux: int = 3, topk: int = 0,
    vocab_size: int | None = None,
) -> None:  # fmt: skip
    """Raises ``DumpInvalid`` with the reason unless the dump is this request's, whole and finite, with the top-k
    distribution of ``topk`` entries over ``vocab_size`` tokens it was asked for (``topk`` > 0)."""
    where = f"dump {rid}"
    if topk:
        _validate_topk(dump, where, num_tokens, topk, vocab_size)
    got_rid = dump.metadata.get("rid")
    if got_rid != rid:
        raise DumpInvalid(f"{where}: metadata rid is {got_rid!r}")
    h, aux = dump.hidden_states, dump.aux_hidden_states
    if tuple(h.shape) != (num_tokens, hidden_size):
        raise DumpInvalid(f"{where}: hidden_states shape {tuple(h.shape)}, expected ({num_tokens}, {hidden_size})")
    if tuple(aux.shape) != (num_tokens, num_aux * hidden_size):
        raise DumpInvalid(
            f"{where}: aux_hidden_states shape {tuple(aux.shape)}, expected ({num_tokens}, {num_aux * hidden_size})"
        )
    if h.dtype != aux.dtype or not h.dtype.is_floating_point:
        raise DumpInvalid(f"{where}: dtypes {h.dtype} / {aux.dtype}, expected one floating dtype")
    if dump.metadata.get("num_tokens") != str(num_tokens):
        raise DumpInvalid(f"{where}: metadata num_tokens {dump.metadata.get('num_tokens')!r}, expected {num_tokens}")
    if (h.dtype == FP8) != dump.fp8:
        raise DumpInvalid(f"{where}: states are {h.dtype} but metadata storage is {dump.metadata.get('storage')!r}")
    if dump.fp8:
        _validate_fp8(dump, where, num_tokens)
        return
    for name, t in (("hidden_states", h), ("aux_hidden_states", aux)):
        for rows in row_blocks(t, FINITE_CHECK_BYTES):
            block = t[rows]
            # A sum is finite only if every term is: one fast pass. Only a block whose sum is not (a NaN or Inf,
            # or finite values summing past the float32 range) is checked value by value.
            if torch.isfinite(block.sum(dtype=torch.float32)):
                continue
            finite = torch.isfinite(block).all(dim=-1)
            if not bool(finite.all()):
                bad = rows.start + int((~finite).nonzero()[0, 0])
                raise DumpInvalid(f"{where}: {name} has NaN/Inf (first at token {bad})")


def _validate_fp8(dump: Dump, where: str, num_tokens: int) -> None:
    """An fp8 dump: finite positive scales, and no NaN among the values (e4m3fn has no infinity)."""
    for name in STATE_TENSORS:
        scale = dump.scales.get(f"{name}_scale")
        if scale is None or tuple(scale.shape) != (num_tokens, 1) or scale.dtype != torch.float32:
            got = None if scale is None else (tuple(scale.shape), scale.dtype)
            raise DumpInvalid(f"{where}: {name}_scale is {got}, expected ({num_tokens}, 1) float32")
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            raise DumpInvalid(f"{where}: {name}_scale is not finite and positive (first at token {first})")
        values = getattr(dump, name)
        for rows in row_blocks(values, FINITE_CHECK_BYTES):
            nan = (values[rows].view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn's only non-finite codes
            if bool(nan.any()):
                bad_row = rows.start + int(nan.any(dim=-1).nonzero()[0, 0])
                raise DumpInvalid(f"{where}: {name} has NaN (first at token {bad_row})")


def _validate_topk(dump: Dump, where: str, num_tokens: int, k: int, vocab_size: int | None) -> None:
    if len(dump.topk) != len(TOPK_TENSORS):
        raise DumpInvalid(f"{where}: asked for the top-{k} distribution, the dump holds none (does its server "
                          f"compute it? the reference server does)")  # fmt: skip
    if vocab_size is None:
        raise DumpInvalid(f"{where}: the run records no vocabulary size to check its top-{k} ids against")
    try:
        check_topk(*(dump.topk[n] for n in TOPK_TENSORS), rows=num_tokens, k=k, vocab_size=vocab_size, where=where)
    except TopkError as e:
        raise DumpInvalid(str(e)) from e
