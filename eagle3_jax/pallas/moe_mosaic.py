"""The MXFP4 FMA path's gate_up kernel as a warp-specialized Mosaic GPU kernel (GPU only).

`gate_up_fma(ids, xq, gate_up_blocks, gate_up_scales, gate_up_bias, ...)` computes what
`moe._fma_gate_up_kernel` computes for every (token, expert) pair: act = SwiGLU(W1_e x_t + b1_e),
rounded to x's dtype, written in the down kernel's pair layout (one power-of-two factor per 8
columns), and returns a zeroed f32 [T, H] for the down kernel's atomic adds.

Why: the Triton kernels stall on their own loads (each program loads a K step, then decodes it, and
the SM has nothing else to run meanwhile). Here one memory warpgroup streams 16-row units of the
routed experts' rows (their blocks and scale bytes are contiguous spans: TMA copies with 256- and
32-byte rows into an S-slot SMEM ring) while the compute warpgroups take the units in turn; all T
tokens' activations (`moe.f16_pairs` layout) are copied to SMEM once. A compute thread owns one of the
unit's rows and every 8th scale group: 16 bytes of weights and its scale byte from SMEM, the group's
16 pair words and factor, the f16x2 PTX of `moe._group_dot_asm`, a 3-step shuffle sum over the row's
8 threads; then gate and linear rows (adjacent) meet by one more shuffle, the 8 act values of the unit
go through SMEM so that four threads write the block's pair words and one its factor.

Status: correct (GPU tests at gpt-oss sizes) but not yet faster, so `MoeConfig.mosaic_tokens` is 0 by
default. H200, JAX 0.11.2, device kernel time of gate_up at T = 1 / 4 / 16 (one process,
experiments/results/moe_mosaic_h200.json): this kernel 15.96 / 48.99 / 182.1 us, the Triton kernel
15.10 / 49.19 / 166.5 us. The same loop without the epilogue (raw row sums to HBM) took 12.1 us at T=1
(71% of the HBM roofline) and the TMA stream alone 10.0 us (experiments/results/moe_mosaic_probe_h200.json,
the probe script of commit c06367e, another run). So the epilogue costs about 4 us; not yet measured
apart, the likely causes: each unit waits on a global load of its 16 biases, issued after the dot products with
nothing to hide it, and syncs its warpgroup twice around the SMEM exchange of the 8 act values. Next:
load the biases with the unit (TMA, or before the group loop), keep a unit's block maximum inside one
warp, and lower the memory warpgroup's registers (setmaxnreg) so that more compute warps fit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref, vector

from eagle3_jax.pallas import moe

ROWS = 16  # gate_up rows per unit (8 act columns: one block of the pair layout)
LANES = 8  # threads per row: thread t of a warpgroup owns row t // 8 and scale groups t % 8, t % 8 + 8, ...
WG = 128  # threads per warpgroup
X_ROWS = 256  # 32-byte rows per copy of the activations (a TMA box holds at most 256)
MAX_TOKENS = 16  # all tokens' activations stay in SMEM
_LOG2E = 1.4426950408889634


def _c(v, ty):
    return arith.constant(ty, v)


def _asm(ty, args, text, cons):
    return llvm.inline_asm(ty, list(args), text, cons)


def _unit(ctx, w_ref, s_ref, x_ref, b_ref, ex_ref, a_ref, *, G, limit, alpha, dtype):
    """One unit on one compute warpgroup. w_ref u8 [16 G / 16, 256] (the unit's blocks, row-major
    [16, G, 16]), s_ref u8 [>= G / 2, 32] (its scale bytes, [16, G]), x_ref u32 [>= 20 G / 8, 8] (its
    token's pair layout [G, 20]), b_ref [16] (its rows' biases, GMEM), ex_ref f32 [8] (SMEM scratch),
    a_ref u32 [17] (GMEM: the block's pair words at 0, 4, 8, 12 and its factor at 16)."""
    del ctx
    i8, i32, f32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32), ir.F32Type.get()
    idx = ir.IndexType.get()
    tid = arith.remui(gpu.thread_id(gpu.Dimension.x), _c(WG, idx))
    r = arith.divui(tid, _c(LANES, idx))
    lane = arith.remui(tid, _c(LANES, idx))
    v16, v4 = ir.VectorType.get((16,), i8), ir.VectorType.get((4,), i32)
    asm, cons = moe._group_dot_asm(1), "=f," + ",".join(["r"] * 20)

    def ext(v, q):
        return vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([q]))

    def at(ref, off, width):  # element `off` of a ref viewed as rows of `width`
        return [arith.divui(off, _c(width, idx)), arith.remui(off, _c(width, idx))]

    acc = _c(0.0, f32)
    for j in range(-(-G // LANES)):
        g = arith.addi(lane, _c(LANES * j, idx))
        valid = None
        if LANES * (j + 1) > G:
            valid = arith.cmpi(arith.CmpIPredicate.ult, g, _c(G, idx))
            g = arith.minui(g, _c(G - 1, idx))
        off = arith.addi(arith.muli(r, _c(G * 16, idx)), arith.muli(g, _c(16, idx)))
        wv = mu.bitcast(vector.load(v16, w_ref, at(w_ref, off, 256)), v4)
        xo = arith.muli(g, _c(20, idx))
        xs = [ext(vector.load(v4, x_ref, at(x_ref, arith.addi(xo, _c(4 * q, idx)), 8)), t)
              for q in range(4) for t in range(4)]
        factor = mu.bitcast(memref.load(x_ref, at(x_ref, arith.addi(xo, _c(16, idx)), 8)), f32)
        sc = memref.load(s_ref, at(s_ref, arith.addi(arith.muli(r, _c(G, idx)), g), 32))
        f = arith.mulf(mu.bitcast(arith.shli(arith.extui(i32, sc), _c(23, i32)), f32), factor)  # 2^(s-127) (0 for s=0)
        term = arith.mulf(_asm(f32, [ext(wv, q) for q in range(4)] + xs, asm, cons), f)
        acc = arith.addf(acc, term if valid is None else arith.select(valid, term, _c(0.0, f32)))
    for d in (1, 2, 4):
        acc = arith.addf(acc, mu.shfl_bfly(acc, d))
    # row r + 1 (the linear row of gate row r, r even) lives 8 threads up
    lin = mu.shfl_bfly(acc, 8)
    bias = lambda i: arith.extf(f32, memref.load(b_ref, [i]))  # noqa: E731
    even = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(r, _c(2, idx)), _c(0, idx))
    with mu.when(arith.andi(even, arith.cmpi(arith.CmpIPredicate.eq, lane, _c(0, idx)))):
        g_ = arith.minimumf(arith.addf(acc, bias(r)), _c(limit, f32))
        l_ = arith.addf(lin, bias(arith.addi(r, _c(1, idx))))
        l_ = arith.maximumf(arith.minimumf(l_, _c(limit, f32)), _c(-limit, f32))
        e = _asm(f32, [arith.mulf(g_, _c(-alpha * _LOG2E, f32))], "ex2.approx.ftz.f32 $0, $1;", "=f,f")
        sig = arith.divf(_c(1.0, f32), arith.addf(_c(1.0, f32), e))
        act = arith.mulf(arith.mulf(g_, sig), arith.addf(l_, _c(1.0, f32)))
        act = arith.extf(f32, arith.truncf(mu.dtype_to_ir_type(dtype), act))
        memref.store(act, ex_ref, [arith.divui(r, _c(2, idx))])
    mu.warpgroup_barrier()
    with mu.when(arith.cmpi(arith.CmpIPredicate.ult, tid, _c(4, idx))):
        vals = [memref.load(ex_ref, [_c(c, idx)]) for c in range(8)]
        m = vals[0]
        for v in vals[1:]:
            m = arith.maximumf(m, v)
        m = arith.maximumf(m, arith.negf(functools.reduce(arith.minimumf, vals)))  # max |act|
        ebits = arith.andi(arith.shrui(mu.bitcast(m, i32), _c(23, i32)), _c(0xFF, i32))
        ex = arith.minsi(arith.maxsi(arith.subi(ebits, _c(126, i32)), _c(moe._E_MIN, i32)), _c(moe._E_MAX, i32))
        scale = mu.bitcast(arith.shli(arith.subi(_c(14 + 127, i32), ex), _c(23, i32)), f32)  # 2^(14 - e)
        kk = arith.index_cast(i32, tid)
        # pair k = (act[3 - k], act[7 - k]): select by k among the four candidates
        lo, hi = vals[3], vals[7]
        for k in range(1, 4):
            is_k = arith.cmpi(arith.CmpIPredicate.eq, kk, _c(k, i32))
            lo, hi = arith.select(is_k, vals[3 - k], lo), arith.select(is_k, vals[7 - k], hi)
        word = _asm(i32, [arith.mulf(hi, scale), arith.mulf(lo, scale)], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f")
        memref.store(word, a_ref, [arith.muli(tid, _c(4, idx))])
        with mu.when(arith.cmpi(arith.CmpIPredicate.eq, tid, _c(0, idx))):
            memref.store(arith.shli(arith.addi(ex, _c(127, i32)), _c(23, i32)), a_ref, [_c(16, idx)])  # 2^e
    mu.warpgroup_barrier()  # ex_ref is rewritten by the next unit


def _zero(ctx, o_ref, *, n, ncta):
    """Block c's share of o_ref f32 [n] (GMEM) set to 0 by one warpgroup."""
    del ctx
    idx, f32 = ir.IndexType.get(), ir.F32Type.get()
    per = -(-n // ncta)
    tid = arith.remui(gpu.thread_id(gpu.Dimension.x), _c(WG, idx))
    base = arith.muli(gpu.block_id(gpu.Dimension.x), _c(per, idx))
    for j in range(-(-per // WG)):
        i = arith.addi(tid, _c(WG * j, idx))
        pos = arith.addi(base, i)
        ok = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, i, _c(per, idx)),
                        arith.cmpi(arith.CmpIPredicate.ult, pos, _c(n, idx)))
        with mu.when(ok):
            memref.store(_c(0.0, f32), o_ref, [pos])


@functools.partial(jax.jit, static_argnames=("k", "limit", "alpha", "dtype", "act_words", "stages", "compute_wgs",
                                             "num_ctas"))
def gate_up_fma(ids, xq, gate_up_blocks, gate_up_scales, gate_up_bias, *, k: int, limit: float, alpha: float, dtype,
                act_words: int, stages: int = 4, compute_wgs: int = 2, num_ctas: int = 132):
    """ids int32 [P] (pair p: token p // k), xq u32 [T, G, 5, 4] (`moe.f16_pairs`, T <= 16), the packed
    gate_up experts (HF layout) -> (actq u32 [P, act_words]: act rounded to `dtype`, in the down kernel's
    pair layout, words past the last block unwritten; out f32 [T, H] of zeros). H = 32 G."""
    E, R, G, _ = gate_up_blocks.shape
    T = xq.shape[0]
    P = ids.shape[0]
    H = G * moe.BLOCK
    if T > MAX_TOKENS or R % ROWS or G % 2 or stages % compute_wgs or act_words < (R // ROWS) * 5:
        raise ValueError(f"gate_up_fma: T {T} (<= {MAX_TOKENS}), rows {R}, groups {G}, stages {stages}, "
                         f"compute_wgs {compute_wgs}, act_words {act_words} do not fit")
    upp = R // ROWS  # units per pair
    U = P * upp
    ncta = min(num_ctas, U)
    steps = -(-U // ncta)
    WB, SB = ROWS * G * 16 // 256, ROWS * G // 32  # 256-byte rows of a unit's blocks, 32-byte rows of its scales
    SBp = -(-SB // 4) * 4  # a copy is a whole number of 128-byte lines (past the array's end: zeros)
    XT = G * 20 // 8  # 32-byte rows of one token's activations
    xr = T * XT
    nx = -(-xr // X_ROWS)
    w2 = gate_up_blocks.reshape(E * upp * WB, 256)
    s2 = gate_up_scales.reshape(E * upp * SB, 32)
    x2 = xq.reshape(xr, 8)
    b2 = gate_up_bias.reshape(E * R)

    def kernel(ids_ref, w_ref, s_ref, x_ref, b_ref, a_ref, o_ref, scoped):
        (w_smem, s_smem, x_smem, ex_smem), (w_bar, s_bar, x_bar), consumed = scoped
        cta, wg = lax.axis_index("cta"), lax.axis_index("wg")

        def unit(i):
            u = jnp.minimum(cta + i * ncta, U - 1)  # the last block's spare steps redo the last unit
            return u // upp, u % upp

        @pl.when(wg < compute_wgs)
        def _compute():
            @pl.when(wg == 0)
            def _():
                plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(functools.partial(_zero, n=T * H, ncta=ncta))(o_ref)

            for c in range(nx):
                plgpu.barrier_wait(x_bar.at[c])

            @pl.loop(0, steps)
            def _(i):
                @pl.when(i % compute_wgs == wg)
                def _():
                    slot = i % stages
                    p, rb = unit(i)
                    e = ids_ref[p]
                    plgpu.barrier_wait(w_bar.at[slot])
                    plgpu.barrier_wait(s_bar.at[slot])
                    plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 6)(functools.partial(
                        _unit, G=G, limit=limit, alpha=alpha, dtype=dtype))(
                        w_smem.at[slot], s_smem.at[slot], x_smem.at[pl.ds((p // k) * XT, XT)],
                        b_ref.at[pl.ds(e * R + rb * ROWS, ROWS)], ex_smem.at[wg],
                        a_ref.at[p, pl.ds(20 * (rb // 4) + rb % 4, 17)])
                    plgpu.barrier_arrive(consumed.at[slot])

        @pl.when(wg == compute_wgs)
        def _memory():
            for c in range(nx):
                rows = min(X_ROWS, -(-(xr - c * X_ROWS) // 4) * 4)  # whole 128-byte lines
                # a traced start: a static one is bounds-checked, and the last copy may read past the
                # array's end (TMA fills zeros)
                start = cta * 0 + c * X_ROWS
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(start, rows)], x_smem.at[pl.ds(c * X_ROWS, rows)], x_bar.at[c])

            @pl.loop(0, steps)
            def _(i):
                slot = i % stages
                p, rb = unit(i)
                u = ids_ref[p] * upp + rb

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(u * WB, WB)], w_smem.at[slot], w_bar.at[slot])
                plgpu.copy_gmem_to_smem(s_ref.at[pl.ds(u * SB, SBp)], s_smem.at[slot], s_bar.at[slot])

    def mxfp4_moe_gate_up_mosaic(ids_ref, w_ref, s_ref, x_ref, b_ref, a_ref, o_ref):  # the profile's kernel name
        pl.run_scoped(
            lambda *args: kernel(ids_ref, w_ref, s_ref, x_ref, b_ref, a_ref, o_ref, args),
            (plgpu.SMEM((stages, WB, 256), jnp.uint8), plgpu.SMEM((stages, SBp, 32), jnp.uint8),
             plgpu.SMEM((nx * X_ROWS, 8), jnp.uint32), plgpu.SMEM((compute_wgs, 8), jnp.float32)),
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=nx)),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            collective_axes="wg",
        )

    actq, out = plgpu.kernel(
        mxfp4_moe_gate_up_mosaic,
        out_type=(jax.ShapeDtypeStruct((P, act_words), jnp.uint32), jax.ShapeDtypeStruct((T * H,), jnp.float32)),
        grid=(ncta,), grid_names=("cta",), num_threads=compute_wgs + 1, thread_name="wg",
    )(ids.astype(jnp.int32), w2, s2, x2, b2)
    return actq, out.reshape(T, H)
