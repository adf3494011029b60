"""MXFP4 (OCP MX) packed weights: E2M1 nibbles, one E8M0 scale byte per 32 values along the input axis.

`blocks[..., g, b]` holds input elements 32g + 2b (low nibble) and 32g + 2b + 1 (high nibble).
"""

from __future__ import annotations

import numpy as np

# One definition of the format, shared with the kernels (eagle3_jax.pallas imports nothing of the package).
from eagle3_jax.pallas.moe import BLOCK, E2M1, SCALE_BIAS, dequantize  # noqa: F401


def random_scale_byte(fan_in: int) -> int:
    """Scale byte giving uniformly random nibbles a weight std of about 1/sqrt(fan_in)."""
    nibble_std = float(np.sqrt(np.mean(E2M1.astype(np.float64) ** 2)))
    return int(SCALE_BIAS + np.round(-np.log2(nibble_std * np.sqrt(fan_in))))
