"""Probe for issue 8's next step: the FMA path's gate_up matvec as a warp-specialized Mosaic GPU kernel.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python experiments/moe_mosaic_probe.py \
      --out experiments/results/moe_mosaic_probe_h200.json

The Triton FMA kernels (eagle3_jax/pallas/moe.py) stall on their own loads: each program loads a K
step, then decodes it, and nothing else on the SM hides the wait (Nsight: 0.45 instructions a cycle,
long-scoreboard the top stall). Here one memory warpgroup streams 16-row units of the routed experts'
gate_up rows (blocks and scale bytes, contiguous spans, TMA into an S-slot SMEM ring) while compute
warpgroups take the units in turn; all T tokens' activations (moe.f16_pairs layout) sit in SMEM. Each
thread of a compute warpgroup owns one of the unit's rows and every 8th scale group: 16 bytes of
weights and its scale byte from SMEM, the group's 16 pair words and factor, the f16x2 PTX of
`moe._group_dot_asm`, then a 3-step shuffle sum over the row's 8 threads.

It computes the raw matvec only: out[p, r] = W_{ids[p]}[r] . x[p // k] (f32 [P, 2I], no bias, SwiGLU or
pair-layout epilogue), so it is a measurement of the approach, not a drop-in kernel. The JSON holds,
from one process on one device: the copy bandwidth, the Triton FMA gate_up kernel's device time
(`mxfp4_moe`, which also applies bias, SwiGLU and writes the pair layout: a few hundred ns), this
kernel with compute and with its compute warpgroups only releasing slots (the TMA stream alone), and
the relative error against a float64 product of the dequantized rows.
"""

import functools
import json
import os
import sys

import numpy as np
from absl import app, flags

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref, vector

from eagle3_jax.models import mxfp4
from eagle3_jax.pallas import moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402

flags.DEFINE_list("tokens", ["1", "4"], "token counts T (top-4 routing, random distinct experts per token)")
flags.DEFINE_list("variants", ["stages=4/compute_wgs=2", "stages=6/compute_wgs=3", "stages=4/compute_wgs=2/compute=0"],
                  "kernel launches to time, 'key=value/...' (stages, compute_wgs, compute)")
flags.DEFINE_integer("routings", 4, "distinct routings cycled inside one timed call (defeats L2 reuse)")
flags.DEFINE_string("out", None, "JSON output path")
FLAGS = flags.FLAGS

ROWS = 16  # rows per unit (one compute warpgroup's work between two slot releases)
LANES = 8  # threads per row: thread t of a warpgroup owns row t // 8 and scale groups t % 8, t % 8 + 8, ...
WG = 128  # threads per warpgroup


