"""MXFP4 (OCP MX) packed weights: E2M1 nibbles, one E8M0 scale byte per 32 values along the input axis.

`blocks[..., g, b]` (uint8 [..., G, 16]) holds input elements 32g + 2b (low nibble) and 32g + 2b + 1
(high nibble); `scales[..., g]` (uint8 [..., G]) is the group's power of two, 2^(scale - 127). Rows
are outputs, as the HF checkpoints store the experts. `dequantize` decodes (jnp), `quantize` encodes
(numpy); the Pallas kernels decode the same bits in registers (pallas/moe.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

BLOCK = 32  # inputs per scale byte
SCALE_BIAS = 127
# E2M1 nibble -> value (low nibble = even input element, high nibble = the next one).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                np.float32)
_MAGNITUDES = E2M1[:8].astype(np.float64)  # 0, 0.5, 1, 1.5, 2, 3, 4, 6
_MIDPOINTS = (_MAGNITUDES[1:] + _MAGNITUDES[:-1]) / 2
# byte -> (E2M1 value of its low nibble, of its high nibble): one table gather per byte in `dequantize`
_BYTE_PAIRS = np.stack([np.tile(E2M1, 16), np.repeat(E2M1, 16)], axis=-1)  # f32 [256, 2]


def pow2_f32(e):
    """2^e as f32 for int32 e in [-126, 127], built from its exponent bits (no exp, no ldexp)."""
    return lax.bitcast_convert_type(lax.shift_left(e + 127, jnp.int32(23)), jnp.float32)


def scale_exp2(scales, k=0):
    """2^(scale - 127 + k) as f32 for E8M0 scale bytes (normal for 1 <= scale + k <= 254)."""
    return pow2_f32(scales.astype(jnp.int32) + (k - SCALE_BIAS))


def dequantize(blocks, scales, dtype=jnp.bfloat16):
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype`: E2M1 * 2^(scale - 127),
    exact for bf16/f32 wherever that is a normal float (scale bytes 3..252 always; a backend that flushes
    f32 subnormals returns 0 below), NaN for scale byte 255 (E8M0's NaN). One gather of both nibbles'
    values per byte and one multiply by the group's power of two (faster than the earlier form in the
    grouped scan: docs/perf/moe.md)."""
    vals = jnp.asarray(_BYTE_PAIRS)[blocks.astype(jnp.int32)]  # [..., G, 16, 2]
    f = jnp.where(scales == 0, np.float32(2.0 ** -127),
                  jnp.where(scales == 255, np.nan, scale_exp2(scales)))  # [..., G]
    vals = vals.reshape(*blocks.shape[:-1], BLOCK) * f[..., None]
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK).astype(dtype)


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
                best = tuple(np.where(take[..., None] if a.ndim == 3 else take, a, b)
                             for a, b in zip((e, q, mag), best))
        e, q, mag = best
        code = (mag + 8 * ((q < 0) & (mag > 0))).astype(np.uint8)
        blocks[r:r + chunk_rows] = code[..., 0::2] | (code[..., 1::2] << 4)
        scales[r:r + chunk_rows] = np.where(amax > 0, e + SCALE_BIAS, 0).astype(np.uint8)
    return blocks.reshape(*lead, -1, BLOCK // 2), scales.reshape(*lead, -1)
