"""The dump an inference server writes for one request: ``<dump_dir>/<rid>.safetensors``.

Both servers (the reference server and the SGLang plugin) write it with ``write_dump``; the extractor
reads it with ``read_dump`` and checks it with ``validate_dump``. A dump exists only when complete: it
is written under a temporary name and renamed.

Tensors: ``hidden_states`` [T, H] (final layer, after the final norm: what the LM head reads) and
``aux_hidden_states`` [T, K*H] (the residual stream entering each of the K captured layers, concatenated in layer
order: EAGLE-3's three, DFlash's, or both), both in the model dtype. Metadata: ``rid``, ``num_tokens``,
``aux_layer_ids`` (K ids, SGLang's convention: the index of the layer whose input was captured), ``model``, ``dtype``
(the model's).

A request may ask for its states fp8-encoded (``custom_params: {"eaglet_dump": "fp8"}``, sent when the run
stores fp8): the server then encodes them on its device with the store's encoder before the copy to the host
(shared/store.py ``encode_fp8``), the dump holds them as float8 e4m3 with ``hidden_states_scale`` and
``aux_hidden_states_scale`` [T, 1] float32 beside them and metadata ``storage: fp8_e4m3``, and the worker stores
them as they are: half the bytes through the dump folder, the copy and the disk.

A request may also ask for the target's top-k distribution (``custom_params: {"eaglet_topk": k}``, sent when the
run's layout keeps one instead of the final state): the dump then holds ``topk_ids`` int32 [T, k] and ``topk_logp``
float16 [T, k] beside the states, computed by the server from its LM head (shared/topk.py), metadata
``topk: k``; with ``"eaglet_topk_rows": [[start, end], ...]`` beside it (sent when the run keeps the top-k at
loss positions only), only those positions' rows, in order. Those replace the final state: the dump holds no
``hidden_states`` (a run that keeps the top-k never stores the final state, so it does not cross to the host). A
server that cannot compute them writes no dump, and the worker fails the sample with that reason.

A request may ask for its auxiliary states 4-bit encoded (``custom_params: {"eaglet_aux": "e2m1_b32"}``, sent when the
run stores them so): the server encodes them on its device with the store's encoder (shared/fp4.py), and the dump
holds ``aux_hidden_states_e2m1`` uint8 [T, K*H/2] and ``aux_hidden_states_block_scale`` bfloat16 [T, K*H/32] in place of
``aux_hidden_states``, metadata ``aux_storage: e2m1_b32``; the worker stores them as they are. With both, a dump of
the default layout is what the store keeps (0.22 of a bf16 dump at H 4,096): no host work but the check and the copy.
"""

import json
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from .fp4 import FP4_DEVICE_BLOCK_BYTES, Fp4Error, check_fp4, encode_fp4
from .ids import check_rid
from .layout import FP4_BLOCK, FP4_STORAGE, TopkError, check_k
from .store import (
    FP4_AUX_TENSORS,
    FP8,
    FP8_BLOCK_BYTES,
    FP8_DEVICE_BLOCK_BYTES,
    FP8_STORAGE,
    STATE_TENSORS,
    encode_fp8,
)
from .tensorfile import FileSlice, TensorFileError, map_tensors, read_header, row_blocks
from .topk import TOPK_PARAM, TOPK_ROWS_PARAM, TOPK_TENSORS, Spans, check_topk, parse_spans, spans_length

SUFFIX = ".safetensors"
FINITE_CHECK_BYTES = 8 << 20  # of float32: 4 MB of a bf16 dump a block
DUMP_ENCODING_PARAM = "eaglet_dump"
"""The request's ``sampling_params.custom_params`` key asking for an encoded dump; its one value is ``fp8``."""
FP8_ENCODING = "fp8"
AUX_ENCODING_PARAM = "eaglet_aux"
"""The key asking for 4-bit auxiliary states; its one value is ``FP4_STORAGE``."""


