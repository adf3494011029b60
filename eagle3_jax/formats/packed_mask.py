"""Bit-packed attention masks: row i of a [..., n] boolean mask as ceil(n/32) uint32 words, bit j % 32
of word j // 32 for key j (TRT-LLM's layout). Tree verify's ancestor masks travel this way
(`pallas/tree_mask.py` writes them, the attention kernels read them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_WORD = 32


def mask_words(n: int) -> int:
    """uint32 words per row of a packed [.., n, ceil(n/32)] mask."""
    return -(-n // MASK_WORD)


def pack_mask(allowed: jax.Array) -> jax.Array:
    """bool [..., n] rows -> packed uint32 [..., ceil(n/32)] (the inverse of `unpack_mask`)."""
    n = allowed.shape[-1]
    w = mask_words(n)
    pad = jnp.zeros(allowed.shape[:-1] + (w * MASK_WORD - n,), bool)
    bits = jnp.concatenate([allowed, pad], -1).reshape(allowed.shape[:-1] + (w, MASK_WORD)).astype(jnp.uint32)
    return jnp.sum(bits << jnp.arange(MASK_WORD, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def unpack_mask(bits: jax.Array, n: int) -> jax.Array:
    """Packed uint32 [..., W] rows -> bool [..., n]; bit j % 32 of word j // 32 is key j."""
    j = jnp.arange(n)
    words = jnp.take(bits, j // MASK_WORD, axis=-1)
    return ((words >> (j % MASK_WORD).astype(jnp.uint32)) & 1).astype(bool)
