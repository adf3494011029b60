"""Residual add and RMSNorm in one Pallas (Triton) kernel.

`add_rms_norm(x, scale, residual, *, eps)`: s = x + residual (residual first rounded to x.dtype, the
sum in f32 rounded to x.dtype, as `x + residual.astype(x.dtype)` in jnp), and
y = s * rsqrt(mean(s^2) + eps) * scale computed in f32, rounded to x.dtype. Returns (s, y).

One program per row, the whole row in registers; 16 warps a program for up to 64 rows (decode and
verify; faster than 4 there), 4 beyond. At one token XLA runs this as three kernels (the add, the
mean's reduce, the scale: a full reduction to a scalar does not fuse with its consumer); the model
calls it between its blocks (the MoE's f32 output is added to the residual stream and the next
block's input norm applied in one kernel). Figures and what was tried: docs/perf/glue.md.
`add_rms_norm_reference` is the jnp function of the same signature.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32


def _kernel(x_ref, r_ref, s_ref, *outs, H, eps, dtype, has_residual):
    """outs: (sum_ref, y_ref) with a residual, else (y_ref,)."""
    row = pl.program_id(0)
    cols = lax.broadcasted_iota(jnp.int32, (pl.next_power_of_2(H),), 0)
    ok = cols < H
    idx = (row, pl.ds(0, cols.shape[0]))
    t = plgpu.load(x_ref.at[idx], mask=ok, other=0).astype(F32)
    if has_residual:
        t = t + plgpu.load(r_ref.at[idx], mask=ok, other=0).astype(dtype).astype(F32)
        t = t.astype(dtype)
        plgpu.store(outs[0].at[idx], t, mask=ok)
        t = t.astype(F32)
    r = lax.rsqrt(jnp.sum(t * t) / H + eps)
    scale = plgpu.load(s_ref.at[pl.ds(0, cols.shape[0])], mask=ok, other=0).astype(F32)
    plgpu.store(outs[-1].at[idx], (t * r * scale).astype(dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x, scale, residual=None, *, eps: float, interpret: bool = False):
    """x [..., H], scale [H], residual [..., H] or None -> (s, y), both [..., H] x.dtype (s = x when
    residual is None); see the module docstring."""
    H = x.shape[-1]
    if scale.shape != (H,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"add_rms_norm: x {x.shape}, scale {scale.shape} (expected ({H},)), residual "
                         f"{None if residual is None else residual.shape} (expected {x.shape})")
    shape = x.shape
    x2 = x.reshape(-1, H)
    N = x2.shape[0]
    has_residual = residual is not None
    r2 = residual.reshape(N, H) if has_residual else jnp.zeros((1, 1), F32)
    s_in = scale
    if interpret:  # the interpreter cannot read past an array's end (the Triton kernel masks such reads)
        Hp = pl.next_power_of_2(H)
        x2, s_in = jnp.pad(x2, ((0, 0), (0, Hp - H))), jnp.pad(scale, (0, Hp - H))
        r2 = jnp.pad(r2, ((0, 0), (0, Hp - H))) if has_residual else r2
    out = jax.ShapeDtypeStruct(x2.shape, x.dtype)
    outs = pl.pallas_call(
        functools.partial(_kernel, H=H, eps=float(eps), dtype=x.dtype, has_residual=has_residual),
        grid=(N,), out_shape=(out, out) if has_residual else (out,),
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=16 if N <= 64 else 4, num_stages=1),
        interpret=interpret, name="add_rms_norm",
    )(x2, r2, s_in)
    s = outs[0][:, :H].reshape(shape) if has_residual else x
    return s, outs[-1][:, :H].reshape(shape)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm_reference(x, scale, residual=None, *, eps: float, interpret: bool = False):
    """Plain-jnp `add_rms_norm`."""
    del interpret
    s = x if residual is None else x + residual.astype(x.dtype)
    # XLA may keep the sum in f32 inside a fusion (excess precision); the kernel normalizes s as stored
    t = lax.reduce_precision(s.astype(F32), jnp.finfo(x.dtype).nexp, jnp.finfo(x.dtype).nmant)
    return s, (t * lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + eps) * scale.astype(F32)).astype(x.dtype)
