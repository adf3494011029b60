"""MXFP4 (OCP MX) packed weights: E2M1 nibbles, one E8M0 scale byte per 32 values along the input axis.

`blocks[..., g, b]` holds input elements 32g + 2b (low nibble) and 32g + 2b + 1 (high nibble).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

BLOCK = 32
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                np.float32)
SCALE_BIAS = 127


def dequantize(blocks, scales, dtype=jnp.bfloat16):
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype` (exact for bf16/f32)."""
    lut = jnp.asarray(E2M1)
    lo = lut[(blocks & 0x0F).astype(jnp.int32)]
    hi = lut[(blocks >> 4).astype(jnp.int32)]
    vals = jnp.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], BLOCK)  # [..., G, 32]
    vals = jnp.ldexp(vals, scales.astype(jnp.int32)[..., None] - SCALE_BIAS)
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK).astype(dtype)


def random_scale_byte(fan_in: int) -> int:
    """Scale byte giving uniformly random nibbles a weight std of about 1/sqrt(fan_in)."""
    nibble_std = float(np.sqrt(np.mean(E2M1.astype(np.float64) ** 2)))
    return int(SCALE_BIAS + np.round(-np.log2(nibble_std * np.sqrt(fan_in))))
