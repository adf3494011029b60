"""MXFP4 (OCP MX) packed weights: E2M1 nibbles, one E8M0 scale byte per 32 values along the input axis.

`blocks[..., g, b]` holds input elements 32g + 2b (low nibble) and 32g + 2b + 1 (high nibble).
"""

from __future__ import annotations

import numpy as np

# One definition of the format, shared with the kernels (eagle3_jax.pallas imports nothing of the package).
from eagle3_jax.pallas.moe import BLOCK, E2M1, SCALE_BIAS, dequantize  # noqa: F401

_MAGNITUDES = E2M1[:8].astype(np.float64)  # 0, 0.5, 1, 1.5, 2, 3, 4, 6
_MIDPOINTS = (_MAGNITUDES[1:] + _MAGNITUDES[:-1]) / 2


def random_scale_byte(fan_in: int) -> int:
    """Scale byte giving uniformly random nibbles a weight std of about 1/sqrt(fan_in)."""
    nibble_std = float(np.sqrt(np.mean(E2M1.astype(np.float64) ** 2)))
    return int(SCALE_BIAS + np.round(-np.log2(nibble_std * np.sqrt(fan_in))))


def _round_e2m1(q):
    """|values| already scaled -> magnitude codes 0..7 (nearest, ties to the smaller; above 6 -> 6)."""
    return np.searchsorted(_MIDPOINTS, np.abs(q), side="left")


def quantize(w, chunk_rows: int = 4096):
    """Float weights [..., N] (N a multiple of 32, rows = outputs) -> (blocks uint8 [..., N/32, 16],
    scales uint8 [..., N/32]), the layout `dequantize` and the HF checkpoints use.

    Per block of 32 inputs the scale is 2^(floor(log2 amax) - 2) (the OCP MX rule: E2M1's largest
    exponent is 2) or twice that, whichever gives the smaller squared error; values round to the
    nearest E2M1 magnitude. All-zero blocks get scale byte 0 and zero codes.
    """
    w = np.asarray(w, np.float64)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"quantize: last dim {w.shape[-1]} is not a multiple of {BLOCK}")
    lead = w.shape[:-1]
    g = w.reshape(-1, w.shape[-1] // BLOCK, BLOCK)
    blocks = np.empty(g.shape[:2] + (BLOCK // 2,), np.uint8)
    scales = np.empty(g.shape[:2], np.uint8)
    for r in range(0, g.shape[0], chunk_rows):
        x = g[r:r + chunk_rows]
        amax = np.abs(x).max(-1)
        base = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2
        best_err, best = None, None
        for e in (base, base + 1):
            e = np.clip(e, -SCALE_BIAS, 127)
            q = x / np.exp2(e)[..., None]
            mag = _round_e2m1(q)
            err = ((np.sign(q) * _MAGNITUDES[mag] - q) ** 2 * np.exp2(2 * e)[..., None]).sum(-1)
            if best is None:
                best_err, best = err, (e, q, mag)
            else:
                take = err < best_err
                best = tuple(np.where(take[..., None] if a.ndim == 3 else take, a, b) for a, b in zip((e, q, mag), best))
        e, q, mag = best
        code = (mag + 8 * ((q < 0) & (mag > 0))).astype(np.uint8)
        blocks[r:r + chunk_rows] = code[..., 0::2] | (code[..., 1::2] << 4)
        scales[r:r + chunk_rows] = np.where(amax > 0, e + SCALE_BIAS, 0).astype(np.uint8)
    return blocks.reshape(*lead, -1, BLOCK // 2), scales.reshape(*lead, -1)