class DumpInvalid(ValueError):
    """A dump that must not be stored: partial, unreadable, wrong shape, dtype or token count, not finite."""


class LayersMissing(DumpInvalid):
    """The dump lacks layers that were asked of it (``Dump.with_layers``)."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class DumpEncoding:
    """What a request asks its server to compute on its device before the copy to the host."""

    fp8: bool = False
    """The states fp8-encoded."""
    topk: int = 0
    """The target's top-k distribution in place of the final state (k entries a token; 0: none, the final state)."""
    aux_fp4: bool = False
    """The auxiliary states 4-bit encoded (shared/fp4.py)."""
    topk_rows: Spans | None = None
    """The positions the top-k scores (shared/topk.py ``loss_spans``); None: every position."""

    def __post_init__(self) -> None:
        if self.topk_rows is not None and not self.topk:
            raise ValueError(f"{TOPK_ROWS_PARAM} without {TOPK_PARAM}: the rows of which top-k?")
        if self.fp8 and self.aux_fp4:  # fp8 then 4-bit would round twice; the store refuses it too
            raise ValueError(
                f"{DUMP_ENCODING_PARAM}={FP8_ENCODING} with {AUX_ENCODING_PARAM}={FP4_STORAGE}: ask for one"
            )

    def params(self) -> dict:
        """The request's ``sampling_params.custom_params`` entries asking for it."""
        return {
            **({DUMP_ENCODING_PARAM: FP8_ENCODING} if self.fp8 else {}),
            **({TOPK_PARAM: self.topk} if self.topk else {}),
            **({TOPK_ROWS_PARAM: [list(span) for span in self.topk_rows]} if self.topk_rows is not None else {}),
            **({AUX_ENCODING_PARAM: FP4_STORAGE} if self.aux_fp4 else {}),
        }

    def topk_length(self, num_tokens: int) -> int:
        """Rows of the top-k a dump of a ``num_tokens`` prompt holds."""
        return spans_length(self.topk_rows, num_tokens)

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
        aux = params.get(AUX_ENCODING_PARAM)
        if aux not in (None, FP4_STORAGE):
            raise ValueError(f"custom_params.{AUX_ENCODING_PARAM}={aux!r}: the one value is {FP4_STORAGE!r}")
        rows = params.get(TOPK_ROWS_PARAM)
        spans = None if rows is None else parse_spans(rows, f"custom_params.{TOPK_ROWS_PARAM}")
        return cls(fp8=params.get(DUMP_ENCODING_PARAM) == FP8_ENCODING, topk=topk, aux_fp4=aux == FP4_STORAGE,
                   topk_rows=spans)  # fmt: skip


def dump_forms(encoding: DumpEncoding) -> dict[str, str]:
    """The state tensors a request's dump holds: name in the dump -> the form ``encode_forms`` computes (the top-k,
    when asked, comes apart: both servers score it over their own rows, ``encode_topk``)."""
    parts = {} if encoding.topk else {"hidden_states": "final"}  # the top-k replaces the final state
    if encoding.aux_fp4:
        parts.update(zip(FP4_AUX_TENSORS, ("aux_e2m1", "aux_block_scale"), strict=True))
    else:
        parts["aux_hidden_states"] = "aux"
    if encoding.fp8:
        for name in list(parts):
            parts[f"{name}_scale"] = f"{parts[name]}_fp8_scale"
            parts[name] += "_fp8"
    return parts


