"""Per-layer KV cache buffers [B, Hkv, S, D]; slots at or beyond a sequence's length are scratch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: tuple  # per layer [B, Hkv, S, D]
    v: tuple

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]


def init(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype) -> KVCache:
    shape = (batch, num_kv_heads, max_len, head_dim)
    return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))


def write_before_read(k_cache, v_cache, k, v, lengths):
    """A layer's cache update, made before its attention reads the cache: k, v [B, T, Hkv, D] go to
    slots lengths .. lengths + T - 1 (attention reads only the prefix [0, lengths) of the cache and
    takes the new tokens from k, v, so the result is the same either way). Writing first leaves one
    chain of in-place updates per buffer; read-then-write made XLA copy whole cache layers inside
    the speculative step's while loop. Caches of length 0 (no cache) pass through unchanged."""
    if k_cache.shape[2] == 0:
        return k_cache, v_cache
    return write(k_cache, k, lengths), write(v_cache, v, lengths)


def write(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buf [B, H, S, D] <- new [B, N, H, D] at slots start[b] .. start[b] + N - 1 (start must be <= S - N)."""
    new = jnp.swapaxes(new, 1, 2).astype(buf.dtype)
    if buf.shape[0] == 1:  # one in-place update; vmap would make a scatter (on GPUs a select kernel + the update)
        return jax.lax.dynamic_update_slice(buf, new, (0, 0, start[0], 0))
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (0, s, 0)))(buf, new, start)
