"""The durable data volume. Every path under ``<data>/runs/<run>/`` is made here, so another backend
(an object store) is one module, not a rewrite.

Layout of a run::

    runs/<run>/samples/            ingested token ids (see shared/samples.py)
    runs/<run>/hidden/<2 hex>/<sample>.safetensors
    runs/<run>/drafter/            the trained EAGLE-3 draft model
    runs/<run>/checkpoints/        trainer state for resume

A sample file holds ``input_ids`` (int32 [T]), ``loss_mask`` (uint8 [T]), ``hidden_states`` [T, H],
``aux_hidden_states`` [T, 3H] and the dump's metadata. It is written as temp, fsync, rename: a file
that exists is complete.

The two state tensors are stored as dumped (``model``), as ``bf16``, or as ``fp8``: float8 e4m3 with a
per-token scale each (``hidden_states_scale`` [T, 1], ``aux_hidden_states_scale`` [T, 1], float32;
metadata ``storage: fp8_e4m3``), half the bytes of bf16. The run's layout (shared/layout.py) may keep
less: the final state at loss positions only, the target's top-k distribution in its place (``topk_ids``,
``topk_logp``), the aux states as block-scaled 4-bit (``aux_hidden_states_e2m1``,
``aux_hidden_states_block_scale``); the metadata names it (``final_storage``, ``topk``, ``aux_storage``).
``encode_states`` and ``decode_states`` are the only code that knows these encodings.
"""

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .fp4 import decode_fp4, encode_fp4
from .ids import check_id, fanout
from .layout import FP4_STORAGE, Layout
from .tensorfile import FileSlice, Header, TensorFileError, read_header, row_blocks, write_tensors
from .topk import TOPK_TENSORS

STATE_TENSORS = ("hidden_states", "aux_hidden_states")
STORE_DTYPES = ("model", "bf16", "fp8")
FP4_AUX_TENSORS = ("aux_hidden_states_e2m1", "aux_hidden_states_block_scale")
"""4-bit aux states: uint8 codes [T, 3H/2] and bfloat16 block scales [T, 3H/32] (shared/fp4.py)."""
DEFAULT_LAYOUT = Layout()
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_STORAGE = "fp8_e4m3"
FP8_BLOCK_BYTES = 1 << 20  # on the CPU: a block stays in cache
FP8_DEVICE_BLOCK_BYTES = 256 << 20  # on a GPU: few kernel launches a forward (1 MiB blocks cost 17 % of 8B prefill)
_FP8_INV_MAX = 1.0 / FP8_MAX


def loss_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """The positions [N] (int64, rising) whose final state a ``loss`` layout keeps: those predicting a loss token."""
    return torch.nonzero(loss_mask[1:].bool()).flatten()


class StoreError(OSError):
    """A sample file could not be written (disk full, permissions: the sample is retried, never half-stored) or
    read (absent, truncated, not a sample file)."""


def run_dir(data_dir: Path, run_id: str) -> Path:
    return Path(data_dir) / "runs" / check_id(run_id, "run id")


def samples_dir(data_dir: Path, run_id: str) -> Path:
    return run_dir(data_dir, run_id) / "samples"


def hidden_dir(data_dir: Path, run_id: str) -> Path:
    return run_dir(data_dir, run_id) / "hidden"


def drafter_dir(data_dir: Path, run_id: str) -> Path:
    return run_dir(data_dir, run_id) / "drafter"


def checkpoints_dir(data_dir: Path, run_id: str) -> Path:
    return run_dir(data_dir, run_id) / "checkpoints"


def sample_path(data_dir: Path, run_id: str, sample_id: str) -> Path:
    check_id(sample_id, "sample id")
    return hidden_dir(data_dir, run_id) / fanout(sample_id) / f"{sample_id}.safetensors"


def partial_path(path: Path, writer: str) -> Path:
    """The temp name ``writer`` writes ``path`` under. Known from the writer alone, so the file a killed writer
    left can be removed without listing the folder."""
    return path.with_name(f".{path.name}.{check_id(writer, 'writer')}.tmp")


