"""Pieces both models share: parameter init, shape reporting, the chunked-prefill driver."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def normal(rngs, shape, std: float, dtype):
    """N(0, std^2) weights of `shape`, drawn in float32 and stored in `dtype`."""
    return (jax.random.normal(rngs.params(), shape, F32) * std).astype(dtype)


def shape_of(x) -> list:
    """x's shape as a list, for error messages."""
    return list(np.shape(x))


def over_chunks(fn, lengths, chunk: int, carry):
    """carry = fn(start, carry) for start = 0, chunk, 2 chunk, ... below max(lengths): a `fori_loop`
    with a traced trip count, so prompts of other lengths reuse the executable."""
    n = (jnp.max(lengths) + chunk - 1) // chunk
    return jax.lax.fori_loop(0, n, lambda c, carry: fn(c * chunk, carry), carry)


def keep_position(h, h_prev, pos, start):
    """For a chunk h [B, C, H] starting at `start`: h at position pos[b] where it falls in the chunk,
    else h_prev [B, H] (how chunked prefills keep each prompt's last hidden state)."""
    C = h.shape[1]
    here = (pos >= start) & (pos < start + C)
    pick = jnp.take_along_axis(h, jnp.clip(pos - start, 0, C - 1)[:, None, None], axis=1)[:, 0]
    return jnp.where(here[:, None], pick, h_prev)
