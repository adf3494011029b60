"""Sampling filters: top-k, top-p (nucleus) and min-p over logits scaled by the temperature, exact
on a vocabulary split over the mesh's "model" axis.

On z = logits / T (one row, V entries), with w = exp(z - max z) each token's mass relative to the
most likely one's, a token x is kept iff all three hold (order and ties as transformers' and vLLM's
warpers, temperature first):
  top_k: fewer than top_k tokens have z > z_x (every token tied with the k-th largest is kept);
  top_p: over the tokens top_k keeps, those with z > z_x hold less than top_p of their mass (the
      smallest set of likeliest tokens whose mass reaches top_p; tokens tied at its edge are all
      kept, where a sort would keep an arbitrary part of them); top_p = 1 keeps every token;
  min_p: w_x >= min_p (the probability at least min_p times the largest).
min_p only compares each token with the most likely one, which every filter keeps, so it commutes
with the other two; top_p is taken after top_k (its mass is that of the top-k set, renormalised).
The most likely token is always kept. p is softmax of z with the dropped tokens at -inf.

Each cut is a float32 value found by a search over the 32-bit order of floats (`least_key`), a
radix step of 4 bits a round: 8 rounds, each summing the counts or masses above 15 candidate cuts
over this device's columns and then over "model" (one small psum a round on a mesh: the logits are
never gathered). Exact: the same cut as a sort would give, up to float32 rounding of the summed
masses (their order of summation differs with the split). Off (`Filters` None): no code at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from eagle3_jax import parallel
from eagle3_jax.checks import ArgumentError, is_int, number_arg

TOP_K_OFF = np.iinfo(np.int32).max  # top_k None: no count reaches it
DIGIT_BITS = 4  # bits of the cut a search round decides (2^4 - 1 candidate cuts summed a round)


@struct.dataclass
class Filters:
    """The filters of one call, traced (one executable serves every value): top_k int32 [] (None:
    TOP_K_OFF), top_p float32 [] in (0, 1] (None: 1), min_p float32 [] in [0, 1] (None: 0)."""
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array


def check_filters(top_k=None, top_p=None, min_p=None) -> Filters | None:
    """Host values for the loop: None where all three are None (no filter is compiled), else
    `Filters` of numpy scalars. Raises ArgumentError naming the argument, the range and the value:
    top_k an integer >= 1, top_p a number in (0, 1], min_p a number in [0, 1] (None: off)."""
    if top_k is not None and not (is_int(top_k) and top_k >= 1):
        raise ArgumentError(f"top_k: expected an integer >= 1 or None, got {top_k!r}")
    top_p = number_arg("top_p", top_p, 0.0, 1.0, lo_open=True, optional=True)
    min_p = number_arg("min_p", min_p, 0.0, 1.0, optional=True)
    if top_k is None and top_p is None and min_p is None:
        return None
    return Filters(top_k=np.int32(TOP_K_OFF if top_k is None else min(int(top_k), TOP_K_OFF)),
                   top_p=np.float32(1.0 if top_p is None else top_p),
                   min_p=np.float32(0.0 if min_p is None else min_p))


def order_key(z):
    """float32 -> uint32 in the same order (-inf lowest; -0.0 just below +0.0; NaN outside the order)."""
    b = lax.bitcast_convert_type(z, jnp.uint32)
    return jnp.where(b >= jnp.uint32(1 << 31), ~b, b | jnp.uint32(1 << 31))


def least_key(key, weight, bound, total):
    """The least t (uint32 [..., 1]) such that S(t) = sum of `weight` over the entries with key > t
    (over the last axis, then over the devices: `total`) is < bound ([..., 1] or []). key uint32 [..., Vs],
    weight float32 [..., Vs] >= 0, bound > 0 (so S(max uint32) = 0 qualifies). S does not increase
    with t, so the answer's digits are found from the highest: at each digit the candidates are the
    largest keys of its 16 sub-blocks, the digit is the number of them with S >= bound."""
    d = jnp.arange((1 << DIGIT_BITS) - 1, dtype=jnp.uint32)  # the last sub-block needs no test

    def digit(i, t):
        shift = jnp.uint32(32 - DIGIT_BITS) - jnp.uint32(DIGIT_BITS) * i.astype(jnp.uint32)
        cand = t | (d << shift) | ((jnp.uint32(1) << shift) - 1)  # [..., 15]
        above = jnp.where(key[..., None, :] > cand[..., :, None], weight[..., None, :], 0.0)
        s = total(jnp.sum(above, -1))
        return t | (jnp.sum(s >= bound, -1, keepdims=True).astype(jnp.uint32) << shift)

    return lax.fori_loop(0, 32 // DIGIT_BITS, digit, jnp.zeros(key.shape[:-1] + (1,), jnp.uint32))


def local_filter(z, top_k, top_p, min_p, total, largest):
    """The filtered z on this device's columns z float32 [..., Vs]: dropped entries -inf, kept ones
    z itself (bit for bit). total / largest: the sum / max of [..., n] over the devices that split
    the vocabulary (identity on one)."""
    zc = jnp.where(z == 0, 0.0, z)  # -0.0 as +0.0: the keys order ties as the floats compare
    w = jnp.exp(zc - largest(jnp.max(zc, -1, keepdims=True)))
    key = order_key(zc)
    k_cut = least_key(key, jnp.ones_like(w), top_k.astype(jnp.float32), total)
    wk = jnp.where(key >= k_cut, w, 0.0)
    p_cut = least_key(key, wk, top_p * total(jnp.sum(wk, -1, keepdims=True)), total)
    p_cut = jnp.where(top_p < 1, p_cut, jnp.uint32(0))
    keep = (key >= jnp.maximum(k_cut, p_cut)) & (w >= min_p)
    return jnp.where(keep, z, -jnp.inf)


def filter_logits(ctx: parallel.RunContext, z, filters: Filters):
    """z float32 [B, ..., V] (logits / T, split over "model" as `parallel.vocab_logits` leaves them
    where ctx's mesh has several "model" devices; rows over "data") -> z with the tokens the filters
    drop at -inf, the rest unchanged (bit for bit), laid out as z. See the module docstring."""
    args = (z, filters.top_k, filters.top_p, filters.min_p)
    if ctx.model_size == 1:
        return local_filter(*args, total=lambda x: x, largest=lambda x: x)

    def body(z, k, p, m):
        return local_filter(z, k, p, m, total=lambda x: lax.psum(x, parallel.MODEL),
                            largest=lambda x: lax.pmax(x, parallel.MODEL))

    spec = P(parallel.DATA, *([None] * (z.ndim - 2)), parallel.MODEL)
    return ctx.local(body, (spec, P(), P(), P()), spec)(*args)
