"""Rotary position embeddings: plain and YaRN (HF `_compute_yarn_parameters`), half-split rotation."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from eagle3_jax.models.config import RopeConfig


@functools.cache
def inv_freq_and_scale(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies float32 [head_dim // 2] and the cos/sin scale (YaRN concentration, else 1)."""
    dim = head_dim
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrap = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return extrap.astype(np.float32), 1.0
    if rope.rope_type == "llama3":
        wavelen = 2 * math.pi / extrap
        low_wl = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wl = rope.original_max_position_embeddings / rope.high_freq_factor
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        mid = (1 - smooth) * extrap / rope.factor + smooth * extrap
        inv = np.where(wavelen > low_wl, extrap / rope.factor, np.where(wavelen < high_wl, extrap, mid))
        return inv.astype(np.float32), 1.0
    factor = rope.factor if rope.factor is not None else max_position_embeddings / rope.original_max_position_embeddings
    scale = rope.attention_factor
    if scale is None:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations):
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    inv = extrap / factor * (1 - keep) + extrap * keep
    return inv.astype(np.float32), float(scale)


def cos_sin(positions, inv_freq: np.ndarray, scale: float):
    """positions int [...] -> (cos, sin) float32 [..., D/2], both multiplied by `scale`."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(ang) * scale, jnp.sin(ang) * scale


def apply(x, cos, sin):
    """Half-split (NeoX) rotation of x [..., T, H, D] with cos/sin [..., T, D/2]; computed in float32."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