def encode_states(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], store_dtype: str, layout: Layout = DEFAULT_LAYOUT
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The sample's tensors and metadata as stored under ``store_dtype`` (model | bf16 | fp8) and ``layout``
    (shared/layout.py).

    States that arrive already encoded by the server are stored as they are: fp8 states (metadata ``storage:
    fp8_e4m3``, scales beside them) when the run stores fp8, 4-bit aux states (``aux_storage``) when it stores
    them so, the top-k distribution (``topk_ids``, ``topk_logp``) when its layout keeps one; they never go back to
    full width. A ``loss`` layout keeps the final state's rows at loss positions only."""
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store dtype {store_dtype!r}: expected one of {', '.join(STORE_DTYPES)}")
    arrived_fp8 = metadata.get("storage") == FP8_STORAGE
    if arrived_fp8 and store_dtype != "fp8":
        raise ValueError(f"states already stored as {FP8_STORAGE} cannot be stored as {store_dtype!r}")
    out = {k: tensors[k] for k in ("input_ids", "loss_mask")}
    if layout.final == "topk":
        if any(k not in tensors for k in TOPK_TENSORS):
            raise ValueError(f"layout {layout.name}: the dump holds no top-k distribution (topk_ids, topk_logp)")
        out.update(_topk_rows(tensors, layout))
    else:
        rows = loss_rows(tensors["loss_mask"]) if layout.final == "loss" else None
        out.update(_full_width(tensors, "hidden_states", store_dtype, arrived_fp8, rows))
    if layout.aux == "fp4":
        out.update(_fp4_aux(tensors, metadata, arrived_fp8))
    else:
        out.update(_full_width(tensors, "aux_hidden_states", store_dtype, arrived_fp8, None))
    metadata = {k: v for k, v in metadata.items() if k not in ("final_storage", "topk", "aux_storage")}
    metadata.update(layout.metadata())
    if store_dtype == "bf16":
        metadata["storage"] = "bf16"
    elif store_dtype == "fp8":
        metadata["storage"] = FP8_STORAGE
    return out, metadata


