"""The MoE block's routing for few tokens (decode and verify) in two Pallas (Triton) kernels.

`route(h, norm_scale, router_w, router_b, *, eps, k)` takes the residual stream h [T, H] (T <= 64)
and returns what `moe.mxfp4_moe` consumes:

  x       [T, H] h.dtype   RMSNorm(h) = h * rsqrt(mean(h^2) + eps) * norm_scale in f32, rounded to
                           h.dtype (norm_scale None: x = h)
  xq      u32 [T, H/32, 5, 4]  x in the MXFP4 kernels' FMA-path pair layout (`moe.f16_pairs(x)`)
  ids     int32 [T, k]     the k largest logits = x @ router_w + router_b (f32), in descending order,
                           equal logits to the lower expert id (`lax.top_k`)
  weights f32 [T, k]       softmax over those k logits

  1. norm + router, grid (E / 16 expert tiles, H / 256 input chunks, token tiles of 16; of 1 at one
     token): each program loads its token rows whole (the norm's sum of squares), its chunk of them,
     its [256, 16] router tile and the norm's scales, all before any use (one round trip to memory),
     multiplies the normalized chunk (rounded to h.dtype) with the tile (tensor cores; at one token
     products and a sum) and stores the partial logits. The expert tile 0 programs write x; the
     chunk's eight scale groups of xq are spread over the expert tiles' programs, each group's
     (low, high) pairs gathered from h in pair order and normalized again, so that no layout
     conversion happens in registers (gpt-oss-120b at one token: 96 programs).
  2. top k + softmax, one program per token tile: the partial logits summed, the bias added, then
     k rounds of (row max, lowest id at the max). One warp at one token (its reductions stay in the
     warp).

At one token this replaces the ten XLA kernels of the plain path (the norm's reduce and scale, the
padding of the router input and of its weight for a split-K GEMM, the GEMM, its reduce, the top k's
two reduces, the softmax and the pair layout) with two (figures and what was tried:
docs/perf/glue.md).
`route_reference` is the jnp function of the same signature.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle3_jax.formats.mxfp4 import BLOCK, pow2_f32
from eagle3_jax.pallas import moe, util

F32 = jnp.float32
TOKEN_TILE = 16  # token rows per program (one at one token)
EXPERT_TILE = 16  # router columns per program (the tensor cores' smallest N)
CHUNK = 256  # inputs per K step of kernel 1
MAX_TOKENS = moe.MAX_TOKENS


def _normalized(h, r, scale, dtype):
    """RMSNorm of loaded rows: h f32 [TT, ...] times r [TT] (one per row) times scale [...] (None:
    h as it is), rounded to dtype and back to f32."""
    if r is None:
        return h
    r = r.reshape(r.shape + (1,) * (h.ndim - 1))
    return (h * r * scale).astype(dtype).astype(F32)


def _router_kernel(h_ref, s_ref, w_ref, x_ref, xq_ref, lg_ref, *, T, TT, H, E, eps, normalize, dtype):
    i, kk, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = c * TT + lax.broadcasted_iota(jnp.int32, (TT,), 0)
    r_ok = rows < T
    k_iota = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    e_ok = i * EXPERT_TILE + lax.broadcasted_iota(jnp.int32, (EXPERT_TILE,), 0) < E

    def h_chunk(k):
        k = jnp.asarray(k, jnp.int32)  # a traced start: the static bounds check would reject the last
        return util.load(h_ref, (pl.ds(c * TT, TT), pl.ds(k * CHUNK, CHUNK)),
                         mask=r_ok[:, None] & (k * CHUNK + k_iota < H)[None, :], other=0).astype(F32)

    # every load before any use (one round trip to memory): the whole rows for the norm, this
    # program's chunk of them (again: kk is traced), its router tile and the norm's scales
    c_ok = kk * CHUNK + k_iota < H  # the last chunk runs past H (masked)
    whole = [h_chunk(k) for k in range(-(-H // CHUNK))] if normalize else []
    h = h_chunk(kk)
    w = util.load(w_ref, (pl.ds(kk * CHUNK, CHUNK), pl.ds(i * EXPERT_TILE, EXPERT_TILE)),
                  mask=c_ok[:, None] & e_ok[None, :], other=0)
    scale = util.load(s_ref, pl.ds(kk * CHUNK, CHUNK), mask=c_ok, other=0) if normalize else None
    r = lax.rsqrt(sum(jnp.sum(t * t, axis=1) for t in whole) / H + eps) if normalize else None

    x = _normalized(h, r, scale, dtype).astype(dtype)
    if TT == 1:  # one token: products and a sum (the tensor cores' dot needs 16 rows)
        acc = jnp.sum(x.astype(F32).reshape(CHUNK, 1) * w.astype(F32), axis=0, keepdims=True)
    else:
        acc = jnp.dot(x, w.astype(dtype), preferred_element_type=F32)
    util.store(lg_ref, (kk, pl.ds(c * TT, TT), pl.ds(i * EXPERT_TILE, EXPERT_TILE)), acc,
               mask=r_ok[:, None] & e_ok[None, :])

    @pl.when(i == 0)
    def _():
        util.store(x_ref, (pl.ds(c * TT, TT), pl.ds(kk * CHUNK, CHUNK)), x, mask=r_ok[:, None] & c_ok[None, :])

    ne, BG = pl.num_programs(0), CHUNK // BLOCK
    for j in range(BG):  # the chunk's scale groups of xq, spread over the expert tiles' programs
        @pl.when(i == j % ne)
        def _():
            _pair_layout(h_ref, s_ref, xq_ref, rows, r, kk * BG + j, H=H, dtype=dtype)


def _pair_layout(h_ref, s_ref, xq_ref, rows, r, g, *, H, dtype):
    """Writes scale group g, rows `rows`, of xq [T, G * 20] (moe's pair layout of the normalized h):
    the low and high inputs of the group's 16 pair words are loaded from h in pair order, normalized,
    scaled by the group's power of two and packed; the group's factor 2^e and three zero words follow."""
    lo, hi, at = moe.pair_inputs(moe.PAIR_WORDS)  # [16] each
    q_iota = lax.broadcasted_iota(jnp.int32, (4,), 0)
    m = (rows < xq_ref.shape[0]) & (g < H // BLOCK)  # [TT]
    m16 = jnp.broadcast_to(m[:, None], (rows.shape[0], moe.PAIR_WORDS))
    base = g * BLOCK

    def half(cols):
        v = util.load(h_ref, (rows[:, None], base + cols[None]), mask=m16, other=0).astype(F32)
        s = None if r is None else util.load(s_ref, base + cols, mask=jnp.broadcast_to(g < H // BLOCK, cols.shape),
                                             other=0)
        return _normalized(v, r, s, dtype)

    a, b = half(lo), half(hi)  # [TT, 16]
    e = moe.group_exponent(jnp.max(jnp.maximum(jnp.abs(a), jnp.abs(b)), axis=1))  # [TT]
    f = pow2_f32(14 - e)[:, None]
    word0 = g * moe.GROUP_WORDS
    util.store(xq_ref, (rows[:, None], word0 + at[None]), moe.pack_f16x2(a * f, b * f), mask=m16)
    factor = lax.bitcast_convert_type(pow2_f32(e), jnp.uint32)[:, None]  # [TT, 1]
    trailer = jnp.where(q_iota[None] == 0, factor, jnp.uint32(0))  # [TT, 4]
    util.store(xq_ref, (rows[:, None], word0 + moe.PAIR_WORDS + q_iota[None]), trailer,
               mask=jnp.broadcast_to(m[:, None], trailer.shape))


def _top_k_kernel(lg_ref, b_ref, ids_ref, w_ref, *, T, TT, E, k):
    c = pl.program_id(0)
    Ep, kp = util.pow2(E), util.pow2(k)
    rows = c * TT + lax.broadcasted_iota(jnp.int32, (TT,), 0)
    r_ok = rows < T
    e_iota = lax.broadcasted_iota(jnp.int32, (TT, Ep), 1)
    j_iota = lax.broadcasted_iota(jnp.int32, (TT, kp), 1)
    m = r_ok[:, None] & (e_iota < E)
    lg = sum(util.load(lg_ref, (jnp.int32(s), pl.ds(c * TT, TT), pl.ds(0, Ep)), mask=m, other=0)
             for s in range(lg_ref.shape[0]))  # the K splits' partial sums
    lg = lg + util.load(b_ref, pl.ds(0, Ep), mask=lax.broadcasted_iota(jnp.int32, (Ep,), 0) < E,
                        other=0).astype(F32)[None, :]
    free = e_iota < E
    ids = jnp.zeros((TT, kp), jnp.int32)
    top = jnp.zeros((TT, kp), F32)
    first = None
    for j in range(k):
        best = jnp.max(jnp.where(free, lg, -jnp.inf), axis=1)
        first = best if first is None else first
        # the lowest free id at the max (a free id at all where the logits are NaN)
        at = jnp.min(jnp.where(free & ((lg == best[:, None]) | jnp.isnan(best)[:, None]), e_iota, Ep), axis=1)
        at = jnp.minimum(at, E - 1)
        ids = jnp.where(j_iota == j, at[:, None], ids)
        top = jnp.where(j_iota == j, best[:, None], top)
        free = free & (e_iota != at[:, None])
    p = jnp.where(j_iota < k, jnp.exp(top - first[:, None]), 0.0)
    m = r_ok[:, None] & (j_iota < k)
    util.store(ids_ref, (pl.ds(c * TT, TT), pl.ds(0, kp)), ids, mask=m)
    util.store(w_ref, (pl.ds(c * TT, TT), pl.ds(0, kp)), p / jnp.sum(p, axis=1, keepdims=True), mask=m)


@functools.partial(jax.jit, static_argnames=("eps", "k", "interpret"))
def route(h, norm_scale, router_w, router_b, *, eps: float, k: int, interpret: bool = False):
    """h [T, H] (T <= 64), norm_scale [H] or None, router_w [H, E], router_b [E] -> (x [T, H] h.dtype,
    xq u32 [T, H/32, 5, 4], ids int32 [T, k], weights f32 [T, k]); see the module docstring."""
    T, H = h.shape
    E = router_w.shape[1]
    if T > MAX_TOKENS or H % BLOCK or router_w.shape[0] != H or router_b.shape != (E,) or not 1 <= k <= E:
        raise ValueError(f"moe_route: h {h.shape} (at most {MAX_TOKENS} tokens, H a multiple of {BLOCK}), "
                         f"router_w {router_w.shape} (expected [{H}, E]), router_b {router_b.shape}, k {k}")
    if h.dtype != jnp.bfloat16:
        raise ValueError(f"moe_route: h must be bfloat16 (the MXFP4 kernels' activations), got {h.dtype}")
    if norm_scale is not None and norm_scale.shape != (H,):
        raise ValueError(f"moe_route: norm_scale {norm_scale.shape}, expected ({H},)")
    G = H // BLOCK
    TT = 1 if T == 1 else TOKEN_TILE
    nc, ne, nk = -(-T // TT), -(-E // EXPERT_TILE), -(-H // CHUNK)
    normalize = norm_scale is not None
    scale = norm_scale.astype(F32) if normalize else jnp.zeros((1,), F32)
    Ep, kp = util.pow2(E), util.pow2(k)
    # the interpreter cannot read or write past an array's end (the Triton kernels mask such accesses):
    # there every array is padded to whole tiles
    Tp, Hp, Wq = ((nc * TT, nk * CHUNK, nk * CHUNK // BLOCK * moe.GROUP_WORDS)
                  if interpret else (T, H, G * moe.GROUP_WORDS))
    bias = router_b
    if interpret:
        h, router_w, bias = util.pad(h, (Tp, Hp)), util.pad(router_w, (Hp, ne * EXPERT_TILE)), util.pad(bias, (Ep,))
        scale = util.pad(scale, (Hp,)) if normalize else scale
    x, xq, lg = pl.pallas_call(
        functools.partial(_router_kernel, T=T, TT=TT, H=H, E=E, eps=float(eps), normalize=normalize, dtype=h.dtype),
        grid=(ne, nk, nc),
        out_shape=(jax.ShapeDtypeStruct((Tp, Hp), h.dtype), jax.ShapeDtypeStruct((Tp, Wq), jnp.uint32),
                   jax.ShapeDtypeStruct((nk, Tp, max(Ep, ne * EXPERT_TILE) if interpret else E), F32)),
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="moe_router",
    )(h, scale, router_w)
    ids, weights = pl.pallas_call(
        functools.partial(_top_k_kernel, T=T, TT=TT, E=E, k=k),
        grid=(nc,),
        out_shape=(jax.ShapeDtypeStruct((Tp, kp if interpret else k), jnp.int32),
                   jax.ShapeDtypeStruct((Tp, kp if interpret else k), F32)),
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=1 if TT == 1 else 4, num_stages=1),
        interpret=interpret, name="moe_top_k",
    )(lg, bias)
    xq = xq[:T, :G * moe.GROUP_WORDS].reshape(T, G, moe.PAIR_ROWS, 4)
    return x[:T, :H], xq, ids[:T, :k], weights[:T, :k]


@functools.partial(jax.jit, static_argnames=("eps", "k", "interpret"))
def route_reference(h, norm_scale, router_w, router_b, *, eps: float, k: int, interpret: bool = False):
    """Plain-jnp `route`."""
    del interpret
    x = h
    if norm_scale is not None:
        t = h.astype(F32)
        x = (t * lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + eps) * norm_scale.astype(F32)).astype(h.dtype)
    logits = jnp.dot(x, router_w, preferred_element_type=F32) + router_b.astype(F32)
    top, ids = lax.top_k(logits, k)
    return x, moe.f16_pairs(x.astype(F32)), ids.astype(jnp.int32), jax.nn.softmax(top, axis=-1)
