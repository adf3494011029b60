"""The MXFP4 MoE of a few tokens as one warp-specialized Mosaic GPU kernel (GPU only): gate_up,
clamped SwiGLU, down and the weighted combine, with the dependency of down on gate_up resolved between
blocks by counters in GMEM instead of a second launch.

`moe_fma(ids, weights, xq, <gate_up experts>, <down experts>)` computes what `moe.mxfp4_moe`'s FMA path
computes for up to MAX_PAIRS (token, expert) pairs: out[t] = sum over t's pairs p of weights[p] *
(W2_e act_p + b2_e), act_p = SwiGLU(W1_e x_t + b1_e) rounded to x's dtype (same arithmetic: the f16x2
PTX of `moe._group_dot_asm`, activations in the `moe.f16_pairs` layout).

Structure. The work is a list of units of 16 weight rows of one pair's expert: the gate_up units of
every pair (pair-major), then the down units (pair-major). Block c of the grid (one per
multiprocessor, all resident) takes units c, c + ncta, ... One memory warpgroup streams each unit's
blocks and scale bytes (contiguous spans of the HF layout) by TMA into an S-slot SMEM ring; the compute
warpgroups take the units in turn. The tokens' activations are copied to SMEM once.
- gate_up unit: a compute thread owns one of the unit's rows and every 8th scale group: 16 bytes of
  weights and its scale byte from SMEM, the group's 16 pair words and factor, the f16x2 PTX, a 3-step
  shuffle sum over the row's 8 threads; gate and linear rows (adjacent) meet by one more shuffle, the
  unit's 8 act values go through SMEM so that four threads write the block's pair words of act (GMEM
  scratch, one factor a weight word) and one its factor; each of the four then releases the pair's
  counter (a zeroed GMEM semaphore; proxy fence first: TMA reads act).
- down unit: the same row sums over the pair's act (in SMEM), plus bias, times the routing weight,
  added into out with f32 atomics. Before a block's first down unit of pair p, its memory warpgroup
  (after issuing that unit's weights) waits for p's counter to reach 4 x the pair's gate_up units plus
  one release per block (each block zeroes its share of out first), then copies p's act to SMEM.

Measured on an H200, JAX 0.11.2 (device kernel time, one gpt-oss-120b layer, 4 random routings; the
roofline of T=1 is 13.2 us; experiments/results/moe_mosaic_fused_h200.json): T=1 25.19 us, T=2 42.91 us,
against the two Triton kernels' 14.89 + 10.35 and 27.48 + 17.29 us in the same run. End to end (B=1
decode, experiments/results/moe_e2e_mosaic_h200.json) the experts took 0.896 ms a token plus 0.032 ms
for the fills of the zeroed counters, against 0.905 ms on the Triton kernels: no gain, so
`MoeConfig.mosaic_pairs` is 0 by default.

What the time is made of. The kernel's own time stamps (`timeline=True`, experiments/moe_mosaic_timeline.py;
T=1, 3 compute warpgroups, 6 slots: experiments/results/moe_mosaic_timeline_h200.json): span 22.9-24.6 us
= a compute warpgroup's first data after 4.8-5.6 us (every block requests its whole ring at once: 19
MB ahead of its first unit) + per compute warpgroup 8.2-8.6 us computing gate_up units (2.2-2.4 us a
unit: three warpgroups share the SM's issue) and 2.9 us down units (1.6 us a unit) + about 4.5 us
more waiting for data + 2-3 us of blocks and warpgroups finishing apart. Other shapes
(moe_mosaic_timeline_sweep_h200.json): 1 warpgroup / 4 slots 31.6 us (1.33 us a gate_up unit, 20.9 us
computing, 9.1 waiting), 1 / 7 35.3, 2 / 4 24.3, 3 / 3 24.5. So at T=1 the compute warpgroups are
busy about half the span: what to attack next is the start (the first unit of each block should land
first) and the waits in between, then the integer work of the decode. Tried and not kept (T=1): issuing
two units and waiting for the first before the rest of the ring, 24.45 against 24.87 us; the counter
polled with a 0.5 us sleep, 24.81 against 24.88; each gate_up unit's counter released one unit later
(its fence then waits on nothing), 26.2 against 24.8 (act ready later); the ring in half units (a unit's
K range in two TMA boxes, each half slot freed when consumed; branch half-slots), 28.3 us with 12 half
slots and 26.2 with 6, against 25.1: compute per unit rose from 2.3 to 2.6 us and the waits for data
stayed at 8.0 us a warpgroup, so the waits are not for free slots.
Variants of this kernel (the same file as the sweep): the compute alone (every TMA copy replaced by an
arrive) 19.5 us; the stream alone (units skipped, the counters kept) 18.2 us; both 25.1 us:
- compute: about 12 integer instructions a weight word decode MXFP4 (shifts, masks, byte permutes) and
  the integer pipe issues at half rate, so the decode alone needs about 10 us at T=1; 2 compute
  warpgroups give 20.7 us, 1 gives 27.2, 4 give 22.7 (issue-bound, not latency-bound). Loads at a
  per-thread 32-bit shared address plus immediates (no index arithmetic) took it from 20.3 to 19.4 us.
- stream: 1.4x the roofline; its ramp, and the last pair's down units, whose act is complete only when
  every block finished that pair's gate_up units (the memory warpgroup waits on the counter there).
Compute warpgroups / ring slots: 3/6 24.9, 3/3 25.2, 2/4 25.8-26.0, 2/6 27.8, 2/2 28.8, 4/4 27.2 us. A
grid-wide barrier instead of the per-pair counters (all act copied over the activations' SMEM, 16
pairs) took 26.5 us. The same structure for gate_up alone: its matvec 12.1 us (71% of the roofline),
its TMA stream 10.0 us (86%), the Triton gate_up 15.1 us (experiments/results/moe_mosaic_probe_h200.json).
Two launches instead (branch mosaic-split, session 25: gate_up and its epilogue, then down in units of
(token, 16 output rows) summing the token's k pairs' tiles in order and storing once, so no zeroing,
atomics or counters; each compute warpgroup its own ring slots) were correct (rel err <= 1.7e-3) and
slower at T=1: gate_up 15.4 + down 14.7 us (2 compute warpgroups, 2 / 3 slots each), 15.9 + 16.1 (2 x 3
/ 1 x 6), against the Triton kernels' 14.7 + 10.0 in the same run: the gate_up epilogue (bias loads,
one SMEM exchange and barrier a unit) costs about 3 us over the bare matvec above, and a down unit's
k tiles in turn on one warpgroup leave 90 blocks with two serial units each.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref

from eagle3_jax.pallas import moe
from eagle3_jax.pallas.attention import num_sms

ROWS = 16  # weight rows per unit (gate_up: 8 act columns, one block of the pair layout)
LANES = 8  # threads per row: thread t of a warpgroup owns row t // 8 and scale groups t % 8, t % 8 + 8, ...
WG = 128  # threads per warpgroup
X_ROWS = 256  # 32-byte rows per copy of the activations (a TMA box holds at most 256)
ACT_ROW = 80  # u32 words per row of act (GMEM scratch and SMEM): four 20-word groups
MAX_PAIRS = moe.MOSAIC_MAX_PAIRS  # (token, expert) pairs: all pairs' act stays in SMEM beside the activations and the ring
_LOG2E = 1.4426950408889634


def _c(v, ty):
    return arith.constant(ty, v)


def _asm(ty, args, text, cons):
    return llvm.inline_asm(ty, list(args), text, cons)


def _index():
    idx = ir.IndexType.get()
    tid = arith.remui(gpu.thread_id(gpu.Dimension.x), _c(WG, idx))
    return tid, arith.divui(tid, _c(LANES, idx)), arith.remui(tid, _c(LANES, idx))


def _group_asm(per_word, w_off, x_off, s_off):
    """PTX: $0 = one scale group's dot product, scaled: loads from shared memory at 32-bit addresses
    $1 + w_off (the row's 16 weight bytes), $2 + x_off (the group's 20 activation words: 16 pair words,
    then one factor, or per_word four) and $3 + s_off (its scale byte), then `moe._group_dot_asm`
    (sums in f16x2, one a group or per_word one a weight word), times the factor(s) and 2^(s - 127)."""
    nf = 4 if per_word else 1
    body = moe._group_dot_asm(1, per_word=per_word)
    names = [f"s{q}" for q in range(nf)] + [f"w{q}" for q in range(4)] + [f"x{i}" for i in range(16)]
    body = re.sub(r"\$(\d+)", lambda m: names[int(m.group(1))], body)
    regs = ", ".join(names[nf:])
    lines = ["{", f".reg .b32 {regs}, sc, f{', f'.join(map(str, range(nf)))};",
             f".reg .f32 {', '.join(names[:nf])}, t, fs;",
             f"ld.shared.v4.b32 {{w0, w1, w2, w3}}, [$1+{w_off}];"]
    lines += [f"ld.shared.v4.b32 {{x{4 * q}, x{4 * q + 1}, x{4 * q + 2}, x{4 * q + 3}}}, [$2+{x_off + 16 * q}];"
              for q in range(4)]
    lines.append(f"ld.shared.v4.b32 {{f0, f1, f2, f3}}, [$2+{x_off + 64}];" if per_word
                 else f"ld.shared.b32 f0, [$2+{x_off + 64}];")
    lines += [f"ld.shared.u8 sc, [$3+{s_off}];", body]
    lines.append("mov.b32 t, f0;")
    lines.append("mul.f32 t, s0, t;")
    for q in range(1, nf):
        lines += [f"mov.b32 fs, f{q};", f"fma.rn.f32 t, s{q}, fs, t;"]
    lines += ["shl.b32 sc, sc, 23;", "mov.b32 fs, sc;", "mul.f32 $0, t, fs;", "}"]  # 2^(s - 127) (0 for s = 0)
    return "\n".join(lines)


def _row_sum(w_ref, s_ref, x_ref, *, G, per_word):
    """This thread's row's dot product, summed over the row's 8 threads (every one holds it). w_ref u8
    (SMEM, the unit's blocks: row-major [16, G, 16] from its start), s_ref u8 (SMEM, its scale bytes
    [16, G]), x_ref u32 (SMEM, the activations' pair layout: group g's 20 words at byte 80 g). Every
    address is a per-thread 32-bit base plus an immediate: no address arithmetic in the group loop."""
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    _, r, lane = _index()
    r, lane = arith.index_cast(i32, r), arith.index_cast(i32, lane)

    def addr(ref, *terms):  # the ref's shared-memory address plus sum of (value, factor) terms, i32
        a = llvm.ptrtoint(i32, mu.memref_ptr(ref))
        for v, f in terms:
            a = arith.addi(a, arith.muli(v, _c(f, i32)))
        return a

    acc = _c(0.0, f32)
    for j in range(-(-G // LANES)):
        if LANES * (j + 1) <= G:  # every lane's group valid: one base a thread, immediates a group
            if j == 0:
                wa = addr(w_ref, (r, G * 16), (lane, 16))
                xa, sa = addr(x_ref, (lane, 80)), addr(s_ref, (r, G), (lane, 1))
            offs, bases, valid = (LANES * 16 * j, LANES * 80 * j, LANES * j), (wa, xa, sa), None
        else:  # the last, partial step: lanes past G read group G - 1 and add nothing
            g = arith.addi(lane, _c(LANES * j, i32))
            valid = arith.cmpi(arith.CmpIPredicate.ult, g, _c(G, i32))
            g = arith.minui(g, _c(G - 1, i32))
            offs = (0, 0, 0)
            bases = (addr(w_ref, (r, G * 16), (g, 16)), addr(x_ref, (g, 80)), addr(s_ref, (r, G), (g, 1)))
        term = _asm(f32, bases, _group_asm(per_word, *offs), "=f,r,r,r")
        acc = arith.addf(acc, term if valid is None else arith.select(valid, term, _c(0.0, f32)))
    for d in (1, 2, 4):
        acc = arith.addf(acc, mu.shfl_bfly(acc, d))
    return acc


def _gate_up_unit(ctx, w_ref, s_ref, x_ref, b_ref, ex_ref, a_ref, sem_ref, *, G, limit, alpha, dtype):
    """One gate_up unit on one compute warpgroup: `_row_sum`'s refs (x: the token's, rows of 8 words),
    b_ref [16] (the rows' biases, GMEM, loaded before the dot products), ex_ref f32 [8] (SMEM scratch,
    alternate units of a warpgroup alternate two of them: one barrier a unit), a_ref u32 [17] (GMEM:
    the block's pair words at 0, 4, 8, 12 and its factor at 16), sem_ref: the pair's counter, which
    each of the 4 writing threads releases by 1 after its stores."""
    del ctx
    i32, f32, idx = ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.IndexType.get()
    tid, r, lane = _index()
    even_r = arith.muli(arith.divui(r, _c(2, idx)), _c(2, idx))
    b_gate = arith.extf(f32, memref.load(b_ref, [even_r]))
    b_lin = arith.extf(f32, memref.load(b_ref, [arith.addi(even_r, _c(1, idx))]))
    acc = _row_sum(w_ref, s_ref, x_ref, G=G, per_word=False)
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
        _release(sem_ref)


def _down_unit(ctx, w_ref, s_ref, x_ref, b_ref, wt_ref, o_ref, *, G):
    """One down unit on one compute warpgroup: `_row_sum`'s refs (x: the pair's act, rows of ACT_ROW
    words, one factor a weight word), b_ref [16] (the rows' biases, GMEM), wt_ref f32 [1] (the pair's
    routing weight, GMEM), o_ref f32 [16] (GMEM: the token's outputs of these rows, added to atomically)."""
    del ctx
    i32, f32, idx = ir.IntegerType.get_signless(32), ir.F32Type.get(), ir.IndexType.get()
    _, r, lane = _index()
    b = arith.extf(f32, memref.load(b_ref, [r]))  # loaded before the dot products
    wt = memref.load(wt_ref, [_c(0, idx)])
    acc = _row_sum(w_ref, s_ref, x_ref, G=G, per_word=True)
    with mu.when(arith.cmpi(arith.CmpIPredicate.eq, lane, _c(0, idx))):
        ptr = mu.getelementptr(mu.memref_ptr(o_ref), [arith.index_cast(i32, r)], f32)
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [ptr, arith.mulf(arith.addf(acc, b), wt)],
                        "red.relaxed.gpu.add.f32 [$0], $1;", "l,f", has_side_effects=True)


