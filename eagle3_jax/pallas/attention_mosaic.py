"""Attention over a long committed prefix as a warp-specialized Mosaic GPU kernel (Hopper), plus a
Pallas (Triton) kernel that adds the sink and the Nq new tokens and merges the splits.

`attention_mosaic(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, *, window, scale)` has the
contract of `attention.attention_reference` for full (window None) layers. Two launches:

  1. prefix (`_prefix_call`), grid (splits, B * Hkv), one block per multiprocessor: a memory warpgroup
     streams the split's K/V blocks of `block_k` keys from the cache (viewed as [B * Hkv * S, D], read
     in place) into a shared-memory ring (TMA, `stages` slots); two compute warpgroups run Q K^T and
     P V on the tensor cores (wgmma) with an online base-2 softmax in f32 (P rounded to bf16 for P V).
     The kv head's query rows (row r is token r // G, head h * G + r % G) are row groups of 64. One row
     group (Nq * G <= 64): the two warpgroups take alternate key blocks and write separate partials; two
     row groups (<= 128 rows): each takes one over every block, and they take turns on the tensor cores
     (a schedule barrier, as in JAX's FlashAttention-3 example). Output: unnormalized partials (acc f32
     [.., D], running max m and sum l, m in units of `scale * log2(e)`) per (split, key phase).
  2. finish (`_finish_kernel`), grid (Nq * G, B * Hkv), one query row a program (one warp): the row's
     partials, its sink and the Nq new tokens under the packed mask (or causal) merged by their maxima,
     normalized, stored as [B, Nq, Hq, D] in q.dtype.

`select.attention` says when `attention.attention` takes this kernel (full layers, caches of at least
`select.MOSAIC_MIN_CACHE` slots, Nq >= 2). `prefix_reference` is the jnp function of the prefix kernel;
with interpret=True the partials come from it and the finish kernel runs in the Pallas interpreter.

Figures against the Triton kernel, what was tried, and where it stops: docs/perf/attention.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as tgpu

from eagle3_jax.pallas import util
from eagle3_jax.pallas.util import LOG2E, M_INIT, pow2

F32 = jnp.float32
ROWS = 64  # rows of one compute warpgroup's wgmma tile
_SMEM_BYTES = 227 * 1024  # shared memory a block may use (Hopper)
LW = 8  # columns of the running row sums a thread keeps apart (one WGMMA column tile)


def _tree(parts, op):
    """op over parts, pairwise (a shallow dependency chain)."""
    while len(parts) > 1:
        parts = [op(parts[i], parts[i + 1]) if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def _prefix_call(q, k_cache, v_cache, lengths, *, scale, splits, block_k, stages, rg, kp, probe=None):
    """q bf16 [B, Nq, Hq, D], caches [B, Hkv, S, D] -> partials (acc f32 [B * Hkv, splits * kp, rg * 64, D],
    m f32 [B * Hkv, splits * kp, rg * 64], l likewise); row r of kv head h is token r // G, head h * G + r % G.
    probe (measurement only, the partials are then meaningless; experiments/attention_floor.py): "stream"
    leaves out the math (the compute warpgroups only release the slots), "compute" the copies (the memory
    warpgroup arrives on the slots' barriers without filling them)."""
    if probe not in (None, "stream", "compute"):
        raise ValueError(f"_prefix_call: probe {probe!r}, expected None, 'stream' or 'compute'")
    B, Nq, Hq, D = q.shape
    _, Hkv, S, _ = k_cache.shape
    G = Hq // Hkv
    BH, Rp, tpw = B * Hkv, rg * ROWS, ROWS // G  # tpw: tokens a row group
    cw = rg * kp
    dtype = q.dtype
    c = float(scale) * LOG2E
    NP = splits * kp
    max_blocks = pl.cdiv(pl.cdiv(S, splits), block_k)  # blocks of the longest split
    # the tokens whose G rows ([G, D] of q) warpgroup w copies: its row group's; padding rows stay unset
    toks = [[t for t in range(w % rg * tpw, (w % rg + 1) * tpw) if t < Nq] for w in range(cw)]

    def body(len_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, scoped):
        (q_smem, k_smem, v_smem, o_smem, ml_smem), (k_bar, v_bar), q_bars, (k_free, v_free), sched = scoped
        # both compute warpgroups on every block: take turns on the tensor cores
        pingpong = rg == 2 and probe != "stream"

        def schedule():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        s, bh, wg = lax.axis_index("split"), lax.axis_index("bh"), lax.axis_index("wg")
        b, h = bh // Hkv, bh % Hkv
        length = len_ref[b]
        chunk = (length + splits - 1) // splits
        chunk = (chunk + block_k - 1) // block_k * block_k
        start = s * chunk
        end = jnp.minimum(start + chunk, length)
        nblk = (jnp.maximum(end - start, 0) + block_k - 1) // block_k

        @pl.when(wg < cw)
        def _compute():
            r, ph = wg % rg, wg // rg  # row group, key phase
            qs = q_smem.at[wg]
            for w in range(cw):
                bar = q_bars[w] if q_bars[w].shape == () else q_bars[w].at[0]  # one barrier: a scalar ref in JAX 0.11

                @pl.when(wg == w)
                def _():
                    for t in toks[w]:
                        plgpu.copy_gmem_to_smem(q_ref.at[(b * Nq + t) * Hkv + h],
                                                q_smem.at[w, pl.ds((t % tpw) * G, G)], bar)
                    plgpu.barrier_wait(bar)
            m_i = plgpu.layout_cast(jnp.full((ROWS,), M_INIT, F32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.zeros((ROWS, LW), F32), plgpu.Layout.WGMMA)  # row sums, LW apart
            acc = plgpu.layout_cast(jnp.zeros((ROWS, D), F32), plgpu.Layout.WGMMA)
            n_mine = jnp.maximum(nblk - ph + kp - 1, 0) // kp

            def step(j, carry, masked):
                acc, m_i, l_i = carry
                i = ph + j * kp
                slot = i % stages
                if probe == "stream":
                    for bar, free in ((k_bar, k_free), (v_bar, v_free)):
                        plgpu.barrier_wait(bar.at[slot])
                        plgpu.barrier_arrive(free.at[slot])
                    return carry
                plgpu.barrier_wait(k_bar.at[slot])

                def qk_of(ref):
                    plgpu.wgmma(ref, qs, k_smem.at[slot].transpose((1, 0)))
                    if pingpong:
                        schedule()
                    return ref[...]

                qk = pl.run_scoped(qk_of, plgpu.ACC((ROWS, block_k), F32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    kv = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_k), 1, layout=plgpu.Layout.WGMMA)
                    qk = jnp.where(kv + (start + i * block_k) < end, qk, -jnp.inf)
                m_new = jnp.maximum(m_i, qk.max(axis=1) * c)
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_new, qk.shape, [0]))
                # each thread keeps its own partial row sums (no shuffles until the end)
                part = _tree([p[:, o:o + LW] for o in range(0, block_k, LW)], jnp.add)
                l_i = l_i * lax.broadcast_in_dim(alpha, l_i.shape, [0]) + part
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                if pingpong:  # the other warpgroup's softmax runs while this one's P V runs
                    plgpu.barrier_arrive(sched)
                    plgpu.barrier_wait(v_bar.at[slot])
                    plgpu.barrier_wait(sched)
                else:
                    plgpu.barrier_wait(v_bar.at[slot])

                def pv(ref):
                    plgpu.wgmma(ref, p16, v_smem.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            full = jnp.maximum(end - start, 0) // block_k  # blocks with no key past `end`
            n_full = jnp.minimum(jnp.maximum(full - ph + kp - 1, 0) // kp, n_mine)
            if pingpong:
                pl.when(wg == 1)(schedule)
            carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), (acc, m_i, l_i))
            acc, m_i, l_i = lax.fori_loop(n_full, n_mine, functools.partial(step, masked=True), carry)
            if pingpong:
                pl.when(wg == 0)(schedule)

            o_smem.at[wg][...] = acc
            ml_smem.at[wg, 0][...] = m_i
            ml_smem.at[wg, 1][...] = l_i.sum(axis=1)
            plgpu.commit_smem()
            sp = s * kp + ph
            plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[bh, sp, pl.ds(r * ROWS, ROWS)])
            plgpu.copy_smem_to_gmem(ml_smem.at[wg, 0], m_ref.at[bh, sp, pl.ds(r * ROWS, ROWS)])
            plgpu.copy_smem_to_gmem(ml_smem.at[wg, 1], l_ref.at[bh, sp, pl.ds(r * ROWS, ROWS)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == cw)
        def _memory():
            def fill(src, dst, bar):
                if probe == "compute":
                    plgpu.barrier_arrive(bar)
                else:
                    plgpu.copy_gmem_to_smem(src, dst, bar)

            @pl.loop(0, max_blocks)
            def _(i):
                @pl.when(i < nblk)
                def _():
                    slot = i % stages

                    @pl.when(i >= stages)
                    def _():
                        plgpu.barrier_wait(k_free.at[slot])

                    at = pl.ds(bh * S + start + i * block_k, block_k)  # rows of the flat [B * Hkv * S, D] cache
                    fill(k_ref.at[at], k_smem.at[slot], k_bar.at[slot])

                    @pl.when(i >= stages)
                    def _():
                        plgpu.barrier_wait(v_free.at[slot])

                    fill(v_ref.at[at], v_smem.at[slot], v_bar.at[slot])

    def attention_prefix(*refs):  # the profile's kernel name
        tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scoped: body(*refs, scoped),
            (plgpu.SMEM((cw, ROWS, D), dtype, transforms=tiles),
             plgpu.SMEM((stages, block_k, D), dtype, transforms=tiles),
             plgpu.SMEM((stages, block_k, D), dtype, transforms=tiles),
             plgpu.SMEM((cw, ROWS, D), F32), plgpu.SMEM((cw, 2, ROWS), F32)),
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
            tuple(plgpu.Barrier(num_arrivals=len(t)) for t in toks),
            (plgpu.Barrier(num_arrivals=rg, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=cw),
            collective_axes="wg")

    return plgpu.kernel(
        attention_prefix,
        out_type=(jax.ShapeDtypeStruct((BH, NP, Rp, D), F32), jax.ShapeDtypeStruct((BH, NP, Rp), F32),
                  jax.ShapeDtypeStruct((BH, NP, Rp), F32)),
        grid=(splits, BH), grid_names=("split", "bh"), num_threads=cw + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(lengths, q.reshape(B * Nq * Hkv, G, D), k_cache.reshape(B * Hkv * S, D), v_cache.reshape(B * Hkv * S, D))


def _finish_kernel(q_ref, k_ref, v_ref, mask_ref, sinks_ref, o_ref, m_ref, l_ref, out_ref, *, Nq, G, Hkv, D,
                   NP, NPp, BKn, c, causal):
    """One query row r = (token r // G, group head r % G) of kv head h a program: its NP partials, its
    sink and the new tokens (BKn >= Nq keys, one tile) merged by their maxima;
    out = (sum_s w_s acc_s + sum_j p_j v_j) / (sum_s w_s l_s + w_sink + sum_j p_j). Rows of D (64 or
    128) elements: whole, unmasked vector loads."""
    r, bh = pl.program_id(0), pl.program_id(1)
    b, h = bh // Hkv, bh % Hkv
    t, hq = r // G, h * G + r % G
    sp = jnp.arange(NPp, dtype=jnp.int32)
    s_ok = sp < NP
    s_c = jnp.minimum(sp, NP - 1)
    d = jnp.arange(D, dtype=jnp.int32)
    j = jnp.arange(BKn, dtype=jnp.int32)
    jc = jnp.minimum(j, Nq - 1)
    # every load first
    m = tgpu.load(m_ref.at[bh, s_c, r])  # [NPp]
    lv = tgpu.load(l_ref.at[bh, s_c, r])
    o = tgpu.load(o_ref.at[bh, s_c[:, None], r, d[None, :]])  # [NPp, D]
    sink = tgpu.load(sinks_ref.at[pl.ds(hq, 1)]).astype(F32) * LOG2E  # [1]
    q = tgpu.load(q_ref.at[b, t, hq, pl.ds(0, D)]).astype(F32)  # [D]
    kt = tgpu.load(k_ref.at[b, jc[:, None], h, d[None, :]]).astype(F32)  # [BKn, D]
    vt = tgpu.load(v_ref.at[b, jc[:, None], h, d[None, :]]).astype(F32)
    if causal:
        vis = j <= t
    else:
        words = tgpu.load(mask_ref.at[b, t, jc // 32])  # [BKn]
        vis = (lax.shift_right_logical(words, (jc % 32).astype(jnp.uint32)) & 1) != 0
    lg = jnp.where(vis & (j < Nq), jnp.sum(q[None, :] * kt, axis=1) * c, -jnp.inf)  # [BKn]

    m = jnp.where(s_ok, m, M_INIT)
    top = jnp.maximum(jnp.maximum(jnp.max(m), jnp.max(sink)), jnp.max(lg))
    w = jnp.where(s_ok, jnp.exp2(m - top), 0.0)
    pn = jnp.exp2(lg - top)  # new tokens (0 where not visible)
    den = jnp.sum(w * lv) + jnp.sum(jnp.exp2(sink - top)) + jnp.sum(pn)
    num = jnp.sum(w[:, None] * o, axis=0) + jnp.sum(pn[:, None] * vt, axis=0)  # [D]
    tgpu.store(out_ref.at[b, t, hq, pl.ds(0, D)], (num / den).astype(out_ref.dtype))


def prefix_reference(q, k_cache, v_cache, lengths, *, scale, splits, block_k, rg, kp, stages=None):
    """Plain-jnp `_prefix_call`: the same partials (key j < lengths[b] of split s = j // chunk, block
    i = (j - s * chunk) // block_k, partial s * kp + i % kp; chunk = the split's keys rounded up to
    whole blocks), f32 throughout. Padding rows (r >= Nq * G) are zero. stages (the ring's depth) does not
    change them."""
    del stages
    B, Nq, Hq, D = q.shape
    _, Hkv, S, _ = k_cache.shape
    G, Rp, NP = Hq // Hkv, rg * ROWS, splits * kp
    c = float(scale) * LOG2E
    qr = q.astype(F32).reshape(B, Nq, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, Nq * G, D)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, Rp - Nq * G), (0, 0)))
    lg = jnp.einsum("bhrd,bhsd->bhrs", qr, k_cache.astype(F32)) * c
    chunk = (-(-lengths // splits) + block_k - 1) // block_k * block_k  # [B]
    j = jnp.arange(S)
    split = j[None, :] // jnp.maximum(chunk, 1)[:, None]
    part = split * kp + (j[None, :] - split * chunk[:, None]) // block_k % kp  # [B, S]
    mine = (part[:, None, :] == jnp.arange(NP)[None, :, None]) & (j[None, None, :] < lengths[:, None, None])
    mine = mine[:, None, :, None, :]  # [B, 1, NP, 1, S]
    lgp = jnp.where(mine, lg[:, :, None], -jnp.inf)  # [B, Hkv, NP, Rp, S]
    m = jnp.maximum(jnp.max(lgp, axis=-1), M_INIT)
    p = jnp.exp2(lgp - m[..., None])
    acc = jnp.einsum("bhprs,bhsd->bhprd", p, v_cache.astype(F32))
    flat = lambda x: x.reshape((B * Hkv,) + x.shape[2:])  # noqa: E731
    return flat(acc), flat(m), flat(jnp.sum(p, axis=-1))


def mosaic_fits(q, k_cache, window) -> bool:
    """Whether `attention_mosaic` takes these shapes: full layers, bf16, D in {64, 128}, at most 128
    query rows a kv head, group size G = Hq / Hkv in {8, 16, 32, 64} (a token's G rows are whole 8-row
    tiles), cache length a multiple of 8 (TMA tiling of the flat cache)."""
    B, Nq, Hq, D = q.shape
    _, Hkv, S, _ = k_cache.shape
    return (window is None and q.dtype == jnp.bfloat16 and k_cache.dtype == jnp.bfloat16 and D in (64, 128)
            and Hkv > 0 and Hq % Hkv == 0 and (Hq // Hkv) % 8 == 0 and ROWS % (Hq // Hkv) == 0
            and Nq * (Hq // Hkv) <= 2 * ROWS and S % 8 == 0)


def launch_config(q, k_cache, *, splits=None, block_k=None, stages=None, interpret=False) -> dict:
    """The prefix kernel's launch for these shapes (`attention_mosaic`'s defaults where None): splits, block_k,
    stages, rg (64-row groups) and kp (key phases). Raises ValueError for a block_k, stages pair that does not
    fit."""
    _, Nq, Hq, D = q.shape
    B, Hkv = k_cache.shape[:2]
    rg = -(-Nq * (Hq // Hkv) // ROWS)
    kp = 2 // rg  # key phases: two compute warpgroups either way
    block_k = block_k or (128 if D == 64 else 64)
    smem = lambda st: (2 * st * block_k + 2 * ROWS) * D * 2 + 2 * ROWS * (D + 2) * 4 + 4096  # noqa: E731 (+ reductions)
    if stages is None:  # up to 256 keys in the ring, as many slots as fit, whole key phases
        fits = [st for st in range(kp, 256 // block_k + 1, kp) if smem(st) <= _SMEM_BYTES]
        stages = fits[-1] if fits else kp
    if block_k not in (64, 128) or stages < 2 or stages % kp:
        raise ValueError(f"attention_mosaic: block_k {block_k} (64 or 128), stages {stages} (>= 2, a multiple of "
                         f"the key phases, {kp})")
    if smem(stages) > _SMEM_BYTES:
        raise ValueError(f"attention_mosaic: {stages} stages of {block_k} keys need {smem(stages)} bytes of shared "
                         f"memory, {_SMEM_BYTES} available")
    if splits is None:
        splits = max(1, (132 if interpret else util.num_sms()) // (B * Hkv))
    return dict(splits=splits, block_k=block_k, stages=stages, rg=rg, kp=kp)


@functools.partial(jax.jit, static_argnames=("window", "scale", "splits", "block_k", "stages", "interpret"))
def attention_mosaic(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, *, window, scale,
                     splits: int | None = None, block_k: int | None = None, stages: int | None = None,
                     interpret: bool = False):
    """`attention.attention_reference`'s contract for full layers (window None) on Hopper GPUs: q [B, Nq, Hq, D]
    bf16, k, v [B, Nq, Hkv, D], caches [B, Hkv, S, D] bf16 (read in place), lengths [B], positions [B, Nq]
    (unused: full layers see every committed key), mask uint32 [B, Nq, ceil(Nq/32)] or None (causal),
    sinks [Hq] -> [B, Nq, Hq, D]. splits: key ranges a kv head (default: one block per multiprocessor);
    block_k: keys a ring slot (64 or 128; default 128 for D=64, else 64); stages: ring slots (default: as
    many as fit, up to 256 keys; a multiple of the key phases: 2 where Nq * Hq / Hkv <= 64, else 1)."""
    del positions
    B, Nq, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv if Hkv else 0
    if not mosaic_fits(q, k_cache, window) or k_cache.shape != (B, Hkv, S, D) or v_cache.shape != k_cache.shape \
            or k.shape != (B, Nq, Hkv, D) or v.shape != k.shape or sinks.shape != (Hq,) or lengths.shape != (B,):
        raise ValueError(f"attention_mosaic: q {q.shape} {q.dtype}, k {k.shape}, v {v.shape}, caches "
                         f"{k_cache.shape} {k_cache.dtype}, sinks {sinks.shape}, lengths {lengths.shape}, window "
                         f"{window}: needs full layers (window None), bf16, D in (64, 128), Hq / Hkv in (8, 16, 32, "
                         f"64), Nq * Hq / Hkv <= {2 * ROWS}, S a multiple of 8")
    if not scale > 0:
        raise ValueError(f"attention_mosaic: scale must be positive, got {scale}")
    launch = launch_config(q, k_cache, splits=splits, block_k=block_k, stages=stages, interpret=interpret)
    part = prefix_reference if interpret else _prefix_call
    o_p, m_p, l_p = part(q, k_cache, v_cache, lengths.astype(jnp.int32), scale=scale, **launch)
    R, NP = Nq * G, launch["splits"] * launch["kp"]
    causal = mask is None
    mask_arg = jnp.zeros((1, 1, 1), jnp.uint32) if causal else mask.astype(jnp.uint32)
    kern = functools.partial(_finish_kernel, Nq=Nq, G=G, Hkv=Hkv, D=D, NP=NP, NPp=pow2(NP),
                             BKn=pow2(max(16, Nq)), c=float(scale) * LOG2E, causal=causal)
    return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((B, Nq, Hq, D), q.dtype), grid=(R, B * Hkv),
                          compiler_params=tgpu.CompilerParams(num_warps=1, num_stages=1),
                          interpret=interpret, name="attention_finish")(q, k, v, mask_arg, sinks, o_p, m_p, l_p)
