"""The MXFP4 FMA path's kernels as warp-specialized Mosaic GPU kernels (GPU only).

BRANCH mosaic-next (session 20): `down_fma` and the gate_up changes below (biases loaded before the dot
products; both kernels on one `_stream` body) lower for CUDA but have NOT run on a GPU yet. First:
`pytest -m gpu tests/test_pallas_moe.py -k mosaic`, then `experiments/bench_kernels.py --only moe
--moe_tokens 1 --moe_jnp=false --moe_sweep "mosaic_tokens=0,mosaic_tokens=16,mosaic_down_tokens=16,
mosaic_tokens=16/mosaic_down_tokens=16" --moe_sweep_tokens 1,4`.

`down_fma(ids, weights, actq, <down experts>, out)` adds weights[p] * (W2_e act_p + b2_e) into row p // k
of out (f32 atomics, one per row and pair), the pairs' act (gate_up's pair layout, one factor a weight
word) all in SMEM (at most MAX_DOWN_PAIRS pairs); out is updated in place (pl.run_state + pl.core_map).

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
MAX_TOKENS = 16  # gate_up: all tokens' activations stay in SMEM
MAX_DOWN_PAIRS = 16  # down: all pairs' act stays in SMEM
_LOG2E = 1.4426950408889634


def _c(v, ty):
    return arith.constant(ty, v)


def _asm(ty, args, text, cons):
    return llvm.inline_asm(ty, list(args), text, cons)


def _index():
    idx = ir.IndexType.get()
    tid = arith.remui(gpu.thread_id(gpu.Dimension.x), _c(WG, idx))
    return tid, arith.divui(tid, _c(LANES, idx)), arith.remui(tid, _c(LANES, idx))


def _row_sum(w_ref, s_ref, x_ref, *, G, x_width, per_word):
    """This thread's row's dot product, summed over the row's 8 threads (every one holds it). w_ref u8
    [16 G / 16, 256] (the unit's blocks, row-major [16, G, 16]), s_ref u8 [>= G / 2, 32] (its scale bytes,
    [16, G]), x_ref u32 [>= 20 G / x_width, x_width] (the activations' pair layout [G, 20]: one factor a
    group at word 16, or per_word one a weight word at words 16..19)."""
    i8, i32, f32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32), ir.F32Type.get()
    idx = ir.IndexType.get()
    _, r, lane = _index()
    v16, v4 = ir.VectorType.get((16,), i8), ir.VectorType.get((4,), i32)
    nf = 4 if per_word else 1
    asm = moe._group_dot_asm(1, per_word=per_word)
    cons = ",".join(["=f"] * nf + ["r"] * 20)
    res_ty = f32 if nf == 1 else llvm.StructType.get_literal([f32] * nf)

    def ext(v, q):
        return vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([q]))

    def at(off, width):  # element `off` of a ref viewed as rows of `width`
        return [arith.divui(off, _c(width, idx)), arith.remui(off, _c(width, idx))]

    acc = _c(0.0, f32)
    for j in range(-(-G // LANES)):
        g = arith.addi(lane, _c(LANES * j, idx))
        valid = None
        if LANES * (j + 1) > G:
            valid = arith.cmpi(arith.CmpIPredicate.ult, g, _c(G, idx))
            g = arith.minui(g, _c(G - 1, idx))
        off = arith.addi(arith.muli(r, _c(G * 16, idx)), arith.muli(g, _c(16, idx)))
        wv = mu.bitcast(vector.load(v16, w_ref, at(off, 256)), v4)
        xo = arith.muli(g, _c(20, idx))
        xs = [ext(vector.load(v4, x_ref, at(arith.addi(xo, _c(4 * q, idx)), x_width)), t)
              for q in range(4) for t in range(4)]
        factors = [mu.bitcast(memref.load(x_ref, at(arith.addi(xo, _c(16 + q, idx)), x_width)), f32) for q in range(nf)]
        sc = memref.load(s_ref, at(arith.addi(arith.muli(r, _c(G, idx)), g), 32))
        f = mu.bitcast(arith.shli(arith.extui(i32, sc), _c(23, i32)), f32)  # 2^(s - 127) (0 for s = 0)
        res = _asm(res_ty, [ext(wv, q) for q in range(4)] + xs, asm, cons)
        sums = [res] if nf == 1 else [llvm.extractvalue(f32, res, [q]) for q in range(nf)]
        dot = functools.reduce(arith.addf, [arith.mulf(sq, fq) for sq, fq in zip(sums, factors)])
        term = arith.mulf(dot, f)
        acc = arith.addf(acc, term if valid is None else arith.select(valid, term, _c(0.0, f32)))
    for d in (1, 2, 4):
        acc = arith.addf(acc, mu.shfl_bfly(acc, d))
    return acc


def _gate_up_unit(ctx, w_ref, s_ref, x_ref, b_ref, ex_ref, a_ref, *, G, limit, alpha, dtype):
    """One gate_up unit on one compute warpgroup: `_row_sum`'s refs (x: the token's, rows of 8 words),
    b_ref [16] (the rows' biases, GMEM, loaded before the dot products), ex_ref f32 [8] (SMEM scratch),
    a_ref u32 [17] (GMEM: the block's pair words at 0, 4, 8, 12 and its factor at 16)."""
    del ctx
    i32, f32, idx = ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.IndexType.get()
    tid, r, lane = _index()
    even_r = arith.muli(arith.divui(r, _c(2, idx)), _c(2, idx))
    b_gate = arith.extf(f32, memref.load(b_ref, [even_r]))
    b_lin = arith.extf(f32, memref.load(b_ref, [arith.addi(even_r, _c(1, idx))]))
    acc = _row_sum(w_ref, s_ref, x_ref, G=G, x_width=8, per_word=False)
    lin = mu.shfl_bfly(acc, 8)  # row r + 1 (the linear row of gate row r, r even) lives 8 threads up
    even = arith.cmpi(arith.CmpIPredicate.eq, r, even_r)
    with mu.when(arith.andi(even, arith.cmpi(arith.CmpIPredicate.eq, lane, _c(0, idx)))):
        g_ = arith.minimumf(arith.addf(acc, b_gate), _c(limit, f32))
        l_ = arith.maximumf(arith.minimumf(arith.addf(lin, b_lin), _c(limit, f32)), _c(-limit, f32))
        e = _asm(f32, [arith.mulf(g_, _c(-alpha * _LOG2E, f32))], "ex2.approx.ftz.f32 $0, $1;", "=f,f")
        sig = arith.divf(_c(1.0, f32), arith.addf(_c(1.0, f32), e))
        act = arith.mulf(arith.mulf(g_, sig), arith.addf(l_, _c(1.0, f32)))
        act = arith.extf(f32, arith.truncf(mu.dtype_to_ir_type(dtype), act))
        memref.store(act, ex_ref, [arith.divui(r, _c(2, idx))])
    mu.warpgroup_barrier()
    with mu.when(arith.cmpi(arith.CmpIPredicate.ult, tid, _c(4, idx))):
        vals = [memref.load(ex_ref, [_c(c, idx)]) for c in range(8)]
        m = arith.maximumf(functools.reduce(arith.maximumf, vals), arith.negf(functools.reduce(arith.minimumf, vals)))
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


def _down_unit(ctx, w_ref, s_ref, x_ref, b_ref, wt_ref, o_ref, *, G):
    """One down unit on one compute warpgroup: `_row_sum`'s refs (x: the pair's act, rows of 64 words,
    one factor a weight word), b_ref [16] (the rows' biases, GMEM), wt_ref f32 [1] (the pair's routing
    weight, GMEM), o_ref f32 [16] (GMEM: the token's outputs of these rows, added to atomically)."""
    del ctx
    i32, f32, idx = ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.IndexType.get()
    _, r, lane = _index()
    b = arith.extf(f32, memref.load(b_ref, [r]))  # loaded before the dot products
    wt = memref.load(wt_ref, [_c(0, idx)])
    acc = _row_sum(w_ref, s_ref, x_ref, G=G, x_width=64, per_word=True)
    with mu.when(arith.cmpi(arith.CmpIPredicate.eq, lane, _c(0, idx))):
        ptr = mu.getelementptr(mu.memref_ptr(o_ref), [arith.index_cast(i32, r)], f32)
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [ptr, arith.mulf(arith.addf(acc, b), wt)],
                        "red.relaxed.gpu.add.f32 [$0], $1;", "l,f", has_side_effects=True)


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


def _layout(E, R, G, P, num_ctas):
    """Units (16 rows of one pair's expert) and the views the copies read: (upp units a pair, U units,
    ncta blocks, steps a block, 256-byte rows of a unit's blocks, 32-byte rows of its scales, rows a scale
    copy takes: whole 128-byte lines, past the array's end zeros)."""
    upp = R // ROWS
    U = P * upp
    ncta = min(num_ctas, U)
    WB, SB = ROWS * G * 16 // 256, ROWS * G // 32
    return upp, U, ncta, -(-U // ncta), WB, SB, -(-SB // 4) * 4


def _stream(ids_ref, w_ref, s_ref, smem, bars, consumed, *, lay, stages, compute_wgs, x_copies, prologue, unit):
    """The kernel body shared by both kernels: the memory warpgroup copies the activations
    (`x_copies(x_bar)`), then each unit's blocks and scales into slot i % stages; compute warpgroup w
    runs `prologue()`, waits for the activations and runs `unit(slot, p, rb, e)` for its units i
    (i % compute_wgs == w; block c takes units c, c + ncta, ...; the last block's spare steps redo the
    last unit)."""
    upp, U, ncta, steps, WB, SB, SBp = lay
    w_smem, s_smem = smem
    w_bar, s_bar, x_bar = bars
    cta, wg = lax.axis_index("cta"), lax.axis_index("wg")

    def unit_at(i):
        u = jnp.minimum(cta + i * ncta, U - 1)
        return u // upp, u % upp

    @pl.when(wg < compute_wgs)
    def _compute():
        prologue()
        for c in range(x_bar.shape[0]):
            plgpu.barrier_wait(x_bar.at[c])

        @pl.loop(0, steps)
        def _(i):
            @pl.when(i % compute_wgs == wg)
            def _():
                slot = i % stages
                p, rb = unit_at(i)
                plgpu.barrier_wait(w_bar.at[slot])
                plgpu.barrier_wait(s_bar.at[slot])
                unit(w_smem.at[slot], s_smem.at[slot], p, rb, ids_ref[p])
                plgpu.barrier_arrive(consumed.at[slot])

    @pl.when(wg == compute_wgs)
    def _memory():
        x_copies(cta, x_bar)

        @pl.loop(0, steps)
        def _(i):
            slot = i % stages
            p, rb = unit_at(i)
            u = ids_ref[p] * upp + rb

            @pl.when(i >= stages)
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(u * WB, WB)], w_smem.at[slot], w_bar.at[slot])
            plgpu.copy_gmem_to_smem(s_ref.at[pl.ds(u * SB, SBp)], s_smem.at[slot], s_bar.at[slot])


