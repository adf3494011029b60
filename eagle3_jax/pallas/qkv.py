"""Attention's prologue in one Pallas (Triton) kernel: q/k/v bias, RoPE, and the KV-cache write.

`rope_write(qkv, bias, cos, sin, k_cache, v_cache, lengths, *, num_heads, num_kv_heads)` takes the
fused projection qkv [B, T, (Hq + 2 Hkv) * D] (q, k, v columns side by side, before the bias) and
returns q [B, T, Hq, D], k, v [B, T, Hkv, D] and the caches [B, Hkv, S, D] with k and v written at
slots lengths[b] .. lengths[b] + T - 1, in place (the caches are aliased to the outputs; donate them
or let XLA reuse them inside a jitted step). q and k: (qkv + bias) rounded to qkv.dtype, then the
NeoX half-split rotation (x1 c - x2 s, x2 c + x1 s) in f32 with cos, sin f32 [B, T, D/2], rounded;
v: qkv + bias, rounded. Slots at or past S are not written (the jnp path's dynamic_update_slice would
move the block instead; callers keep lengths + T <= S).

One program per (sequence, token). At one token XLA runs this as five kernels (two slices with the
rotation, the bias of v, two cache updates). `rope_write_reference` is the jnp function of the same
signature.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32


def _load(ref, idx, mask=None):
    return plgpu.load(ref.at[idx]) if mask is None else plgpu.load(ref.at[idx], mask=mask, other=0)


def _kernel(qkv_ref, b_ref, cos_ref, sin_ref, len_ref, kc_in, vc_in, q_ref, k_ref, v_ref, kc_ref, vc_ref, *,
            Hq, Hkv, D, S, has_bias):
    del kc_in, vc_in  # aliased with kc_ref, vc_ref
    b, t = pl.program_id(0), pl.program_id(1)
    half = D // 2
    dt = q_ref.dtype
    c = _load(cos_ref, (b, t, pl.ds(0, half)))[None, :]
    s = _load(sin_ref, (b, t, pl.ds(0, half)))[None, :]
    pos = len_ref[b] + t
    slot = jnp.minimum(pos, S)  # past the end: masked (the interpreter's caches have a spare slot S)

    def biased(cols, m):
        x = _load(qkv_ref, (b, t, cols), m).astype(F32)
        if has_bias:
            x = x + _load(b_ref, cols, m).astype(F32)
        return x.astype(dt).astype(F32)

    def heads(n, width):
        h = lax.broadcasted_iota(jnp.int32, (pl.next_power_of_2(n), width), 0)
        return h, lax.broadcasted_iota(jnp.int32, h.shape, 1), h < n

    for n, first, out_ref, cache_ref in ((Hq, 0, q_ref, None), (Hkv, Hq, k_ref, kc_ref)):
        h, j, ok = heads(n, half)
        x1, x2 = biased((first + h) * D + j, ok), biased((first + h) * D + half + j, ok)
        for y, off in (((x1 * c - x2 * s).astype(dt), 0), ((x2 * c + x1 * s).astype(dt), half)):
            plgpu.store(out_ref.at[b, t, h, off + j], y, mask=ok)
            if cache_ref is not None:
                plgpu.store(cache_ref.at[b, h, slot, off + j], y, mask=ok & (pos < S))
    h, d, ok = heads(Hkv, D)
    v = biased((Hq + Hkv + h) * D + d, ok).astype(dt)
    plgpu.store(v_ref.at[b, t, h, d], v, mask=ok)
    plgpu.store(vc_ref.at[b, h, slot, d], v, mask=ok & (pos < S))


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "interpret"))
def rope_write(qkv, bias, cos, sin, k_cache, v_cache, lengths, *, num_heads: int, num_kv_heads: int,
               interpret: bool = False):
    """See the module docstring. Returns (q, k, v, k_cache, v_cache)."""
    B, T, N = qkv.shape
    Hq, Hkv = num_heads, num_kv_heads
    D = N // (Hq + 2 * Hkv)
    S = k_cache.shape[2]
    if (N != (Hq + 2 * Hkv) * D or D % 2 or k_cache.shape != (B, Hkv, S, D) or v_cache.shape != k_cache.shape
            or cos.shape != (B, T, D // 2) or sin.shape != cos.shape or lengths.shape != (B,)
            or (bias is not None and bias.shape != (N,))):
        raise ValueError(f"rope_write: qkv {qkv.shape} for {Hq} + 2 x {Hkv} heads, bias "
                         f"{None if bias is None else bias.shape}, cos {cos.shape}, sin {sin.shape} (expected "
                         f"{(B, T, D // 2)}), caches {k_cache.shape} / {v_cache.shape} (expected (B, {Hkv}, S, {D})), "
                         f"lengths {lengths.shape}")
    has_bias = bias is not None
    b_in = bias if has_bias else jnp.zeros((1,), qkv.dtype)
    qkv_in, kc, vc = qkv, k_cache, v_cache
    Hqp, Hkp = pl.next_power_of_2(Hq), pl.next_power_of_2(Hkv)
    if interpret:  # the interpreter cannot touch indices past an array's end, even masked: pad every array
        Np = (Hq + Hkv + Hkp) * D + max(Hqp, Hkp) * D
        qkv_in = jnp.pad(qkv, ((0, 0), (0, 0), (0, Np - N)))
        b_in = jnp.pad(b_in, (0, Np - b_in.shape[0]))
        kc, vc = (jnp.pad(c, ((0, 0), (0, Hkp - Hkv), (0, 1), (0, 0))) for c in (k_cache, v_cache))
    else:
        Hqp, Hkp = Hq, Hkv
    dt = qkv.dtype
    q, k, v, kc, vc = pl.pallas_call(
        functools.partial(_kernel, Hq=Hq, Hkv=Hkv, D=D, S=S, has_bias=has_bias),
        grid=(B, T),
        out_shape=(jax.ShapeDtypeStruct((B, T, Hqp, D), dt), jax.ShapeDtypeStruct((B, T, Hkp, D), dt),
                   jax.ShapeDtypeStruct((B, T, Hkp, D), dt), jax.ShapeDtypeStruct(kc.shape, kc.dtype),
                   jax.ShapeDtypeStruct(vc.shape, vc.dtype)),
        input_output_aliases={5: 3, 6: 4},
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="rope_write",
    )(qkv_in, b_in, cos.astype(F32), sin.astype(F32), lengths.astype(jnp.int32), kc, vc)
    if interpret:
        q, k, v, kc, vc = q[:, :, :Hq], k[:, :, :Hkv], v[:, :, :Hkv], kc[:, :Hkv, :S], vc[:, :Hkv, :S]
    return q, k, v, kc, vc


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "interpret"))
def rope_write_reference(qkv, bias, cos, sin, k_cache, v_cache, lengths, *, num_heads: int, num_kv_heads: int,
                         interpret: bool = False):
    """Plain-jnp `rope_write` (slots past the cache's end are dropped, as in the kernel)."""
    del interpret
    B, T, N = qkv.shape
    Hq, Hkv = num_heads, num_kv_heads
    D = N // (Hq + 2 * Hkv)
    x = qkv if bias is None else qkv + bias
    # XLA may keep the biased values in f32 inside a fusion (excess precision); the kernel rounds them
    x = lax.reduce_precision(x.astype(F32), jnp.finfo(qkv.dtype).nexp, jnp.finfo(qkv.dtype).nmant)
    qk = x[..., :(Hq + Hkv) * D].reshape(B, T, Hq + Hkv, D)
    x1, x2 = qk[..., :D // 2], qk[..., D // 2:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    qk = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(qkv.dtype)
    v = x[..., (Hq + Hkv) * D:].reshape(B, T, Hkv, D).astype(qkv.dtype)
    k = qk[:, :, Hq:]
    S = k_cache.shape[2]
    slots = lengths[:, None] + jnp.arange(T)  # [B, T]
    bi = jnp.arange(B)[:, None]
    # out-of-range slots go to index S, which mode="drop" discards
    slots = jnp.where(slots < S, slots, S)
    k_cache = k_cache.at[bi, :, slots].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[bi, :, slots].set(v.astype(v_cache.dtype), mode="drop")
    return qk[:, :, :Hq], k, v, k_cache, v_cache
