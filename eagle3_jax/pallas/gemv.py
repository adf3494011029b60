"""Few-row matmul streamed from HBM, for decode's projections at a device's share of the weights.

`rows_matmul(x, w, bias=None, bias_on=None, *, out_dtype)`: x [R, K] (R <= MAX_ROWS), w [K, N], bias
[N] or None -> x @ w (+ bias) [R, N] in out_dtype, products and sums in f32; bias_on, a bool scalar
(traced or not; None: True), where False leaves the bias out (a row-parallel projection adds it on
one device: a flag the kernel reads, not a select of its own before the call). One Pallas (Triton) program per
`block_n` output columns streams its [K, block_n] strip of w in `block_k` steps (Triton's software
pipeline keeps `num_stages` of them in flight) against x's rows padded to 16 (the tensor cores'
least M). `rows_matmul_reference` is the jnp function of the same signature.

The model runs a device's q|k|v and o_proj through it at one row under tensor parallelism
(`select.rows_matmul`, `gpt_oss.device_proj`), where XLA pads the row to two (`layers.rows_dot`) and
runs a GEMM, then a slice or a copy. Default launch `blocks_for(N)`: 32 columns a program where that
leaves at least 64 programs, else 16, each step a 32 KB strip of w. One H200, JAX 0.11.2, device
time a call at one row, 36 distinct weights (experiments/results/kernels_gemv_h200.json): [1024, 2880]
4.8 us against XLA's 7.5, [2048, 2880] 6.4 / 7.8, [2880, 1280] 7.0 / 8.0, [2880, 2560] 9.4 / 9.7.
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
MAX_ROWS = 16
STEP_ELEMENTS = 16384  # block_n x block_k of the default launch: a 32 KB bf16 strip of w a step


def _kernel(x_ref, w_ref, b_ref, on_ref, o_ref, *, R, K, N, BN, BK, has_bias):
    j = pl.program_id(0)
    rows = lax.broadcasted_iota(jnp.int32, (MAX_ROWS,), 0)
    cols = j * BN + lax.broadcasted_iota(jnp.int32, (BN,), 0)
    ks = lax.broadcasted_iota(jnp.int32, (BK,), 0)

    def step(i, acc):
        k = i * BK + ks
        xk = util.load(x_ref, (pl.ds(0, MAX_ROWS), pl.ds(i * BK, BK)),
                       mask=(rows < R)[:, None] & (k < K)[None, :], other=0)
        wk = util.load(w_ref, (pl.ds(i * BK, BK), pl.ds(j * BN, BN)), mask=(k < K)[:, None] & (cols < N)[None, :],
                       other=0)
        return acc + jnp.dot(xk, wk, preferred_element_type=F32)

    if has_bias:  # loaded before the loop, so that its round trip overlaps w's stream
        b = util.load(b_ref, (pl.ds(j * BN, BN),), mask=(cols < N) & (on_ref[0] != 0), other=0).astype(F32)
    acc = lax.fori_loop(0, pl.cdiv(K, BK), step, jnp.zeros((MAX_ROWS, BN), F32))
    if has_bias:
        acc = acc + b[None, :]
    util.store(o_ref, (pl.ds(0, MAX_ROWS), pl.ds(j * BN, BN)), acc.astype(o_ref.dtype),
               mask=(rows < R)[:, None] & (cols < N)[None, :])


def blocks_for(N: int) -> tuple[int, int]:
    """The default (block_n, block_k) for N output columns (module docstring)."""
    block_n = 32 if N >= 64 * 32 else 16
    return block_n, STEP_ELEMENTS // block_n


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def rows_matmul(x, w, bias=None, bias_on=None, *, out_dtype, block_n: int | None = None, block_k: int | None = None,
                num_warps: int = 4, num_stages: int = 4, interpret: bool = False):
    """See the module docstring. block_n, block_k: powers of two (block_n >= 16); None: `blocks_for`'s."""
    R, K = x.shape
    block_n = block_n or blocks_for(w.shape[-1])[0]
    block_k = block_k or STEP_ELEMENTS // block_n
    if w.ndim != 2 or w.shape[0] != K or not 1 <= R <= MAX_ROWS or (bias is not None and bias.shape != w.shape[1:]):
        raise ValueError(f"rows_matmul: expected x [R <= {MAX_ROWS}, K], w [K, N], bias [N]; got x {x.shape}, "
                         f"w {w.shape}, bias {None if bias is None else bias.shape}")
    if bias_on is not None and (bias is None or jnp.size(bias_on) != 1):
        raise ValueError(f"rows_matmul: bias_on must be one flag beside a bias; got bias_on of shape "
                         f"{jnp.shape(bias_on)} and bias {None if bias is None else bias.shape}")
    N = w.shape[1]
    b = jnp.zeros((1,), F32) if bias is None else bias
    on = jnp.ones((1,), jnp.int32) if bias_on is None else jnp.asarray(bias_on, jnp.int32).reshape(1)
    if interpret:  # the interpreter cannot read past an array's end (the Triton kernel masks such reads)
        Kp, Np = pl.cdiv(K, block_k) * block_k, pl.cdiv(N, block_n) * block_n
        x, w = util.pad(x, (MAX_ROWS, Kp)), util.pad(w, (Kp, Np))
        b = b if bias is None else util.pad(b, (Np,))
    out_rows = MAX_ROWS if interpret else R
    out = pl.pallas_call(
        functools.partial(_kernel, R=R, K=K, N=N, BN=block_n, BK=block_k, has_bias=bias is not None),
        grid=(pl.cdiv(N, block_n),),
        out_shape=jax.ShapeDtypeStruct((out_rows, pl.cdiv(N, block_n) * block_n if interpret else N), out_dtype),
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="rows_matmul",
    )(x, w, b, on)
    return out[:R, :N]


def rows_matmul_reference(x, w, bias=None, bias_on=None, *, out_dtype, **_):
    """Plain-jnp `rows_matmul`."""
    y = jnp.dot(x.astype(F32), w.astype(F32), precision=lax.Precision.HIGHEST)
    if bias is not None:
        y = y + jnp.where(True if bias_on is None else bias_on, bias.astype(F32), 0.0)
    return y.astype(out_dtype)
