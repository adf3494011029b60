"""Per-layer KV cache buffers [B, Hkv, S, D]: dense prefixes on full layers, rings on sliding ones.

A full-attention layer keeps S = max_len slots, position p at slot p. A sliding-window layer of
window W reads only the last W - 1 committed keys, so it keeps a ring of S = min(max_len, W +
max_step_tokens) slots, position p at slot p mod S (`ring_slots`); with S = max_len no position
wraps and the ring is the dense prefix. Slots that hold no committed position inside a query's
window are scratch. The layouts and who reads them: docs/architecture.md, "KV caches".

A cached step writes its T new tokens at positions lengths .. lengths + T - 1 before attention reads
the cache (`write_before_read`). On a ring that overwrites positions lengths + j - S, outside every
query's window while T <= max_step_tokens (`KVCache.max_step_tokens`). Prefill chunks, which may be
longer, read the ring first and then write the tokens each sequence keeps (`write`, `count`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.pallas import select
from eagle3_jax.pallas.attention import attention

DEFAULT_STEP_TOKENS = 128  # new tokens a cached step may write by default (decode 1, a verify its nodes)


@struct.dataclass
class KVCache:
    k: tuple  # per layer [B, Hkv, S_layer, D]
    v: tuple
    max_len: int = struct.field(pytree_node=False)   # positions a sequence may reach (full layers' slots)
    windows: tuple = struct.field(pytree_node=False)  # per layer: sliding window or None

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def rings(self) -> tuple[bool, ...]:
        """Per layer: whether its buffer is a ring (fewer slots than max_len; position p at slot p mod S)."""
        return tuple(w is not None and k.shape[2] < self.max_len for w, k in zip(self.windows, self.k))

    @property
    def max_step_tokens(self) -> int:
        """Most new tokens a cached step may write before reading (`write_before_read`): the smallest
        S - W of the rings, max_len without rings."""
        spare = [k.shape[2] - w for w, k, r in zip(self.windows, self.k, self.rings) if r]
        return min(spare) if spare else self.max_len

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.k + self.v)


def ring_slots(window: int | None, max_len: int, max_step_tokens: int) -> int:
    """Slots of a layer's buffer: max_len on full layers, min(max_len, window + max_step_tokens) on sliding ones."""
    return max_len if window is None else min(max_len, window + max_step_tokens)


def init(windows, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype, *,
         max_step_tokens: int = DEFAULT_STEP_TOKENS) -> KVCache:
    """Zeroed buffers for layers of the given windows (None: full attention)."""
    windows = tuple(windows)
    shapes = [(batch, num_kv_heads, ring_slots(w, max_len, max_step_tokens), head_dim) for w in windows]
    return KVCache(k=tuple(jnp.zeros(s, dtype) for s in shapes), v=tuple(jnp.zeros(s, dtype) for s in shapes),
                   max_len=max_len, windows=windows)


def write_before_read(k_cache, v_cache, k, v, lengths, *, ring: bool = False):
    """A layer's cache update, made before its attention reads the cache: k, v [B, T, Hkv, D] go to
    positions lengths .. lengths + T - 1 (attention reads only the committed positions below lengths
    and takes the new tokens from k, v, so the result is the same either way). Writing first leaves
    one chain of in-place updates per buffer; read-then-write made XLA copy whole cache layers inside
    the speculative step's while loop. Caches of length 0 (no cache) pass through unchanged."""
    if k_cache.shape[2] == 0:
        return k_cache, v_cache
    return write(k_cache, k, lengths, ring=ring), write(v_cache, v, lengths, ring=ring)


def write_after_read(k_cache, v_cache, k, v, lengths, n_write):
    """A ring's update for a prefill chunk, made after its attention has read the ring: k, v [B, T, Hkv, D]
    at positions lengths .. lengths + T - 1 mod S, only the first n_write[b] tokens (int32 [B]) of each row."""
    return (write(k_cache, k, lengths, ring=True, count=n_write),
            write(v_cache, v, lengths, ring=True, count=n_write))


def attend(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, n_write, *, ring: bool, window, scale,
           policy: select.KernelPolicy = select.AUTO):
    """A layer's cached attention (`pallas.attention.attention`, q [B, T, Hq, D], k, v [B, T, Hkv, D])
    with its cache update in the order the layout needs: the new K/V written first
    (`write_before_read`), or, for a ring's prefill chunk (ring and n_write given: it may be longer
    than the ring's spare slots), after attention has read the ring (`write_after_read`).
    policy: which attention implementation runs (`select.attention`). Returns (o [B, T, Hq, D],
    k_cache, v_cache)."""
    kw = dict(window=window, scale=scale, ring=ring, policy=policy)
    if ring and n_write is not None:
        o = attention(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, **kw)
        return (o, *write_after_read(k_cache, v_cache, k, v, lengths, n_write))
    k_cache, v_cache = write_before_read(k_cache, v_cache, k, v, lengths, ring=ring)
    return attention(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, **kw), k_cache, v_cache


def write(buf: jax.Array, new: jax.Array, start: jax.Array, *, ring: bool = False, count=None) -> jax.Array:
    """buf [B, H, S, D] <- new [B, T, H, D] at positions start[b] .. start[b] + T - 1: slots of the
    same numbers (start must be <= S - T), or with `ring` those mod S. count int32 [B] (ring only):
    only the first count[b] tokens are written; a ring keeps at most its last S of what is written."""
    S, T = buf.shape[2], new.shape[1]
    if not ring:
        new = jnp.swapaxes(new, 1, 2).astype(buf.dtype)
        if buf.shape[0] == 1:  # one in-place update; vmap would make a scatter (on GPUs a select kernel + the update)
            return jax.lax.dynamic_update_slice(buf, new, (0, 0, start[0], 0))
        return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (0, s, 0)))(buf, new, start)
    j = jnp.arange(T, dtype=jnp.int32)[None]
    n = jnp.full((buf.shape[0], 1), T, jnp.int32) if count is None else count.astype(jnp.int32)[:, None]
    keep = (j < n) & (j >= n - S)  # distinct slots: no two kept tokens share one
    slots = jnp.where(keep, (start.astype(jnp.int32)[:, None] + j) % S, S)  # S: dropped
    return buf.at[jnp.arange(buf.shape[0])[:, None], :, slots].set(new.astype(buf.dtype), mode="drop")
