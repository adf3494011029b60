"""Attention of Nq new query tokens over a committed KV-cache prefix plus the new tokens themselves.

One function serves decode (Nq = 1), tree verify (Nq = N nodes, packed ancestor mask) and chunked
prefill (Nq = chunk, causal). GPT-OSS semantics: attention sinks, optional sliding window on
positions, GQA (query head h reads kv head h // (Hq // Hkv)), float32 softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_WORD = 32


def mask_words(n: int) -> int:
    """uint32 words per row of a packed [.., n, ceil(n/32)] mask."""
    return -(-n // MASK_WORD)


def unpack_mask(bits: jax.Array, n: int) -> jax.Array:
    """Packed uint32 [..., W] rows -> bool [..., n]; bit j % 32 of word j // 32 is key j."""
    j = jnp.arange(n)
    words = jnp.take(bits, j // MASK_WORD, axis=-1)
    return ((words >> (j % MASK_WORD).astype(jnp.uint32)) & 1).astype(bool)


def attention_reference(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, *, window, scale):
    """Plain-jnp attention; the semantics every kernel must match.

    q: [B, Nq, Hq, D] new queries (rotary applied); k, v: [B, Nq, Hkv, D] the new tokens' keys/values.
    k_cache, v_cache: [B, Hkv, S, D]; only slots [0, lengths[b]) are read (committed prefix, key
    position = slot). positions: [B, Nq] int32 positions of the new tokens (all >= lengths[b]).
    mask: uint32 [B, Nq, ceil(Nq/32)] packed "query i may see new token j" bits, or None for causal
    in token order (a prefill chunk). sinks: [Hq] logits of the virtual zero-value key, unscaled.
    window: None, or W > 0: key position p_j is visible to query position p_i iff p_i - W < p_j.
    Returns [B, Nq, Hq, D] in q.dtype.
    """
    B, Nq, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    f32 = jnp.float32
    qf = q.astype(f32).reshape(B, Nq, Hkv, G, D)
    pos = positions.astype(jnp.int32)

    slot = jnp.arange(S)
    see_prefix = slot[None, None, :] < lengths[:, None, None]  # [B, Nq, S]
    if mask is None:
        see_new = jnp.broadcast_to(jnp.tril(jnp.ones((Nq, Nq), bool)), (B, Nq, Nq))
    else:
        see_new = unpack_mask(mask, Nq)  # [B, Nq, Nq]
    if window is not None:
        see_prefix &= slot[None, None, :] > pos[:, :, None] - window
        see_new &= pos[:, None, :] > pos[:, :, None] - window

    neg = jnp.finfo(f32).min
    lp = jnp.einsum("bnhgd,bhsd->bhgns", qf, k_cache.astype(f32)) * scale
    ln = jnp.einsum("bnhgd,bmhd->bhgnm", qf, k.astype(f32)) * scale
    lp = jnp.where(see_prefix[:, None, None], lp, neg)
    ln = jnp.where(see_new[:, None, None], ln, neg)
    sink = sinks.astype(f32).reshape(1, Hkv, G, 1)
    m = jnp.maximum(jnp.maximum(lp.max(-1, initial=neg), ln.max(-1)), sink)[..., None]
    pp, pn = jnp.exp(lp - m), jnp.exp(ln - m)
    denom = pp.sum(-1) + pn.sum(-1) + jnp.exp(sink - m[..., 0])
    out = (jnp.einsum("bhgns,bhsd->bnhgd", pp, v_cache.astype(f32))
           + jnp.einsum("bhgnm,bmhd->bnhgd", pn, v.astype(f32)))
    out = out / jnp.moveaxis(denom, 3, 1)[..., None]
    return out.reshape(B, Nq, Hq, D).astype(q.dtype)


def attention(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, *, window, scale):
    """The model's single attention entry point (same contract as `attention_reference`)."""
    return attention_reference(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks,
                               window=window, scale=scale)
