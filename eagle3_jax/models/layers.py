"""Pieces both models share: parameter init, shape reporting, one-row GEMMs, the chunked-prefill driver."""

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


GEMV_ELEMENTS = 10_000_000  # XLA GPU: a one-row dot with a smaller matrix becomes multiply + reduce


def rows_dot(x, w, *, out_first: bool = False, devices: int = 1, **kw):
    """x [..., K] @ w [K, N], or w [N, K] where out_first (x @ w.T: the target's q|k|v and o, stored
    as HF stores them) (kw: jnp.dot's, e.g. preferred_element_type) -> [..., N]; one row (x of
    size K) computed as two, the second zero, where a device may hold fewer than GEMV_ELEMENTS of w
    (w.size < GEMV_ELEMENTS x devices, the "model" devices w is split over or that share its work).
    XLA on GPUs rewrites a dot with a vector operand and a matrix under 10M elements into a multiply
    writing every product plus a reduce (its GPU algebraic simplifier's dot strength reduction,
    which no option turns off in JAX 0.10-0.11), far slower than the GEMM (docs/perf/multi_gpu.md).
    Two rows are never a vector, so the dot stays a GEMM that reads w once; larger matrices keep one
    row (the pad is a launch of its own)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    n = x2.shape[0]
    if n == 1 and w.size < GEMV_ELEMENTS * devices:
        x2 = jnp.pad(x2, ((0, 1), (0, 0)))
    return jnp.dot(x2, w.T if out_first else w, **kw)[:n].reshape(*lead, w.shape[0 if out_first else -1])


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