def _up(n, m):
    return -(-n // m) * m  # slots padded to 128-byte multiples (TMA destinations)


def _c(v, ty):
    return arith.constant(ty, v)


def _unit_compute(ctx, w_ref, s_ref, x_ref, o_ref, *, G):
    """w_ref u8 [16 * G * 16 / 256, 256] (the unit's blocks, row-major [16, G, 16]), s_ref u8 [>= 16 G / 32, 32]
    (its scale bytes, row-major [16, G]), x_ref u32 [>= 20 G / 64, 64] (the unit's token's pair layout [G, 20]),
    o_ref f32 [16] (GMEM)."""
    del ctx
    i8, i32, f32 = (ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32), ir.F32Type.get())
    idx = ir.IndexType.get()
    tid = arith.remui(gpu.thread_id(gpu.Dimension.x), _c(WG, idx))
    r = arith.divui(tid, _c(LANES, idx))
    lane = arith.remui(tid, _c(LANES, idx))
    acc = _c(0.0, f32)
    asm = moe._group_dot_asm(1)
    cons = "=f," + ",".join(["r"] * 20)
    nj = -(-G // LANES)
    v16 = ir.VectorType.get((16,), i8)
    v4 = ir.VectorType.get((4,), i32)

    def ext(v, q):
        return vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([q]))

    for j in range(nj):
        g = arith.addi(lane, _c(LANES * j, idx))
        valid = None
        if LANES * (j + 1) > G:
            valid = arith.cmpi(arith.CmpIPredicate.ult, g, _c(G, idx))
            g = arith.minui(g, _c(G - 1, idx))
        off = arith.addi(arith.muli(r, _c(G * 16, idx)), arith.muli(g, _c(16, idx)))
        wv = mu.bitcast(vector.load(v16, w_ref, [arith.divui(off, _c(256, idx)), arith.remui(off, _c(256, idx))]), v4)
        words = [ext(wv, q) for q in range(4)]
        xs = []
        xo = arith.muli(g, _c(20, idx))  # word offset of the group's pair layout
        for q in range(4):
            o = arith.addi(xo, _c(4 * q, idx))
            xv = vector.load(v4, x_ref, [arith.divui(o, _c(64, idx)), arith.remui(o, _c(64, idx))])
            xs += [ext(xv, t) for t in range(4)]
        o = arith.addi(xo, _c(16, idx))
        factor = mu.bitcast(memref.load(x_ref, [arith.divui(o, _c(64, idx)), arith.remui(o, _c(64, idx))]), f32)
        b = arith.addi(arith.muli(r, _c(G, idx)), g)
        sc = memref.load(s_ref, [arith.divui(b, _c(32, idx)), arith.remui(b, _c(32, idx))])
        sc = arith.shli(arith.extui(i32, sc), _c(23, i32))
        f = arith.mulf(mu.bitcast(sc, f32), factor)
        dot = llvm.inline_asm(f32, words + xs, asm, cons)
        term = arith.mulf(dot, f)
        if valid is not None:
            term = arith.select(valid, term, _c(0.0, f32))
        acc = arith.addf(acc, term)
    for d in (1, 2, 4):
        acc = arith.addf(acc, mu.shfl_bfly(acc, d))
    with mu.when(arith.cmpi(arith.CmpIPredicate.eq, lane, _c(0, idx))):
        memref.store(acc, o_ref, [r])