def _ring(lay, stages, extra_smem, nx):
    """Scratch of `_stream`: (the two slot rings, extra SMEM...), its barriers, the slots' consumed barriers."""
    _, _, _, _, WB, _, SBp = lay
    return ((plgpu.SMEM((stages, WB, 256), jnp.uint8), plgpu.SMEM((stages, SBp, 32), jnp.uint8)) + tuple(extra_smem),
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=nx)),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages))


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
    lay = _layout(E, R, G, P, num_ctas)
    upp, _, ncta, _, WB, SB, _ = lay
    XT = G * 20 // 8  # 32-byte rows of one token's activations
    xr = T * XT
    nx = -(-xr // X_ROWS)

    def body(ids_ref, w_ref, s_ref, x_ref, b_ref, a_ref, o_ref, scoped):
        (w_smem, s_smem, x_smem, ex_smem), bars, consumed = scoped
        wg = lax.axis_index("wg")

        def x_copies(cta, x_bar):
            for c in range(nx):
                rows = min(X_ROWS, -(-(xr - c * X_ROWS) // 4) * 4)  # whole 128-byte lines
                # a traced start: a static one is bounds-checked, and the last copy may read past the
                # array's end (TMA fills zeros)
                start = cta * 0 + c * X_ROWS
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(start, rows)], x_smem.at[pl.ds(c * X_ROWS, rows)], x_bar.at[c])

        def prologue():
            @pl.when(wg == 0)
            def _():
                plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(functools.partial(_zero, n=T * H, ncta=ncta))(o_ref)

        def unit(w_slot, s_slot, p, rb, e):
            plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 6)(functools.partial(
                _gate_up_unit, G=G, limit=limit, alpha=alpha, dtype=dtype))(
                w_slot, s_slot, x_smem.at[pl.ds((p // k) * XT, XT)], b_ref.at[pl.ds(e * R + rb * ROWS, ROWS)],
                ex_smem.at[wg], a_ref.at[p, pl.ds(20 * (rb // 4) + rb % 4, 17)])

        _stream(ids_ref, w_ref, s_ref, (w_smem, s_smem), bars, consumed, lay=lay, stages=stages,
                compute_wgs=compute_wgs, x_copies=x_copies, prologue=prologue, unit=unit)

    def mxfp4_moe_gate_up_mosaic(*refs):  # the profile's kernel name
        pl.run_scoped(lambda *scoped: body(*refs, scoped),
                      *_ring(lay, stages, (plgpu.SMEM((nx * X_ROWS, 8), jnp.uint32),
                                           plgpu.SMEM((compute_wgs, 8), jnp.float32)), nx),
                      collective_axes="wg")

    actq, out = plgpu.kernel(
        mxfp4_moe_gate_up_mosaic,
        out_type=(jax.ShapeDtypeStruct((P, act_words), jnp.uint32), jax.ShapeDtypeStruct((T * H,), jnp.float32)),
        grid=(ncta,), grid_names=("cta",), num_threads=compute_wgs + 1, thread_name="wg",
    )(ids.astype(jnp.int32), gate_up_blocks.reshape(E * upp * WB, 256), gate_up_scales.reshape(E * upp * SB, 32),
      xq.reshape(xr, 8), gate_up_bias.reshape(E * R))
    return actq, out.reshape(T, H)


@functools.partial(jax.jit, static_argnames=("k", "stages", "compute_wgs", "num_ctas"))
def down_fma(ids, weights, actq, down_blocks, down_scales, down_bias, out, *, k: int, stages: int = 4,
             compute_wgs: int = 2, num_ctas: int = 132):
    """ids int32 [P], weights f32 [P] (pair p: token p // k), actq u32 [P, W] (`gate_up_fma`'s pair layout,
    W a multiple of 64 words, P <= MAX_DOWN_PAIRS), the packed down experts (HF layout), out f32 [T, H]
    -> out + sum over pairs of weights[p] * (W2_e act_p + b2_e) in row t = p // k (f32 atomics: the
    order of the k additions varies)."""
    E, R, G, _ = down_blocks.shape
    P, W = actq.shape
    if P > MAX_DOWN_PAIRS or R % ROWS or G % 2 or stages % compute_wgs or W % 64 or W < G * 20:
        raise ValueError(f"down_fma: pairs {P} (<= {MAX_DOWN_PAIRS}), rows {R}, groups {G}, act words {W}, stages "
                         f"{stages}, compute_wgs {compute_wgs} do not fit")
    lay = _layout(E, R, G, P, num_ctas)
    upp, _, _, _, WB, SB, _ = lay
    XR = W // 64  # 256-byte rows of one pair's act

    def body(ids_ref, wt_ref, w_ref, s_ref, x_ref, b_ref, o_ref, scoped):
        (w_smem, s_smem, x_smem), bars, consumed = scoped

        def x_copies(cta, x_bar):
            for p in range(P):
                plgpu.copy_gmem_to_smem(x_ref.at[p], x_smem.at[p], x_bar.at[p])

        def unit(w_slot, s_slot, p, rb, e):
            plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 6)(functools.partial(_down_unit, G=G))(
                w_slot, s_slot, x_smem.at[p], b_ref.at[pl.ds(e * R + rb * ROWS, ROWS)], wt_ref.at[pl.ds(p, 1)],
                o_ref.at[p // k, pl.ds(rb * ROWS, ROWS)])

        _stream(ids_ref, w_ref, s_ref, (w_smem, s_smem), bars, consumed, lay=lay, stages=stages,
                compute_wgs=compute_wgs, x_copies=x_copies, prologue=lambda: None, unit=unit)

    def stateful(refs):
        ids_ref, wt_ref, w_ref, s_ref, x_ref, b_ref, o_ref = refs

        @pl.core_map(plgpu.Mesh(grid=(lay[2],), grid_names=("cta",), num_threads=compute_wgs + 1, thread_name="wg"),
                     name="mxfp4_moe_down_mosaic")
        def _():
            pl.run_scoped(lambda *scoped: body(ids_ref, wt_ref, w_ref, s_ref, x_ref, b_ref, o_ref, scoped),
                          *_ring(lay, stages, (plgpu.SMEM((P, XR, 64), jnp.uint32),), P), collective_axes="wg")

    *_, out = pl.run_state(stateful)((ids.astype(jnp.int32), weights.astype(jnp.float32),
                                      down_blocks.reshape(E * upp * WB, 256), down_scales.reshape(E * upp * SB, 32),
                                      actq.reshape(P, XR, 64), down_bias.reshape(E * R), out))
    return out
