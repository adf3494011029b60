"""Few-row matmul streamed from HBM, for decode's projections at a device's share of the weights.

`rows_matmul(x, w, bias=None, bias_on=None, *, out_dtype)`: x [R, K] (R <= MAX_ROWS), w [N, K] (each
output's weights contiguous: the layout HF and `gpt_oss.Attention` store the projections in), bias
[N] or None -> x @ w.T (+ bias) [R, N] in out_dtype, products and sums in f32; bias_on, a bool
scalar (traced or not; None: True), where False leaves the bias out (a row-parallel projection adds
it on one device: a flag the kernel reads, not a select of its own before the call). One Pallas
(Triton) program per `block_n` outputs streams their rows of w in `block_k` steps (Triton's
software pipeline keeps `num_stages` in flight) and sums the products on the CUDA cores, each of
x's rows in turn. `rows_matmul_reference` is the jnp function of the same signature.

The model runs a device's q|k|v and o_proj through it at one row under tensor parallelism
(`select.rows_matmul`, `gpt_oss.device_proj`), where XLA pads the row to two (`layers.rows_dot`) and
runs a GEMM, then a slice or a copy. The default launch (4 outputs a program, 1024-element steps)
was the fastest of a sweep over outputs a program and step lengths at every share. At one row the
kernel beat XLA's path on the same arrays at each share of o and q|k|v over 2 and 4 devices; at 4
rows XLA's was faster (`select.rows_matmul` says which runs). The figures, the sweep and the model's
tokens: docs/perf/multi_gpu.md ("wqkv and wo stored [out, in]").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle3_jax.pallas import util

F32 = jnp.float32
MAX_ROWS = 8  # x's rows, each summed in turn against every loaded step of w


def _kernel(x_ref, w_ref, b_ref, on_ref, o_ref, *, R, K, N, BN, BK, has_bias):
    j = pl.program_id(0)
    outs = j * BN + lax.broadcasted_iota(jnp.int32, (BN,), 0)
    ks = lax.broadcasted_iota(jnp.int32, (BK,), 0)
    if has_bias:  # loaded before the loop, so that its round trip overlaps w's stream
        b = util.load(b_ref, (pl.ds(j * BN, BN),), mask=(outs < N) & (on_ref[0] != 0), other=0).astype(F32)

    def step(i, accs):
        k = i * BK + ks
        wk = util.load(w_ref, (pl.ds(j * BN, BN), pl.ds(i * BK, BK)), mask=(outs < N)[:, None] & (k < K)[None, :],
                       other=0).astype(F32)
        new = []
        for r in range(R):
            xr = util.load(x_ref, (pl.ds(r, 1), pl.ds(i * BK, BK)), mask=(k < K)[None, :], other=0).astype(F32)
            new.append(accs[r] + jnp.sum(wk * xr, axis=1))
        return tuple(new)

    accs = lax.fori_loop(0, pl.cdiv(K, BK), step, tuple(jnp.zeros((BN,), F32) for _ in range(R)))
    for r, acc in enumerate(accs):
        if has_bias:
            acc = acc + b
        util.store(o_ref, (pl.ds(r, 1), pl.ds(j * BN, BN)), acc[None, :].astype(o_ref.dtype),
                   mask=(outs < N)[None, :])


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def rows_matmul(x, w, bias=None, bias_on=None, *, out_dtype, block_n: int = 4, block_k: int = 1024,
                num_warps: int = 4, num_stages: int = 4, interpret: bool = False):
    """See the module docstring. block_n, block_k: powers of two."""
    R, K = x.shape
    if w.ndim != 2 or w.shape[1] != K or not 1 <= R <= MAX_ROWS or (bias is not None and bias.shape != w.shape[:1]):
        raise ValueError(f"rows_matmul: expected x [R <= {MAX_ROWS}, K], w [N, K], bias [N]; got x {x.shape}, "
                         f"w {w.shape}, bias {None if bias is None else bias.shape}")
    if bias_on is not None and (bias is None or jnp.size(bias_on) != 1):
        raise ValueError(f"rows_matmul: bias_on must be one flag beside a bias; got bias_on of shape "
                         f"{jnp.shape(bias_on)} and bias {None if bias is None else bias.shape}")
    if block_n != util.pow2(block_n) or block_k != util.pow2(block_k):
        raise ValueError(f"rows_matmul: block_n and block_k must be powers of two; got {block_n}, {block_k}")
    N = w.shape[0]
    b = jnp.zeros((1,), F32) if bias is None else bias
    on = jnp.ones((1,), jnp.int32) if bias_on is None else jnp.asarray(bias_on, jnp.int32).reshape(1)
    n_out = pl.cdiv(N, block_n) * block_n if interpret else N
    if interpret:  # the interpreter cannot read past an array's end (the Triton kernel masks such reads)
        Kp = pl.cdiv(K, block_k) * block_k
        x, w = util.pad(x, (R, Kp)), util.pad(w, (n_out, Kp))
        b = b if bias is None else util.pad(b, (n_out,))
    out = pl.pallas_call(
        functools.partial(_kernel, R=R, K=K, N=N, BN=block_n, BK=block_k, has_bias=bias is not None),
        grid=(pl.cdiv(N, block_n),),
        out_shape=jax.ShapeDtypeStruct((R, n_out), out_dtype),
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="rows_matmul",
    )(x, w, b, on)
    return out[:, :N]


def rows_matmul_reference(x, w, bias=None, bias_on=None, *, out_dtype, **_):
    """Plain-jnp `rows_matmul`."""
    y = jnp.dot(x.astype(F32), w.astype(F32).T, precision=lax.Precision.HIGHEST)
    if bias is not None:
        y = y + jnp.where(True if bias_on is None else bias_on, bias.astype(F32), 0.0)
    return y.astype(out_dtype)