def _topk_rows(tensors: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """The top-k tensors at the rows ``layout`` keeps: as they arrived when the server scored those rows only, else
    (a distribution at every position) the loss rows taken out."""
    topk = {k: tensors[k] for k in TOPK_TENSORS}
    if layout.topk_rows == "all":
        return topk
    rows = loss_rows(tensors["loss_mask"])
    have = topk[TOPK_TENSORS[0]].shape[0]
    if have == len(rows):
        return topk
    if have != len(tensors["input_ids"]):
        raise ValueError(f"layout {layout.name}: a top-k of {have} rows, neither the {len(rows)} loss positions nor "
                         f"all {len(tensors['input_ids'])}")  # fmt: skip
    return {k: t[rows] for k, t in topk.items()}


def _full_width(
    tensors: dict[str, torch.Tensor], name: str, store_dtype: str, arrived_fp8: bool, rows: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """One state tensor (its ``rows`` only, when given) in ``store_dtype``, with its fp8 scale where it has one."""
    x = tensors[name]
    if arrived_fp8:
        scale = tensors[f"{name}_scale"]
        return {name: x, f"{name}_scale": scale} if rows is None else {name: x[rows], f"{name}_scale": scale[rows]}
    if rows is not None:
        x = x[rows]
    if store_dtype == "bf16":
        return {name: x.to(torch.bfloat16)}
    if store_dtype == "fp8":
        values, scale = encode_fp8(x)
        return {name: values, f"{name}_scale": scale}
    return {name: x}


def _fp4_aux(tensors: dict[str, torch.Tensor], metadata: dict[str, str], arrived_fp8: bool) -> dict[str, torch.Tensor]:
    if metadata.get("aux_storage") == FP4_STORAGE:
        return {k: tensors[k] for k in FP4_AUX_TENSORS}
    if arrived_fp8:
        # fp8 then 4-bit would round twice: such a run asks its server for full-width aux states
        raise ValueError(f"aux states arrived as {FP8_STORAGE}: 4-bit aux states are encoded from full width only")
    codes, scales = encode_fp4(tensors["aux_hidden_states"])
    return dict(zip(FP4_AUX_TENSORS, (codes, scales), strict=True))


def encode_fp8(x: torch.Tensor, block_bytes: int = FP8_BLOCK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (float8 e4m3 [T, D], float32 scale [T, 1]) on x's device, x ≈ value * scale.

    The one encoder: the workers run it on the CPU, the inference servers on the GPU before the copy to the
    host. Every step is exact or correctly rounded float32 arithmetic, row by row, so both give the same bits.
    A block of rows at a time: no float32 copy of the whole tensor (on the GPU, none beside the server's memory).
    The scale is amax times 1/448, a multiplication on both: CUDA turns a division by a scalar into one, and a
    true division on the CPU would round differently."""
    values = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, device=x.device)
    for rows in row_blocks(x, block_bytes):
        block = x[rows].to(torch.float32, copy=True)
        amax = block.abs().amax(-1, keepdim=True)
        scale[rows] = s = torch.where(amax > 0, amax * _FP8_INV_MAX, 1.0)
        # clamp: amax / scale can round a hair above 448, and e4m3fn has no inf to saturate to
        values[rows] = block.div_(s).clamp_(-FP8_MAX, FP8_MAX)
    return values, scale


def _decode_fp8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(values.shape, dtype=dtype)
    for rows in row_blocks(values, FP8_BLOCK_BYTES):
        out[rows] = values[rows].to(torch.float32).mul_(scale[rows])
    return out


def decode_states(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """A stored sample's states for training: ``aux_hidden_states`` [T, 3H] in ``dtype``, and either
    ``hidden_states`` [T, H] in ``dtype`` (zero rows where a ``loss`` layout kept none: no loss reads them) or, for
    a ``topk`` layout, ``topk_ids`` int64 [T, k] and ``topk_logp`` float32 [T, k] (log-probabilities -inf where one
    kept at loss positions only has none: no loss reads them either)."""
    layout = Layout.from_metadata(metadata)
    fp8 = metadata.get("storage") == FP8_STORAGE

    def full(name: str) -> torch.Tensor:
        if fp8:
            return _decode_fp8(tensors[name], tensors[f"{name}_scale"], dtype)
        return tensors[name].to(dtype)

    if layout.aux == "fp4":
        out = {"aux_hidden_states": decode_fp4(tensors[FP4_AUX_TENSORS[0]], tensors[FP4_AUX_TENSORS[1]], dtype)}
    else:
        out = {"aux_hidden_states": full("aux_hidden_states")}
    if layout.final == "topk" and layout.topk_rows == "loss":  # no distribution elsewhere: all its mass in the tail
        rows, k = loss_rows(tensors["loss_mask"]), tensors["topk_ids"].shape[1]
        ids = torch.zeros(len(tensors["input_ids"]), k, dtype=torch.int64)
        logp = torch.full((len(tensors["input_ids"]), k), float("-inf"))
        ids[rows], logp[rows] = tensors["topk_ids"].long(), tensors["topk_logp"].float()
        out.update(topk_ids=ids, topk_logp=logp)
    elif layout.final == "topk":
        out.update(topk_ids=tensors["topk_ids"].long(), topk_logp=tensors["topk_logp"].float())
    elif layout.final == "loss":
        hidden = torch.zeros(len(tensors["input_ids"]), tensors["hidden_states"].shape[1], dtype=dtype)
        hidden[loss_rows(tensors["loss_mask"])] = full("hidden_states")
        out["hidden_states"] = hidden
    else:
        out["hidden_states"] = full("hidden_states")
    return out


def write_sample(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    *,
    writer: str | None = None,
    store_dtype: str = "model",
    layout: Layout = DEFAULT_LAYOUT,
    slices: dict[str, FileSlice] | None = None,
) -> int:
    """Writes one sample file durably (temp, fsync, rename, fsync of the folder); returns its size.

    ``writer`` names the temp file (default: the pid); one writer writes one file at a time. ``store_dtype``,
    ``layout``: see ``encode_states``. ``slices``: where state tensors already lie in a file (the dump they came from);
    a state stored as it is is then copied file to file by the kernel, never through this process."""
    encoded, metadata = encode_states(tensors, metadata, store_dtype, layout)
    parts: dict[str, torch.Tensor | FileSlice] = {}
    for name in sorted(encoded, key=lambda k: -encoded[k].nbytes):  # largest first: every part stays aligned
        kept = slices is not None and name in slices and encoded[name] is tensors.get(name)
        parts[name] = slices[name] if kept and slices is not None else encoded[name]
    tmp = partial_path(path, writer or str(os.getpid()))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # inside the try: a full disk fails here too
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            size = write_tensors(fd, parts, metadata)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        raise StoreError(e.errno, f"writing {path}: {e.strerror or e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    return size


def _sample_file_header(path: Path) -> Header:
    """A stored sample's header; StoreError saying what is wrong with a file that is absent, truncated or padded,
    or not a sample file. The states a layout keeps are checked by who knows the layout (``stored_rows``)."""
    try:
        header = read_header(path)
    except (OSError, TensorFileError) as e:
        raise StoreError(f"{path}: missing or incomplete sample file ({e})") from e
    missing = [k for k in ("input_ids", "loss_mask") if k not in header.slices]
    if missing:
        raise StoreError(f"{path}: not a sample file (no {', '.join(missing)})")
    return header


def sample_header(path: Path) -> tuple[dict[str, list[int]], dict[str, str]] | None:
    """Shapes and metadata of a stored sample, from its header alone; None if absent or unreadable."""
    try:
        header = _sample_file_header(path)
    except StoreError:
        return None
    return {k: list(s.shape) for k, s in header.slices.items()}, header.metadata


def sample_is_complete(path: Path, num_tokens: int, num_loss_rows: int | None = None) -> bool:
    """True if a verified sample file of ``num_tokens`` tokens is already stored: it is not extracted again.
    ``num_loss_rows``: the sample's rows at loss positions (``loss_rows``), what a ``loss`` layout keeps; unknown
    (None), such a file counts as complete with any row count up to ``num_tokens``."""
    found = sample_header(path)
    if found is None:
        return False
    shapes, metadata = found
    try:
        rows = stored_rows(Layout.from_metadata(metadata), metadata, num_tokens, num_loss_rows)
    except ValueError:
        return False  # a layout this code does not know: not a file we wrote
    if any(k not in shapes for k in rows):
        return False
    unknown = [k for k, n in rows.items() if n is None]  # a loss layout's rows, their count not given
    if any(shapes[k][0] > num_tokens for k in unknown):
        return False
    return all(shapes[k][0] == n for k, n in rows.items() if n is not None)


def stored_rows(
    layout: Layout, metadata: dict[str, str], num_tokens: int, num_loss_rows: int | None
) -> dict[str, int | None]:
    """Each tensor a sample of ``layout`` stores, with its row count (None: a ``loss`` layout's, not known)."""
    rows: dict[str, int | None] = {"input_ids": num_tokens, "loss_mask": num_tokens}
    fp8 = metadata.get("storage") == FP8_STORAGE
    if layout.final == "topk":
        rows.update(dict.fromkeys(TOPK_TENSORS, num_loss_rows if layout.topk_rows == "loss" else num_tokens))
    else:
        n = num_loss_rows if layout.final == "loss" else num_tokens
        rows.update(dict.fromkeys(("hidden_states", *(("hidden_states_scale",) if fp8 else ())), n))
    aux = FP4_AUX_TENSORS if layout.aux == "fp4" else ("aux_hidden_states", *(("aux_hidden_states_scale",) * fp8))
    rows.update(dict.fromkeys(aux, num_tokens))
    return rows


def state_widths(shapes: dict[str, list[int]]) -> tuple[int | None, int]:
    """(final state's width, None where a top-k is stored instead; the aux states' width) of a stored sample's
    tensor shapes (``sample_header``)."""
    hidden = shapes["hidden_states"][-1] if "hidden_states" in shapes else None
    if FP4_AUX_TENSORS[0] in shapes:
        return hidden, 2 * shapes[FP4_AUX_TENSORS[0]][-1]  # two 4-bit codes a byte
    return hidden, shapes["aux_hidden_states"][-1]


def open_sample(path: Path) -> dict[str, torch.Tensor]:
    """Reads one stored sample (memory-mapped by safetensors)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise StoreError(f"reading {path}: {e}") from e


def read_metadata(path: Path) -> dict[str, str]:
    """A stored sample's metadata; StoreError saying what is wrong with a file that is absent, truncated, or not
    a sample file."""
    return _sample_file_header(path).metadata