def fma_matvec(wq, sc, xq, ids, *, k, num_ctas=132, stages=4, compute_wgs=2, compute=True):
    """wq u8 [E, R, G, 16], sc u8 [E, R, G] (HF MXFP4 layout), xq u32 [T, G, 20] (moe.f16_pairs), ids int32
    [P] (pair p: token p // k, expert ids[p]) -> f32 [P, R], the raw matvec of each pair (compute=False:
    nothing written, the stream alone). Persistent grid of num_ctas blocks; block c takes units c, c +
    num_ctas, ... (the last block's spare steps redo the last unit). stages % compute_wgs == 0, so that
    each SMEM slot always feeds the same warpgroup and its barrier phases advance in step. All T tokens'
    activations are copied to SMEM once (T <= 16)."""
    E, R, G, _ = wq.shape
    T = xq.shape[0]
    P = ids.shape[0]
    assert R % ROWS == 0 and (ROWS * G) % 16 == 0 and stages % compute_wgs == 0 and T <= 16
    upp = R // ROWS  # units per pair
    U = P * upp
    ncta = min(num_ctas, U)
    steps = -(-U // ncta)
    # every copy is of contiguous bytes: views with wide rows (TMA with 16-byte rows ran at 1.2 TB/s)
    WB = ROWS * G * 16 // 256  # 256-byte rows of a unit's blocks
    SB = ROWS * G // 32  # 32-byte rows of a unit's scales
    XR = _up(G * 20, 128) // 64  # 256-byte rows of one token's activations (padded to 512-byte multiples)
    assert WB * 256 == ROWS * G * 16 and SB * 32 == ROWS * G
    SBp = _up(SB, 4)  # copies of whole 128-byte multiples (past the end: zeros)
    w2 = wq.reshape(E * upp * WB, 256)
    s2 = sc.reshape(E * upp * SB, 32)
    x2 = jnp.pad(xq.reshape(T, G * 20), ((0, 0), (0, XR * 64 - G * 20))).reshape(T, XR, 64)

    def kernel(ids_ref, w_ref, s_ref, x_ref, o_ref, scoped):
        (w_smem, s_smem, x_smem), (w_bar, s_bar, x_bar), consumed = scoped
        cta = lax.axis_index("cta")
        wg = lax.axis_index("wg")

        def unit(i):
            u = jnp.minimum(cta + i * ncta, U - 1)
            p = u // upp
            return u, p, u % upp

        @pl.when(wg < compute_wgs)
        def _compute():
            plgpu.barrier_wait(x_bar.at[0])

            @pl.loop(0, steps)
            def _(i):
                @pl.when(i % compute_wgs == wg)
                def _():
                    slot = i % stages
                    u, p, rb = unit(i)
                    plgpu.barrier_wait(w_bar.at[slot])
                    plgpu.barrier_wait(s_bar.at[slot])
                    if compute:
                        plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 4)(functools.partial(_unit_compute, G=G))(
                            w_smem.at[slot], s_smem.at[slot], x_smem.at[p // k], o_ref.at[p, pl.ds(rb * ROWS, ROWS)])
                    plgpu.barrier_arrive(consumed.at[slot])

        @pl.when(wg == compute_wgs)
        def _memory():
            plgpu.copy_gmem_to_smem(x_ref, x_smem, x_bar.at[0])

            @pl.loop(0, steps)
            def _(i):
                slot = i % stages
                u, p, rb = unit(i)
                e = ids_ref[p]

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds((e * upp + rb) * WB, WB)], w_smem.at[slot], w_bar.at[slot])
                plgpu.copy_gmem_to_smem(s_ref.at[pl.ds((e * upp + rb) * SB, SBp)], s_smem.at[slot], s_bar.at[slot])

    def entry(ids_ref, w_ref, s_ref, x_ref, o_ref):
        pl.run_scoped(
            lambda *args: kernel(ids_ref, w_ref, s_ref, x_ref, o_ref, args),
            (plgpu.SMEM((stages, WB, 256), jnp.uint8), plgpu.SMEM((stages, SBp, 32), jnp.uint8),
             plgpu.SMEM((T, XR, 64), jnp.uint32)),
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=1)),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct((P, R), jnp.float32), grid=(ncta,), grid_names=("cta",),
        num_threads=compute_wgs + 1, thread_name="wg")(ids.astype(jnp.int32), w2, s2, x2)