def _zero(ctx, o_ref, sem_ref, *, n, ncta):
    """Block c's share of o_ref f32 [n] (GMEM) set to 0 by one warpgroup, then every counter of
    sem_ref [P] released by 1 (the down units add into out only after all blocks' zeros)."""
    del ctx
    idx, f32 = ir.IndexType.get(), ir.F32Type.get()
    per = -(-n // ncta)
    tid, _, _ = _index()
    base = arith.muli(gpu.block_id(gpu.Dimension.x), _c(per, idx))
    for j in range(-(-per // WG)):
        i = arith.addi(tid, _c(WG * j, idx))
        pos = arith.addi(base, i)
        ok = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, i, _c(per, idx)),
                        arith.cmpi(arith.CmpIPredicate.ult, pos, _c(n, idx)))
        with mu.when(ok):
            memref.store(_c(0.0, f32), o_ref, [pos])
    mu.warpgroup_barrier()
    with mu.when(arith.cmpi(arith.CmpIPredicate.eq, tid, _c(0, idx))):
        for p in range(ir.MemRefType(sem_ref.type).shape[0]):
            _release(mu.memref_slice(sem_ref, p))


def _release(sem_ref):
    """This thread's earlier stores made visible to the TMA copies of any block (async proxy), then
    the counter at sem_ref (GMEM, i32) incremented with release semantics at GPU scope."""
    _proxy_fence(None)
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [mu.memref_ptr(sem_ref), _c(1, ir.IntegerType.get_signless(32))],
                    "red.release.gpu.global.add.u32 [$0], $1;", "l,r", has_side_effects=True)


