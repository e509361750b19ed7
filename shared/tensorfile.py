"""Safetensors files read and written without copies through Python.

A dump of an 8B model's prefill is 64 MB for 2,048 tokens, and a GPU server makes ~20 of them a second.
Loading each into memory and serialising it again costs a worker several passes over every byte; here a
file is memory-mapped for reading, and a tensor that is stored unchanged is copied from file to file by
the kernel (``sendfile``). The format is safetensors' own: an 8-byte little-endian header length, a JSON
header padded to 8 bytes, then the tensors' bytes back to back.
"""

import errno
import json
import math
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE_NAMES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.bool: "BOOL",
}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
MAX_HEADER = 100_000_000  # safetensors' own limit


class TensorFileError(ValueError):
    """Not a whole safetensors file: truncated, padded, or a header that does not describe its bytes."""


@dataclass(frozen=True)
class FileSlice:
    """A tensor's bytes inside a file, to be copied into another file by the kernel."""

    path: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Header:
    slices: dict[str, FileSlice]
    metadata: dict[str, str]


def read_header(path: Path) -> Header:
    """The tensors' places in the file and its metadata; raises ``TensorFileError`` unless the sizes agree."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TensorFileError(f"{path.name}: {len(head)} bytes, shorter than a header")
        header_len = int.from_bytes(head, "little")
        if header_len > MAX_HEADER:
            raise TensorFileError(f"{path.name}: header of {header_len} bytes")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise TensorFileError(f"{path.name}: header is not JSON ({e})") from e
        size = f.seek(0, os.SEEK_END)
    try:
        metadata = header.pop("__metadata__", None) or {}
        places = {name: _place(info) for name, info in header.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise TensorFileError(f"{path.name}: malformed header ({type(e).__name__}: {e})") from e
    start, slices = 8 + header_len, {}
    for name, (begin, stop, dtype, shape) in places.items():
        if stop - begin != math.prod(shape) * dtype.itemsize:
            raise TensorFileError(f"{path.name}: {name} has {stop - begin} bytes for shape {list(shape)}")
        slices[name] = FileSlice(path, start + begin, dtype, shape)
    end = max((stop for _, stop, _, _ in places.values()), default=0)
    if size != start + end:
        raise TensorFileError(f"{path.name}: {size} bytes, the header describes {start + end}")
    return Header(slices, metadata)


def _place(info: dict) -> tuple[int, int, torch.dtype, tuple[int, ...]]:
    begin, stop = (int(x) for x in info["data_offsets"])
    return begin, stop, DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"])


def map_tensors(header: Header) -> dict[str, torch.Tensor]:
    """The file's tensors as views of one private memory map: pages are read as they are touched."""
    if not header.slices:
        return {}
    path = next(iter(header.slices.values())).path
    with open(path, "rb") as f:
        # ACCESS_COPY: writable for torch.frombuffer, and a write would never reach the file.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return {
        name: torch.frombuffer(mapped, dtype=torch.uint8, count=s.nbytes, offset=s.offset).view(s.dtype).view(s.shape)
        if s.nbytes
        else torch.empty(s.shape, dtype=s.dtype)  # frombuffer refuses a count of 0
        for name, s in header.slices.items()
    }


def row_blocks(x: torch.Tensor, block_bytes: int) -> Iterator[slice]:
    """Slices of ``x`` [T, D] of about ``block_bytes`` of float32 each: a big (often memory-mapped) tensor is
    worked through while each block sits in the CPU's cache, with no temporary the size of the whole."""
    rows = max(1, block_bytes // max(1, 4 * x.shape[1]))
    for start in range(0, x.shape[0], rows):
        yield slice(start, start + rows)


def write_tensors(fd: int, parts: dict[str, torch.Tensor | FileSlice], metadata: dict[str, str]) -> int:
    """Writes a safetensors file to ``fd`` (at its current position); returns the bytes written.

    Parts are laid out in the order given: put the largest first, so each later one stays aligned."""
    header: dict[str, object] = {}
    offset = 0
    for name, part in parts.items():
        dtype, shape = (part.dtype, tuple(part.shape))
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    _write_all(fd, len(text).to_bytes(8, "little") + text)
    for part in parts.values():
        if isinstance(part, FileSlice):
            _copy_range(part, fd)
        elif part.numel():
            _write_all(fd, part.contiguous().view(-1).view(torch.uint8).numpy())
    return 8 + len(text) + offset


def _copy_range(part: FileSlice, out_fd: int) -> None:
    src = os.open(part.path, os.O_RDONLY)
    try:
        offset, left = part.offset, part.nbytes
        while left:
            try:
                sent = os.sendfile(out_fd, src, offset, left)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOSYS):
                    raise
                sent = os.write(out_fd, os.pread(src, min(left, 1 << 24), offset))  # no sendfile between these
            if sent == 0:
                raise TensorFileError(f"{part.path.name}: ended {left} bytes early")
            offset, left = offset + sent, left - sent
    finally:
        os.close(src)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]