def encode_forms(final: torch.Tensor, aux: torch.Tensor, wanted: Iterable[dict[str, str]]) -> dict[str, torch.Tensor]:
    """The states (all their rows) in every form the ``dump_forms`` in ``wanted`` name, on their device, before the
    copy to the host: one pass over the rows a form (each request's rows are sliced out at the copy)."""
    forms = set().union(*(w.values() for w in wanted))
    on_gpu = aux.is_cuda  # few kernel launches a forward there; blocks that stay in cache on a CPU
    out = {"final": final, "aux": aux}
    for name, states in (("final", final), ("aux", aux)):
        if f"{name}_fp8" in forms:  # half the bytes through PCIe, pinned memory, the dump and the disk
            block = FP8_DEVICE_BLOCK_BYTES if on_gpu else FP8_BLOCK_BYTES
            out[f"{name}_fp8"], out[f"{name}_fp8_scale"] = encode_fp8(states, block)
    if "aux_e2m1" in forms:  # a quarter of the aux states' bytes, and no 4-bit encoding on the workers' cores
        out["aux_e2m1"], out["aux_block_scale"] = encode_fp4(aux, FP4_DEVICE_BLOCK_BYTES) if on_gpu else encode_fp4(aux)
    return out


@dataclass
class Dump:
    hidden_states: torch.Tensor | None  # [T, H]; None in a dump of the top-k in its place
    aux_hidden_states: torch.Tensor | None  # [T, K*H]; None in a dump of 4-bit aux states (``aux_fp4``)
    metadata: dict[str, str]
    slices: dict[str, FileSlice] = field(default_factory=dict)
    """Where the tensors lie in the dump file: a store that keeps them as they are copies these."""
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    """``hidden_states_scale`` and ``aux_hidden_states_scale`` [T, 1] of an fp8 dump; empty otherwise."""
    topk: dict[str, torch.Tensor] = field(default_factory=dict)
    """``topk_ids`` and ``topk_logp`` [T, k] of a dump that was asked for them; empty otherwise."""
    aux_fp4: dict[str, torch.Tensor] = field(default_factory=dict)
    """``aux_hidden_states_e2m1`` and ``aux_hidden_states_block_scale`` of 4-bit aux states; empty otherwise."""

    @property
    def fp8(self) -> bool:
        return self.metadata.get("storage") == FP8_STORAGE

    @property
    def full_width(self) -> dict[str, torch.Tensor]:
        """The states the dump holds at full width (in the model dtype or fp8), by name."""
        pairs = zip(STATE_TENSORS, (self.hidden_states, self.aux_hidden_states), strict=True)
        return {k: t for k, t in pairs if t is not None}

    @property
    def states(self) -> dict[str, torch.Tensor]:
        """Every state tensor the dump holds, by name, as the store takes them (shared/store.py)."""
        return {**self.full_width, **self.scales, **self.topk, **self.aux_fp4}

    @property
    def hidden_size(self) -> int:
        """H, read from whichever state the dump holds (the aux states are K*H wide; 4-bit codes hold two a byte)."""
        if self.hidden_states is not None:
            return self.hidden_states.shape[-1]
        return self.aux_width // len(self.aux_layer_ids)

    @property
    def aux_width(self) -> int:
        """K*H: the aux states' width, at full width or 4-bit encoded."""
        if self.aux_hidden_states is not None:
            return self.aux_hidden_states.shape[-1]
        return 2 * self.aux_fp4[FP4_AUX_TENSORS[0]].shape[-1]

    def with_layers(self, wanted: list[int]) -> "Dump":
        """The dump reduced to layers ``wanted``, in that order: each one's H-wide block of the aux states (of their
        4-bit codes and block scales) taken out, the rest as it is; the dump itself when it holds exactly those.
        A server may capture the layers of several drafters at once (EAGLE-3's and DFlash's), each run storing its
        own. ``LayersMissing`` naming the layers it lacks. The per-token fp8 scale of a row still decodes a subset."""
        have = self.aux_layer_ids
        if wanted == have:
            return self
        missing = [i for i in wanted if i not in have]
        rid = self.metadata.get("rid")
        if missing:
            raise LayersMissing(f"dump {rid}: holds layers {have}, not {missing} of {wanted}", missing)
        H = self.hidden_size
        blocks = [have.index(i) for i in wanted]

        def take(t: torch.Tensor, width: int) -> torch.Tensor:  # [T, K*width] -> [T, len(wanted)*width]
            return torch.cat([t[:, k * width : (k + 1) * width] for k in blocks], dim=1)

        aux = None if self.aux_hidden_states is None else take(self.aux_hidden_states, H)
        fp4 = {}
        if self.aux_fp4:
            if H % FP4_BLOCK:
                raise DumpInvalid(f"dump {rid}: 4-bit aux states of {H}-wide layers: a block of {FP4_BLOCK} spans "
                                  "two layers, so layers cannot be taken out of it")  # fmt: skip
            codes, scales = (self.aux_fp4[k] for k in FP4_AUX_TENSORS)
            fp4 = dict(zip(FP4_AUX_TENSORS, (take(codes, H // 2), take(scales, H // FP4_BLOCK)), strict=True))
        # the dump file's slices of the aux states are not the kept ones: those are written from memory
        slices = {k: v for k, v in self.slices.items() if k not in ("aux_hidden_states", *FP4_AUX_TENSORS)}
        metadata = {**self.metadata, "aux_layer_ids": json.dumps(list(wanted))}
        return Dump(self.hidden_states, aux, metadata, slices, self.scales, self.topk, fp4)

    @property
    def aux_layer_ids(self) -> list[int]:
        """The K layers the aux states were captured at; ``DumpInvalid`` for metadata that names none."""
        try:
            ids = json.loads(self.metadata["aux_layer_ids"])
        except (KeyError, ValueError) as e:
            raise DumpInvalid(f"dump {self.metadata.get('rid')}: no readable aux_layer_ids in its metadata") from e
        if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
            raise DumpInvalid(f"dump {self.metadata.get('rid')}: aux_layer_ids {ids!r} is not a list of layer ids")
        return ids


def dump_path(dump_dir: Path, rid: str) -> Path:
    return Path(dump_dir) / f"{check_rid(rid)}{SUFFIX}"


def write_dump(
    dump_dir: Path,
    rid: str,
    hidden_states: torch.Tensor | None,
    aux_hidden_states: torch.Tensor | None,
    *,
    aux_layer_ids: list[int],
    model: str,
    scales: tuple[torch.Tensor | None, torch.Tensor] | None = None,
    model_dtype: torch.dtype | None = None,
    topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    aux_fp4: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Path:
    """Writes one request's dump atomically and returns its path (``write_dump_parts``).

    ``scales`` (of ``hidden_states``, of ``aux_hidden_states``): the states are fp8-encoded (``encode_fp8``);
    ``model_dtype`` then names the dtype they were encoded from. ``topk``: (ids, log-probs) [T, k] of the target's
    top-k distribution (``encode_topk``), ``hidden_states`` then None. ``aux_fp4``: the aux states 4-bit encoded
    (codes, block scales; ``encode_fp4``), ``aux_hidden_states`` then None."""
    named = [
        (STATE_TENSORS, (hidden_states, aux_hidden_states)),
        (tuple(f"{k}_scale" for k in STATE_TENSORS), scales or (None, None)),
        (TOPK_TENSORS, topk or (None, None)),
        (FP4_AUX_TENSORS, aux_fp4 or (None, None)),
    ]
    parts = {k: t for names, ts in named for k, t in zip(names, ts, strict=True) if t is not None}
    return write_dump_parts(dump_dir, rid, parts, aux_layer_ids=aux_layer_ids, model=model, model_dtype=model_dtype)


def write_dump_parts(
    dump_dir: Path,
    rid: str,
    parts: dict[str, torch.Tensor],
    *,
    aux_layer_ids: list[int],
    model: str,
    model_dtype: torch.dtype | None = None,
) -> Path:
    """Writes one request's dump, its tensors by name, atomically; returns its path. The metadata follows from the
    names: fp8 states have scales, a top-k dump ``topk_ids``, 4-bit aux states their codes. No fsync: the dump dir is
    shared memory."""
    if "hidden_states" not in parts and TOPK_TENSORS[0] not in parts:
        raise ValueError(f"dump {rid}: neither the final state nor its top-k")
    if ("aux_hidden_states" in parts) == (FP4_AUX_TENSORS[0] in parts):
        raise ValueError(f"dump {rid}: give the aux states either at full width or 4-bit encoded")
    dtype = model_dtype or next((parts[k].dtype for k in STATE_TENSORS if k in parts), None)
    if dtype is None:
        raise ValueError(f"dump {rid}: no full-width state to read the model's dtype from; give model_dtype")
    tensors = {k: t.contiguous() for k, t in parts.items()}
    metadata = {
        "rid": rid,
        # the aux states are at every position (a top-k may be at some only)
        "num_tokens": str(tensors[next(k for k in ("aux_hidden_states", FP4_AUX_TENSORS[0]) if k in tensors)].shape[0]),
        "aux_layer_ids": json.dumps(list(aux_layer_ids)),
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if "aux_hidden_states_scale" in tensors:
        metadata["storage"] = FP8_STORAGE
    if TOPK_TENSORS[0] in tensors:
        metadata["topk"] = str(tensors[TOPK_TENSORS[0]].shape[1])
    if FP4_AUX_TENSORS[0] in tensors:
        metadata["aux_storage"] = FP4_STORAGE
    final = dump_path(dump_dir, rid)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    # Only the system calls a dump needs: the writer threads share the scheduler's interpreter and each call hands
    # it over and back (bench/writer_gil.py), so the temp file is removed only when the write failed.
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o644)  # safetensors creates it 0o600; the reader may be another user (the extractor's)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def read_dump(path: Path) -> Dump:
    """Maps a dump into memory (nothing is read until used); any unreadable file raises ``DumpInvalid``."""
    try:
        header = read_header(path)
        tensors = map_tensors(header)
        scales = {k: tensors[k] for k in (f"{n}_scale" for n in STATE_TENSORS) if k in tensors}
        topk = {k: tensors[k] for k in TOPK_TENSORS if k in tensors}
        aux_fp4 = {k: tensors[k] for k in FP4_AUX_TENSORS if k in tensors}
        full = [tensors.get(k) for k in STATE_TENSORS]
        if full[1] is None and not aux_fp4:
            raise KeyError("aux_hidden_states")
        slices = {k: header.slices[k] for k in tensors if k in header.slices}
        return Dump(full[0], full[1], header.metadata, slices, scales, topk, aux_fp4)
    except (TensorFileError, KeyError, ValueError, OSError) as e:
        raise DumpInvalid(f"dump {path.name}: unreadable ({type(e).__name__}: {e})") from e


def validate_dump(
    dump: Dump, *, rid: str, num_tokens: int, hidden_size: int, topk: int = 0, vocab_size: int | None = None,
    aux_fp4: bool = False, topk_rows: int | None = None,
) -> None:  # fmt: skip
    """Raises ``DumpInvalid`` with the reason unless the dump is this request's, whole and finite, with what it was
    asked for: the top-k distribution of ``topk`` entries over ``vocab_size`` tokens (``topk`` > 0; else the final
    state) at ``topk_rows`` positions (None: all), the aux states 4-bit encoded (``aux_fp4``; else at full width),
    K states of ``hidden_size`` for the K layers its metadata names."""
    where = f"dump {rid}"
    if topk:
        _validate_topk(dump, where, num_tokens if topk_rows is None else topk_rows, topk, vocab_size)
    got_rid = dump.metadata.get("rid")
    if got_rid != rid:
        raise DumpInvalid(f"{where}: metadata rid is {got_rid!r}")
    num_aux = len(dump.aux_layer_ids)
    if not topk and dump.hidden_states is None:
        raise DumpInvalid(f"{where}: holds no hidden_states (the final state), and no top-k was asked for")
    if aux_fp4 != bool(dump.aux_fp4):
        older = " (a server older than this worker does not encode them: update its image)" if aux_fp4 else ""
        raise DumpInvalid(f"{where}: aux states {'4-bit' if dump.aux_fp4 else 'at full width'}, but "
                          f"{'4-bit' if aux_fp4 else 'full width'} was asked for{older}")  # fmt: skip
    if aux_fp4:
        try:
            check_fp4(*(dump.aux_fp4[k] for k in FP4_AUX_TENSORS), rows=num_tokens, width=num_aux * hidden_size,
                      where=where)  # fmt: skip
        except Fp4Error as e:
            raise DumpInvalid(str(e)) from e
    widths = {"hidden_states": hidden_size, "aux_hidden_states": num_aux * hidden_size}
    full = dump.full_width
    for name, t in full.items():
        if tuple(t.shape) != (num_tokens, widths[name]):
            layers = f" ({num_aux} layers {dump.aux_layer_ids} of {hidden_size})" if name == "aux_hidden_states" else ""
            raise DumpInvalid(
                f"{where}: {name} shape {tuple(t.shape)}, expected ({num_tokens}, {widths[name]}){layers}"
            )
    dtypes = {t.dtype for t in full.values()}
    if len(dtypes) > 1 or not all(d.is_floating_point for d in dtypes):
        raise DumpInvalid(f"{where}: dtypes {' / '.join(str(t.dtype) for t in full.values())}, expected one "
                          "floating dtype")  # fmt: skip
    if dump.metadata.get("num_tokens") != str(num_tokens):
        raise DumpInvalid(f"{where}: metadata num_tokens {dump.metadata.get('num_tokens')!r}, expected {num_tokens}")
    if any((d == FP8) != dump.fp8 for d in dtypes):
        raise DumpInvalid(
            f"{where}: states are {dtypes.pop()} but metadata storage is {dump.metadata.get('storage')!r}"
        )
    if dump.fp8:
        _validate_fp8(dump, full, where, num_tokens)
        return
    for name, t in full.items():
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


def _validate_fp8(dump: Dump, full: dict[str, torch.Tensor], where: str, num_tokens: int) -> None:
    """An fp8 dump: finite positive scales, and no NaN among the values (e4m3fn has no infinity)."""
    for name, values in full.items():
        scale = dump.scales.get(f"{name}_scale")
        if scale is None or tuple(scale.shape) != (num_tokens, 1) or scale.dtype != torch.float32:
            got = None if scale is None else (tuple(scale.shape), scale.dtype)
            raise DumpInvalid(f"{where}: {name}_scale is {got}, expected ({num_tokens}, 1) float32")
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            raise DumpInvalid(f"{where}: {name}_scale is not finite and positive (first at token {first})")
        for rows in row_blocks(values, FINITE_CHECK_BYTES):
            nan = (values[rows].view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn's only non-finite codes
            if bool(nan.any()):
                bad_row = rows.start + int(nan.any(dim=-1).nonzero()[0, 0])
                raise DumpInvalid(f"{where}: {name} has NaN (first at token {bad_row})")


def _validate_topk(dump: Dump, where: str, rows: int, k: int, vocab_size: int | None) -> None:
    if len(dump.topk) != len(TOPK_TENSORS):
        raise DumpInvalid(f"{where}: asked for the top-{k} distribution, the dump holds none (does its server "
                          f"compute it? the reference server does)")  # fmt: skip
    if vocab_size is None:
        raise DumpInvalid(f"{where}: the run records no vocabulary size to check its top-{k} ids against")
    got = dump.topk[TOPK_TENSORS[0]].shape[0]
    if got != rows:
        older = f" (a server older than this worker ignores {TOPK_ROWS_PARAM}: update its image)" if got > rows else ""
        raise DumpInvalid(f"{where}: top-{k} distribution of {got} rows, {rows} asked for{older}")
    try:
        check_topk(*(dump.topk[n] for n in TOPK_TENSORS), rows=rows, k=k, vocab_size=vocab_size, where=where)
    except TopkError as e:
        raise DumpInvalid(str(e)) from e