def _proxy_fence(ctx):
    """Orders this thread's earlier generic-proxy accesses before its later async-proxy ones."""
    del ctx
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global;", "", has_side_effects=True)


def _stamp(ctx, ref):
    """Thread 0 of the warpgroup stores the low 32 bits of %globaltimer (ns) at ref [1] (GMEM)."""
    del ctx
    i32, idx = ir.IntegerType.get_signless(32), ir.IndexType.get()
    tid, _, _ = _index()
    t = llvm.inline_asm(i32, [], "mov.u32 $0, %globaltimer_lo;", "=r", has_side_effects=True)
    with mu.when(arith.cmpi(arith.CmpIPredicate.eq, tid, _c(0, idx))):
        memref.store(t, ref, [_c(0, idx)])


_SMEM_BYTES = 227 * 1024 - 1024  # the H100 / H200 limit of a block, less the barriers


@functools.partial(jax.jit, static_argnames=("k", "limit", "alpha", "dtype", "stages", "compute_wgs", "num_ctas",
                                             "timeline"))
def moe_fma(ids, weights, xq, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias, *,
            k: int, limit: float, alpha: float, dtype, stages: int | None = None, compute_wgs: int = 3,
            num_ctas: int | None = None, timeline: bool = False):
    """ids int32 [P], weights f32 [P] (pair p: token p // k, P <= MAX_PAIRS), xq u32 [T, G1, 5, 4]
    (`moe.f16_pairs`), the packed experts (HF layout: gate_up [E, 2I, G1, 16] rows interleaved gate,
    linear; down [E, H, G2, 16]) -> out f32 [T, H]. stages: ring slots (a multiple of compute_wgs;
    default the most that fit in SMEM, at most 2 compute_wgs); num_ctas: blocks (at most one a
    multiprocessor: all must be resident, blocks wait on each other's act; default the device's count).

    timeline: also return stamps u32 [ncta, compute_wgs + 1, S + 1, 2] (S: steps a block), the low bits
    of %globaltimer (ns) at: [c, w, S, 0] warpgroup w's start (w = compute_wgs: the memory one); for a
    compute warpgroup and each step i it runs, [c, w, i, 0] its unit's data in SMEM (and for a pair's
    first down unit its act), [c, w, i, 1] the unit done; for the memory warpgroup [c, w, i, 0] step i's
    copies about to be issued (its slot free), [c, w, i, 1] after a pair's act copy was issued (first
    down step of the pair). Other entries are unwritten. experiments/moe_mosaic_timeline.py reads them."""
    E, R1, G1, _ = gate_up_blocks.shape
    _, R2, G2, _ = down_blocks.shape
    T, P = xq.shape[0], ids.shape[0]
    H = G1 * moe.BLOCK
    cw = compute_wgs
    WB, SB1, SB2 = max(G1, G2), G1 // 2, G2 // 2  # a unit: G 256-byte rows of blocks, G/2 32-byte rows of scales
    SBp1, SBp2 = -(-SB1 // 4) * 4, -(-SB2 // 4) * 4  # whole 128-byte lines (past the array's end: zeros)
    XT = G1 * 20 // 8  # 32-byte rows of one token's activations
    xr = T * XT
    nx = -(-xr // X_ROWS)
    AR = -(-G2 // 8) * 2  # ACT_ROW-word rows of a pair's act (an even count: copies of whole 128-byte lines)
    fixed = nx * X_ROWS * 32 + P * AR * ACT_ROW * 4 + cw * 2 * 8 * 4
    slot = WB * 256 + max(SBp1, SBp2) * 32
    if stages is None:
        stages = min(2 * cw, (_SMEM_BYTES - fixed) // slot // cw * cw)
    if (P > MAX_PAIRS or R1 % ROWS or R2 % ROWS or G1 % 2 or G2 % 2 or R2 != H or R1 != 2 * G2 * moe.BLOCK
            or cw < 1 or stages < cw or stages % cw or fixed + stages * slot > _SMEM_BYTES):
        raise ValueError(f"moe_fma: pairs {P} (<= {MAX_PAIRS}), gate_up {gate_up_blocks.shape}, down "
                         f"{down_blocks.shape}, stages {stages}, compute_wgs {cw} do not fit (SMEM: "
                         f"{fixed + stages * slot} bytes of {_SMEM_BYTES})")
    up1, up2 = R1 // ROWS, R2 // ROWS  # units an expert
    U1 = P * up1
    U = U1 + P * up2
    ncta = min(num_ctas or num_sms(), U)
    steps = -(-U // ncta)
    ready = 4 * up1 + ncta  # a pair's counter once its act is complete and every block zeroed its share of out

    def body(ids_ref, wt_ref, x_ref, w1_ref, s1_ref, b1_ref, w2_ref, s2_ref, b2_ref, o_ref, a_ref, *rest):
        *stamps, ((w_smem, s_smem, x_smem, act_smem, ex_smem), (w_bar, s_bar, x_bar, a_bar, consumed)) = rest

        def stamp(w, i, e):
            if timeline:
                plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))(_stamp)(stamps[0].at[cta, w, i, pl.ds(e, 1)])

        sem = pl.get_global(plgpu.SemaphoreType.REGULAR((P,)))
        cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
        n_valid = (U - cta + ncta - 1) // ncta  # this block's steps with a unit

        def unit_of(i):  # (down unit?, pair, 16-row block of the expert, the block's first step of the pair)
            u = cta + i * ncta
            down = u >= U1
            v = jnp.where(down, u - U1, u)
            up = jnp.where(down, up2, up1)
            p = v // up
            first = jnp.maximum(jnp.where(down, U1, 0) + p * up - cta + ncta - 1, 0) // ncta
            return down, p, v % up, first

        @pl.when(wg < cw)
        def _compute():
            stamp(wg, steps, 0)
            @pl.when(wg == 0)
            def _():
                plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 2)(functools.partial(_zero, n=T * H, ncta=ncta))(
                    o_ref, sem)

            for c in range(nx):
                plgpu.barrier_wait(x_bar.at[c])

            @pl.loop(0, steps)
            def _(i):
                @pl.when(i < n_valid)
                def _():
                    down, p, rb, first = unit_of(i)

                    @pl.when(down & (i == first))
                    def _():
                        plgpu.barrier_wait(a_bar.at[p])

                    @pl.when(i % cw == wg)
                    def _():
                        slot = i % stages
                        e = ids_ref[p]
                        plgpu.barrier_wait(w_bar.at[slot])
                        plgpu.barrier_wait(s_bar.at[slot])
                        stamp(wg, i, 0)

                        @pl.when(~down)
                        def _():
                            a_row = a_ref.at[p, rb // 16, pl.ds(20 * (rb // 4 % 4) + rb % 4, 17)]
                            plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 7)(functools.partial(
                                _gate_up_unit, G=G1, limit=limit, alpha=alpha, dtype=dtype))(
                                w_smem.at[slot], s_smem.at[slot], x_smem.at[pl.ds((p // k) * XT, XT)],
                                b1_ref.at[pl.ds(e * R1 + rb * ROWS, ROWS)], ex_smem.at[wg, i // cw % 2], a_row,
                                sem.at[pl.ds(p, 1)])

                        @pl.when(down)
                        def _():
                            plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 6)(functools.partial(_down_unit, G=G2))(
                                w_smem.at[slot], s_smem.at[slot], act_smem.at[p],
                                b2_ref.at[pl.ds(e * R2 + rb * ROWS, ROWS)], wt_ref.at[pl.ds(p, 1)],
                                o_ref.at[pl.ds((p // k) * H + rb * ROWS, ROWS)])

                        stamp(wg, i, 1)
                        plgpu.barrier_arrive(consumed.at[slot])

        @pl.when(wg == cw)
        def _memory():
            stamp(cw, steps, 0)
            for c in range(nx):
                rows = min(X_ROWS, -(-(xr - c * X_ROWS) // 4) * 4)  # whole 128-byte lines
                # a traced start: a static one is bounds-checked, and the last copy may read past the
                # array's end (TMA fills zeros)
                start = cta * 0 + c * X_ROWS
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(start, rows)], x_smem.at[pl.ds(c * X_ROWS, rows)], x_bar.at[c])

            @pl.loop(0, steps)
            def _(i):
                @pl.when(i < n_valid)
                def _():
                    slot = i % stages
                    down, p, rb, first = unit_of(i)
                    e = ids_ref[p]

                    @pl.when(i >= stages)
                    def _():
                        plgpu.barrier_wait(consumed.at[slot])

                    stamp(cw, i, 0)

                    for is_down, w_ref, s_ref, up, G, SB, SBp in ((False, w1_ref, s1_ref, up1, G1, SB1, SBp1),
                                                                 (True, w2_ref, s2_ref, up2, G2, SB2, SBp2)):
                        @pl.when(down == is_down)
                        def _():
                            u = e * up + rb
                            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(u * G, G)], w_smem.at[slot, pl.ds(0, G)],
                                                    w_bar.at[slot])
                            plgpu.copy_gmem_to_smem(s_ref.at[pl.ds(u * SB, SBp)], s_smem.at[slot, pl.ds(0, SBp)],
                                                    s_bar.at[slot])

                    @pl.when(down & (i == first))  # the pair's act, once complete (after the unit's weights)
                    def _():
                        plgpu.semaphore_wait(sem.at[p], ready, decrement=False, memory_scope="gpu")
                        plgpu.inline_mgpu()(_proxy_fence)()
                        plgpu.copy_gmem_to_smem(a_ref.at[p], act_smem.at[p], a_bar.at[p])
                        stamp(cw, i, 1)

    def mxfp4_moe_mosaic(*refs):  # the profile's kernel name
        pl.run_scoped(
            lambda *scoped: body(*refs, scoped),
            (plgpu.SMEM((stages, WB, 256), jnp.uint8), plgpu.SMEM((stages, max(SBp1, SBp2), 32), jnp.uint8),
             plgpu.SMEM((nx * X_ROWS, 8), jnp.uint32), plgpu.SMEM((P, AR, ACT_ROW), jnp.uint32),
             plgpu.SMEM((cw, 2, 8), jnp.float32)),
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=nx),
             plgpu.Barrier(num_barriers=P), plgpu.Barrier(num_arrivals=1, num_barriers=stages)),
            collective_axes="wg")

    out, _, *stamps = plgpu.kernel(
        mxfp4_moe_mosaic,
        out_type=(jax.ShapeDtypeStruct((T * H,), jnp.float32), jax.ShapeDtypeStruct((P, AR, ACT_ROW), jnp.uint32))
        + ((jax.ShapeDtypeStruct((ncta, cw + 1, steps + 1, 2), jnp.uint32),) if timeline else ()),
        grid=(ncta,), grid_names=("cta",), num_threads=cw + 1, thread_name="wg",
    )(ids.astype(jnp.int32), weights.astype(jnp.float32), xq.reshape(xr, 8),
      gate_up_blocks.reshape(E * up1 * G1, 256), gate_up_scales.reshape(E * up1 * SB1, 32), gate_up_bias.reshape(-1),
      down_blocks.reshape(E * up2 * G2, 256), down_scales.reshape(E * up2 * SB2, 32), down_bias.reshape(-1))
    return (out.reshape(T, H), *stamps) if timeline else out.reshape(T, H)
