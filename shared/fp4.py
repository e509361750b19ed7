"""Block-scaled 4-bit states: e2m1 values with one scale per block of ``FP4_BLOCK`` elements of a row.

An e2m1 code is a sign bit and one of eight magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; two codes share a byte
(the even element in the low nibble). Each block of 32 consecutive elements of a row has its own bfloat16 scale,
amax / 6, so the block's largest magnitude maps to 6 and a row's outlier features (a few channels of the residual
stream that are 100x the rest) cost only their own block's precision. Per element: 4 bits + 16 / 32 bits of scale,
0.5625 bytes, 0.28 of bf16.

Plain torch ops throughout: the workers may run it on the CPU and the servers run it on their GPU before the copy to
the host (shared/dumpfile.py); both round the same way (to the nearest magnitude, ties to the smaller:
``magnitude_codes``).
Every 4-bit code decodes to a finite number, so a block is corrupt only through its scale (``check_fp4``).
"""

import torch

from .layout import FP4_BLOCK
from .tensorfile import row_blocks

FP4_MAX = 6.0
SCALE_DTYPE = torch.bfloat16
_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_INV_MAX = 1.0 / FP4_MAX
_BLOCK_BYTES = 1 << 20
FP4_DEVICE_BLOCK_BYTES = 128 << 20
"""Rows a block when a server encodes on its GPU: float32 temporaries of a few times this, beside the model."""


class Fp4Error(ValueError):
    """States that cannot be stored or read as block-scaled 4-bit: a width no block divides, a corrupt scale."""


def encode_fp4(x: torch.Tensor, block_bytes: int = _BLOCK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (uint8 codes [T, D/2], bfloat16 scales [T, D/32]) on x's device, x ≈ decode_fp4(codes, scales).
    ``block_bytes``: of x's rows at a time (a GPU wants large blocks: each is some ten kernel launches)."""
    T, D = x.shape
    if D % FP4_BLOCK:
        raise Fp4Error(f"states {D} wide: 4-bit storage needs a width divisible by {FP4_BLOCK}")
    codes = torch.empty(T, D // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(T, D // FP4_BLOCK, dtype=SCALE_DTYPE, device=x.device)
    for rows in row_blocks(x, block_bytes):
        block = x[rows].to(torch.float32).view(-1, D // FP4_BLOCK, FP4_BLOCK)  # [t, blocks, 32]
        amax = block.abs().amax(-1, keepdim=True)
        # the scale is rounded to bfloat16 first and the values divided by the rounded one, so decode's product
        # is what was encoded; an all-zero block gets scale 1 (every scale stored is positive). amax times 1/6, not
        # amax / 6: CUDA turns a division by a scalar into that product, so both devices give the same bits.
        s = torch.where(amax > 0, amax * _INV_MAX, 1.0).to(SCALE_DTYPE)
        scales[rows] = s.view(-1, D // FP4_BLOCK)
        scaled = block / s.to(torch.float32)
        code = magnitude_codes(scaled.abs()) | ((scaled < 0).to(torch.uint8) << 3)
        code = code.view(-1, D // 2, 2)
        codes[rows] = (code[..., 0] | (code[..., 1] << 4)).view(-1, D // 2)
    return codes, scales


def magnitude_codes(a: torch.Tensor) -> torch.Tensor:
    """|x| as scaled (float32, >= 0) -> the index of its nearest e2m1 magnitude, ties to the smaller (0..7; above 6
    -> 7): the number of midpoints {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5} below it. Below 2 the midpoints are 0.25 +
    0.5 j, counted by ceil(2a - 0.5) (exact in float32 there); then three comparisons. 3x faster on a CPU core than
    ``torch.bucketize`` against the midpoints, with the same codes (tests/shared/test_layouts.py)."""
    m = (a * 2 - 0.5).ceil_().clamp_(0, 4).to(torch.uint8)
    return m.add_(a > 2.5).add_(a > 3.5).add_(a > 5.0)


def decode_fp4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(uint8 [T, D/2], bfloat16 [T, D/32]) -> [T, D] in ``dtype``."""
    T, half = codes.shape
    D = 2 * half
    table = torch.cat([_MAGNITUDES, -_MAGNITUDES]).to(codes.device)  # code -> value, sign in bit 3
    out = torch.empty(T, D, dtype=dtype, device=codes.device)
    for rows in row_blocks(out, _BLOCK_BYTES):
        c = codes[rows]
        pair = torch.stack([c & 0x0F, c >> 4], -1).view(-1, D).long()  # [t, D]
        values = table[pair].view(-1, D // FP4_BLOCK, FP4_BLOCK) * scales[rows].to(torch.float32)[..., None]
        out[rows] = values.view(-1, D).to(dtype)
    return out


def check_fp4(codes: torch.Tensor, scales: torch.Tensor, *, rows: int, width: int, where: str) -> None:
    """Raises ``Fp4Error`` naming ``where`` and the first bad token unless the pair is ``rows`` x ``width``
    block-scaled 4-bit states with finite positive scales."""
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (rows, width // 2):
        raise Fp4Error(f"{where}: 4-bit codes are {codes.dtype} {tuple(codes.shape)}, expected uint8 "
                       f"({rows}, {width // 2})")  # fmt: skip
    if scales.dtype != SCALE_DTYPE or tuple(scales.shape) != (rows, width // FP4_BLOCK):
        raise Fp4Error(f"{where}: 4-bit block scales are {scales.dtype} {tuple(scales.shape)}, expected "
                       f"{SCALE_DTYPE} ({rows}, {width // FP4_BLOCK})")  # fmt: skip
    bad = ~(torch.isfinite(scales) & (scales > 0))
    if bool(bad.any()):
        token, block = (int(i) for i in bad.nonzero()[0])
        raise Fp4Error(f"{where}: corrupt 4-bit block (token {token}, block {block}): scale "
                       f"{float(scales[token, block])} is not finite and positive")  # fmt: skip
