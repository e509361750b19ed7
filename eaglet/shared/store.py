"""The durable data volume. Every path under ``<data>/runs/<run>/`` is made here, so another backend
(an object store) is one module, not a rewrite.

Layout of a run::

    runs/<run>/samples/            ingested token ids (see eaglet/shared/samples.py)
    runs/<run>/hidden/<2 hex>/<sample>.safetensors
    runs/<run>/drafter/            the trained EAGLE-3 draft model
    runs/<run>/checkpoints/        trainer state for resume

A sample file holds ``input_ids`` (int32 [T]), ``loss_mask`` (uint8 [T]), ``hidden_states`` [T, H],
``aux_hidden_states`` [T, 3H] and the dump's metadata. It is written as temp, fsync, rename: a file
that exists is complete.

The two state tensors are stored as dumped (``model``), as ``bf16``, or as ``fp8``: float8 e4m3 with a
per-token scale each (``hidden_states_scale`` [T, 1], ``aux_hidden_states_scale`` [T, 1], float32;
metadata ``storage: fp8_e4m3``), half the bytes of bf16. ``encode_states`` and ``decode_states`` are the
only code that knows these encodings.
"""

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from eaglet.shared.ids import check_id, fanout
from eaglet.shared.tensorfile import FileSlice, TensorFileError, read_header, row_blocks, write_tensors

SAMPLE_TENSORS = ("input_ids", "loss_mask", "hidden_states", "aux_hidden_states")
STATE_TENSORS = ("hidden_states", "aux_hidden_states")
STORE_DTYPES = ("model", "bf16", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_STORAGE = "fp8_e4m3"
FP8_BLOCK_BYTES = 1 << 20  # on the CPU: a block stays in cache
FP8_DEVICE_BLOCK_BYTES = 256 << 20  # on a GPU: few kernel launches a forward (1 MiB blocks cost 17 % of 8B prefill)
_FP8_INV_MAX = 1.0 / FP8_MAX


class StoreError(OSError):
    """A sample file could not be written (disk full, permissions): the sample is retried, never half-stored."""


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
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], store_dtype: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The sample's tensors and metadata as stored under ``store_dtype`` (model | bf16 | fp8).

    States that arrive already fp8-encoded (a dump the server encoded, metadata ``storage: fp8_e4m3``, scales
    beside them) are stored as they are when the run stores fp8; they never go back to full width."""
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store dtype {store_dtype!r}: expected one of {', '.join(STORE_DTYPES)}")
    out = {k: tensors[k] for k in SAMPLE_TENSORS}
    if metadata.get("storage") == FP8_STORAGE:
        if store_dtype != "fp8":
            raise ValueError(f"states already stored as {FP8_STORAGE} cannot be stored as {store_dtype!r}")
        out.update({f"{k}_scale": tensors[f"{k}_scale"] for k in STATE_TENSORS})
    elif store_dtype == "bf16":
        out.update({k: tensors[k].to(torch.bfloat16) for k in STATE_TENSORS})
        metadata = {**metadata, "storage": "bf16"}
    elif store_dtype == "fp8":
        for k in STATE_TENSORS:
            out[k], out[f"{k}_scale"] = encode_fp8(tensors[k])
        metadata = {**metadata, "storage": FP8_STORAGE}
    return out, metadata


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
    """The two state tensors of a stored sample, back in ``dtype``."""
    if metadata.get("storage") == FP8_STORAGE:
        return {k: _decode_fp8(tensors[k], tensors[f"{k}_scale"], dtype) for k in STATE_TENSORS}
    return {k: tensors[k].to(dtype) for k in STATE_TENSORS}


def write_sample(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    *,
    writer: str | None = None,
    store_dtype: str = "model",
    slices: dict[str, FileSlice] | None = None,
) -> int:
    """Writes one sample file durably (temp, fsync, rename, fsync of the folder); returns its size.

    ``writer`` names the temp file (default: the pid); one writer writes one file at a time. ``store_dtype``:
    see ``encode_states``. ``slices``: where state tensors already lie in a file (the dump they came from);
    a state stored as it is is then copied file to file by the kernel, never through this process."""
    encoded, metadata = encode_states(tensors, metadata, store_dtype)
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


def sample_header(path: Path) -> tuple[dict[str, list[int]], dict[str, str]] | None:
    """Shapes and metadata of a stored sample, from its header alone; None if absent or unreadable."""
    try:
        header = read_header(path)
    except (OSError, TensorFileError):
        return None  # absent, or truncated or padded: not a file we wrote
    if any(k not in header.slices for k in SAMPLE_TENSORS):
        return None
    return {k: list(s.shape) for k, s in header.slices.items()}, header.metadata


def sample_is_complete(path: Path, num_tokens: int) -> bool:
    """True if a verified sample file of ``num_tokens`` tokens is already stored: it is not extracted again."""
    found = sample_header(path)
    if found is None:
        return False
    shapes, metadata = found
    names: tuple[str, ...] = SAMPLE_TENSORS
    if metadata.get("storage") == FP8_STORAGE:
        names += tuple(f"{k}_scale" for k in STATE_TENSORS)
        if any(k not in shapes for k in names):
            return False
    return all(shapes[k][0] == num_tokens for k in names)


def open_sample(path: Path) -> dict[str, torch.Tensor]:
    """Reads one stored sample (memory-mapped by safetensors)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise StoreError(f"reading {path}: {e}") from e


def read_metadata(path: Path) -> dict[str, str]:
    found = sample_header(path)
    if found is None:
        raise StoreError(f"{path}: missing or incomplete sample file")
    return found[1]