def unpair(xq):
    """u32 [T, G, 20] pair layout (moe.f16_pairs) -> float64 [T, G * 32], the true activations in input
    order (pair word 4k + q holds inputs 8q + 3 - k and 8q + 7 - k times 2^14 / factor)."""
    xq = np.asarray(xq)
    T, G, _ = xq.shape
    pw = xq[:, :, :16].astype(np.uint32)
    lo = (pw & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (pw >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    fac = xq[:, :, 16].astype(np.uint32).view(np.float32).astype(np.float64)[..., None] * 2.0 ** -14
    x = np.zeros((T, G, 32))
    m = np.arange(16)
    kk, q = m // 4, m % 4
    x[:, :, q * 8 + 3 - kk] = lo * fac
    x[:, :, q * 8 + 7 - kk] = hi * fac
    return x.reshape(T, G * 32)


def _variant(spec: str) -> dict:
    out = {}
    for part in filter(None, spec.split("/")):
        key, val = part.split("=")
        out[key] = bool(int(val)) if key == "compute" else int(val)
    return out


def main(argv):
    del argv
    E, I, H, k = 128, 2880, 2880, 4  # gpt-oss-120b
    R, G = 2 * I, H // 32
    keys = jax.random.split(jax.random.key(0), 4)
    s0 = mxfp4.random_scale_byte(H)
    wq = jax.random.bits(keys[0], (E, R, G, 16), jnp.uint8)
    sc = jax.random.randint(keys[1], (E, R, G), s0 - 1, s0 + 2).astype(jnp.uint8)
    bias = (0.02 * jax.random.normal(keys[2], (E, R))).astype(jnp.bfloat16)
    dwq = jax.random.bits(keys[3], (E, H, I // 32, 16), jnp.uint8)
    dsc = jax.random.randint(keys[1], (E, H, I // 32), s0 - 1, s0 + 2).astype(jnp.uint8)
    dbias = jnp.zeros((E, H), jnp.bfloat16)
    res = dict(timing.device_info(), experts=E, rows=R, groups=G, top_k=k)
    bw = timing.copy_bandwidth()
    res["copy_bandwidth_bytes_per_s"] = bw
    rng = np.random.default_rng(0)

    def draw(T):
        ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32))
        x = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (T, H), jnp.float32).astype(jnp.bfloat16)
        return ids, x

    def pairs(x):
        return moe.f16_pairs(x.astype(jnp.float32)).reshape(x.shape[0], G, 20)

    rows = []
    for T in map(int, FLAGS.tokens):
        ids, x = draw(T)
        out = np.asarray(jax.jit(functools.partial(fma_matvec, k=k))(wq, sc, pairs(x), ids.reshape(-1)), np.float64)
        xt, flat = unpair(pairs(x)), np.asarray(ids).reshape(-1)
        err = max(np.linalg.norm(out[p] - np.asarray(mxfp4.dequantize(wq[e], sc[e], jnp.float32), np.float64) @ xt[p // k])
                  / np.linalg.norm(np.asarray(mxfp4.dequantize(wq[e], sc[e], jnp.float32), np.float64) @ xt[p // k])
                  for p, e in enumerate(flat))
        sets = [draw(T) for _ in range(FLAGS.routings)]
        roof = np.mean([len(np.unique(np.asarray(i))) * R * G * 17 for i, _ in sets]) / bw
        triton = timing.profile_calls(
            lambda i, xx: moe.mxfp4_moe(xx, i, jnp.full(i.shape, 0.25, jnp.float32), wq, sc, bias, dwq, dsc, dbias,
                                        limit=7.0, alpha=1.702), sets)
        row = dict(T=T, rel_err_vs_float64=float(err), roofline_us=roof * 1e6,
                   triton_gate_up_us=sum(v for n, v in triton["kernels"].items() if "gate_up" in n) * 1e6,
                   triton_kernels_us={n: v * 1e6 for n, v in triton["kernels"].items()}, mosaic={})
        for spec in FLAGS.variants:
            prof = timing.profile_calls(
                lambda i, xx, v=_variant(spec): fma_matvec(wq, sc, pairs(xx), i.reshape(-1), k=k, **v), sets)
            t = sum(v for n, v in prof["kernels"].items() if "mosaic" in n)
            row["mosaic"][spec] = dict(kernel_us=t * 1e6, roofline_fraction=roof / t,
                                       kernels_us={n: v * 1e6 for n, v in prof["kernels"].items()})
        row["triton_roofline_fraction"] = roof * 1e6 / row["triton_gate_up_us"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    res["rows"] = rows
    res["notes"] = ("Device kernel time per call (profiler), median over back-to-back calls cycling "
                    f"{FLAGS.routings} routings. roofline_us: packed bytes (blocks + scale bytes) of the distinct "
                    "selected experts' gate_up rows over the copy bandwidth. compute=0: the TMA stream alone "
                    "(compute warpgroups only release slots). The Mosaic kernel's activation layout pad is an XLA "
                    "fusion outside the kernel time; triton_gate_up_us includes bias, SwiGLU and the pair layout.")
    if FLAGS.out:
        timing.write_json(FLAGS.out, res)


if __name__ == "__main__":
    app.run(main)
