"""Attention of Nq new query tokens over a committed KV-cache prefix plus the new tokens themselves.

One function serves decode (Nq = 1), tree verify (Nq = N nodes, packed ancestor mask) and chunked
prefill (Nq = chunk, causal). GPT-OSS semantics: attention sinks, optional sliding window on
positions, GQA (query head h reads kv head h // (Hq // Hkv)), float32 softmax.

`attention_reference` is the spec (plain jnp). `attention_pallas` is the GPU kernel (Pallas Triton
lowering; `interpret=True` runs it on CPU): GQA folded into the kernel rows, K/V read in place from
the [B, Hkv, S, D] cache, per-sequence lengths, split-K over the prefix with a log-sum-exp merge,
sliding layers reading only the keys inside the window. `rope_attention` is the same kernel fed by
the fused q/k/v projection: the bias, RoPE and the new tokens' cache write happen inside it
(`rope_attention_reference`: `rope_write_reference` then `attention_reference`). `attention` (the
model's entry point) runs the implementation `select.attention` names: the Mosaic GPU kernel of
attention_mosaic.py, this one, or the reference.

Figures (device time against the K/V roofline) and what was tried: docs/perf/attention.md.
"""

from __future__ import annotations

import dataclasses
import functools
import struct

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle3_jax.formats.packed_mask import unpack_mask
from eagle3_jax.pallas import attention_mosaic, select, util
from eagle3_jax.pallas.util import LOG2E, M_INIT, pow2


def attention_reference(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, *, window, scale,
                        ring: bool = False):
    """Plain-jnp attention; the semantics every kernel must match.

    q: [B, Nq, Hq, D] new queries (rotary applied); k, v: [B, Nq, Hkv, D] the new tokens' keys/values.
    k_cache, v_cache: [B, Hkv, S, D]; only committed positions [0, lengths[b]) are read, position p at
    slot p, or with `ring` (sliding layers, models/kv_cache.py) at slot p mod S, where a slot holds the
    last committed position of its residue. positions: [B, Nq] int32 positions of the new tokens (all
    >= lengths[b]).
    mask: uint32 [B, Nq, ceil(Nq/32)] packed "query i may see new token j" bits, or None for causal
    in token order (a prefill chunk). sinks: [Hq] logits of the virtual zero-value key, unscaled.
    window: None, or W > 0: key position p_j is visible to query position p_i iff p_i - W < p_j.
    Returns [B, Nq, Hq, D] in q.dtype.
    """
    B, Nq, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    f32 = jnp.float32
    qf = q.astype(f32).reshape(B, Nq, Hkv, G, D)
    pos = positions.astype(jnp.int32)

    if ring and window is None:
        raise ValueError("attention: a ring cache needs a sliding window")
    L = lengths.astype(jnp.int32)[:, None]
    slot = jnp.arange(S, dtype=jnp.int32)[None]
    key_pos = L - 1 - (L - 1 - slot) % S if ring else slot  # [B or 1, S]: the position each slot holds
    see_prefix = jnp.broadcast_to(((key_pos >= 0) & (key_pos < L))[:, None, :], (B, Nq, S))
    if mask is None:
        see_new = jnp.broadcast_to(jnp.tril(jnp.ones((Nq, Nq), bool)), (B, Nq, Nq))
    else:
        see_new = unpack_mask(mask, Nq)  # [B, Nq, Nq]
    if window is not None:
        see_prefix &= key_pos[:, None, :] > pos[:, :, None] - window
        see_new &= pos[:, None, :] > pos[:, :, None] - window

    neg = jnp.finfo(f32).min
    lp = jnp.einsum("bnhgd,bhsd->bhgns", qf, k_cache.astype(f32)) * scale
    ln = jnp.einsum("bnhgd,bmhd->bhgnm", qf, k.astype(f32)) * scale
    lp = jnp.where(see_prefix[:, None, None], lp, neg)
    ln = jnp.where(see_new[:, None, None], ln, neg)
    sink = sinks.astype(f32).reshape(1, Hkv, G, 1)
    m = jnp.maximum(jnp.maximum(lp.max(-1, initial=neg), ln.max(-1)), sink)[..., None]
    pp, pn = jnp.exp(lp - m), jnp.exp(ln - m)
    denom = pp.sum(-1) + pn.sum(-1) + jnp.exp(sink - m[..., 0])
    out = (jnp.einsum("bhgns,bhsd->bnhgd", pp, v_cache.astype(f32))
           + jnp.einsum("bhgnm,bmhd->bnhgd", pn, v.astype(f32)))
    out = out / jnp.moveaxis(denom, 3, 1)[..., None]
    return out.reshape(B, Nq, Hq, D).astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# Pallas (Triton lowering) kernel
# ----------------------------------------------------------------------------------------------
#
# Layout. One program handles one (row block, key split, batch * kv head). Its rows are the
# query group of that kv head folded with the query tokens: row r <-> (token r // G, head h*G + r % G),
# so K/V of the head are read once for all G * Nq rows (GQA folded into the rows). q is gathered and
# the output scattered straight from/to [B, Nq, Hq, D]; the cache [B, Hkv, S, D] is read in place.
# Keys: the committed prefix [lo, len) (lo > 0 only on sliding layers: the first slot inside the
# window of the block's earliest query, so sliding layers read <= W - 1 prefix keys whatever the
# prefix length), cut into `num_splits` contiguous ranges (split-K), then the Nq new tokens (in the
# last split only) under the packed mask / causal order. Online softmax in base 2, float32; the sink
# is the initial state of split 0 (m = sink, l = 1). With one split the program normalizes and writes
# the output; otherwise each split writes (acc, m, l) and a merge kernel (one kernel row per program)
# combines them with a log-sum-exp merge.

@dataclasses.dataclass(frozen=True)
class AttnConfig:
    """Static launch parameters of the attention kernel (see `attention_config`)."""
    block_rows: int      # RB: kernel rows (query tokens x group heads) per program, power of 2 >= 16
    block_k: int         # prefix keys per loop step
    block_new: int       # new-token keys per loop step
    num_splits: int      # split-K ranges over the prefix
    num_warps: int
    num_stages: int
    preload_new: bool    # load the (single block of) new tokens' K/V before the prefix loop


def attention_config(batch, nq, hq, hkv, head_dim, cache_len, window, *, num_sms: int = 132,
                     **overrides) -> AttnConfig:
    """Launch parameters; any field can be overridden by keyword.

    From sweeps of the launch parameters (each choice's figures in docs/perf/attention.md): 64-key
    blocks, 3 stages, 4 warps (8 for 128-row blocks, 2 where blocks of <= 32 rows stream >= 1024
    keys a program); as many splits as give about 2 programs per SM (4 for blocks of <= 32 rows while
    each split keeps >= 1024 keys), rounded down to a power of two (the merge pads the split count to
    one); the new tokens' K/V loaded before the prefix loop where that costs no occupancy (<= 2
    programs per SM); Nq=16 (128 rows) one 8-warp block; the split-K merge a kernel of its own.
    """
    G = hq // hkv
    R = nq * G
    RB = min(128, pow2(max(16, R)))
    n_rb = -(-R // RB)
    block_k = 64
    block_new = min(64, pow2(max(16, nq)))
    max_keys = cache_len if window is None else min(cache_len, window)
    programs = batch * hkv * n_rb
    want = 4 * num_sms // programs
    if RB > 32 or max_keys < 1024 * want:
        want = 2 * num_sms // programs
    num_splits = max(1, min(want, max_keys // (4 * block_k)))
    num_splits = 1 << (num_splits.bit_length() - 1)
    streaming = RB <= 32 and max_keys >= 1024 * num_splits  # long key ranges a program: 2 warps
    cfg = dict(block_rows=RB, block_k=block_k, block_new=block_new, num_splits=num_splits,
               num_warps=2 if streaming else 4 if RB <= 64 else 8, num_stages=3,
               preload_new=programs * num_splits <= 2 * num_sms)
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return AttnConfig(**cfg)


def _f32_hex(x: float) -> str:
    """A float32 immediate in PTX hex syntax (1.0 -> 0f3F800000)."""
    return f"0f{struct.unpack('<I', struct.pack('<f', x))[0]:08X}"


def _exp2_affine(sc, c, m, interpret):
    """p = exp2(sc * c - m[:, None]) in float32 for logits sc [R, K] (-inf where masked), a constant
    c > 0 and running maxima m [R]: one FFMA and one MUFU.EX2 a logit on GPU (ex2.approx.ftz; the
    default exp2 lowering adds a compare and two multiplies a logit for subnormal results)."""
    negm = jnp.broadcast_to(-m[:, None], sc.shape)
    if interpret:
        return jnp.exp2(sc * c + negm)
    asm = f"{{ .reg .f32 a; fma.rn.f32 a, $1, {_f32_hex(c)}, $2; ex2.approx.ftz.f32 $0, a; }}"
    (p,) = plgpu.elementwise_inline_asm(asm, args=[sc, negm], constraints="=r,r,r", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(sc.shape, jnp.float32)])
    return p


def _round_bf16(x):
    """f32 -> f32 holding the nearest bf16 (ties to even), in integer ops: XLA on CPUs (interpret mode)
    may drop a conversion pair f32 -> bf16 -> f32 whose result only feeds f32 math."""
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    u = (u + (0x7FFF + (jax.lax.shift_right_logical(u, jnp.uint32(16)) & 1))) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(u, jnp.float32)


def _attn_kernel(len_ref, pos_ref, *refs, Nq, G, Hkv, D, Dp, RB, BK, BKn, NS, window, scale, causal,
                 preload_new, interpret, rope, S, ring):
    """S: the caches' slots; ring: position p at slot p mod S (else at slot p).
    rope None: refs = (q, k, v, k_cache, v_cache, mask, sinks, *outs). rope (Hq, has_bias):
    refs = (qkv, bias, cos, sin, k_cache, v_cache, mask, sinks, k_cache out, v_cache out, *outs); q, k and
    v are formed from the fused projection as `rope_write_reference` forms them, and the programs of row
    block 0 in the last split write the new tokens' K/V to the caches."""
    f32 = jnp.float32
    if rope is None:
        q_ref, k_ref, v_ref, kc_ref, vc_ref, mask_ref, sinks_ref, *outs = refs
    else:
        qkv_ref, bias_ref, cos_ref, sin_ref, kc_ref, vc_ref, mask_ref, sinks_ref, kc_out, vc_out, *outs = refs
    rb, s, bh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b, h = bh // Hkv, bh % Hkv
    length = len_ref[b]
    c = scale * LOG2E

    r = rb * RB + jnp.arange(RB, dtype=jnp.int32)
    row_ok = r < Nq * G
    i_r = jnp.minimum(r // G, Nq - 1)   # clamped: safe to load
    i_st = jnp.where(row_ok, r // G, Nq)  # stores: padding rows point past the end (masked off)
    hq_r = h * G + r % G
    d = jnp.arange(Dp, dtype=jnp.int32)
    d_ok = d < D
    full_d = Dp == D

    def dmask(rows_ok):
        m = rows_ok[:, None] if full_d else rows_ok[:, None] & d_ok[None, :]
        return jnp.broadcast_to(m, (rows_ok.shape[0], Dp))

    if rope is not None:
        Hq, has_bias = rope
        half = D // 2
        partner = jnp.where(d < half, d + half, d - half)  # the other half of the NeoX rotation
        first_half = (d < half)[None, :]

        def projected(tok, col0, ok, rotate):
            """Rows tok [n] (clamped), columns col0 [n] + d of qkv (+ bias), rounded to bf16; rotate:
            then rotated by the rows' cos, sin (NeoX half split). f32 [n, Dp]."""
            m = dmask(ok)

            def biased(cols):
                x = plgpu.load(qkv_ref.at[b, tok[:, None], cols], mask=m, other=0).astype(f32)
                if has_bias:
                    x = x + plgpu.load(bias_ref.at[cols], mask=m, other=0).astype(f32)
                return _round_bf16(x)

            x = biased(col0[:, None] + d[None, :])
            if not rotate:
                return x
            xp = biased(col0[:, None] + partner[None, :])
            cs = (d % half)[None, :]
            c_ = plgpu.load(cos_ref.at[b, tok[:, None], cs], mask=m, other=0)
            s_ = plgpu.load(sin_ref.at[b, tok[:, None], cs], mask=m, other=0)
            return jnp.where(first_half, x * c_ - xp * s_, x * c_ + xp * s_)

        q = projected(i_r, hq_r * D, row_ok, True).astype(kc_ref.dtype)
    else:
        q = plgpu.load(q_ref.at[b, i_r[:, None], hq_r[:, None], d[None, :]], mask=dmask(row_ok), other=0)
    pos_r = plgpu.load(pos_ref.at[b, i_r])
    sink = plgpu.load(sinks_ref.at[hq_r]).astype(f32) * LOG2E

    first = s == 0
    m0 = jnp.where(first, sink, jnp.full((RB,), M_INIT, f32))
    l0 = jnp.where(first, jnp.ones((RB,), f32), jnp.zeros((RB,), f32))
    acc0 = jnp.zeros((RB, Dp), f32)

    def update(carry, kt, vt, vis):
        # m is in scaled base-2 units; the raw logits are scaled inside exp2's argument (one FFMA)
        m, l, acc = carry
        sc = jax.lax.dot_general(q, kt, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        if vis is not None:
            sc = jnp.where(vis, sc, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1) * c)
        alpha = jnp.exp2(m - m_new)
        p = _exp2_affine(sc, c, m_new, interpret)
        l = l * alpha + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(vt.dtype), vt, (((1,), (0,)), ((), ())), preferred_element_type=f32)
        return m_new, l, acc * alpha[:, None] + pv

    # --- the Nq new tokens (their keys are seen by the last split only)
    last = s == NS - 1

    def new_block(t, on):
        """K/V tiles and visibility of new-token block t; `on` False loads nothing, sees nothing."""
        js = t * BKn
        jj = js + jnp.arange(BKn, dtype=jnp.int32)
        j_ok = (jj < Nq) & on
        if causal:
            vis = (jj[None, :] <= i_r[:, None]) & j_ok[None, :]
        else:
            words = plgpu.load(mask_ref.at[b, i_r[:, None], (jnp.minimum(jj, Nq - 1) // 32)[None, :]])
            sh = (jj % 32).astype(jnp.uint32)[None, :]
            vis = ((jax.lax.shift_right_logical(words, sh) & 1) != 0) & j_ok[None, :]
        if window is not None:
            pos_j = plgpu.load(pos_ref.at[b, jnp.minimum(jj, Nq - 1)])
            vis = vis & (pos_j[None, :] > pos_r[:, None] - window)
        kt, vt = new_kv(js, on)
        return kt, vt, vis

    def new_kv(js, on):
        """K/V [BKn, Dp] of new tokens js .. js + BKn - 1 (zero past Nq; `on` False: nothing loaded)."""
        jj = js + jnp.arange(BKn, dtype=jnp.int32)
        j_ok = (jj < Nq) & on
        if rope is None:
            kt = plgpu.load(k_ref.at[b, pl.ds(js, BKn), h, pl.ds(0, Dp)], mask=dmask(j_ok), other=0)
            vt = plgpu.load(v_ref.at[b, pl.ds(js, BKn), h, pl.ds(0, Dp)], mask=dmask(j_ok), other=0)
            return kt, vt
        tok = jnp.minimum(jj, Nq - 1)
        first_col = jnp.zeros((BKn,), jnp.int32)  # + the head's first column of qkv
        kt = projected(tok, first_col + (Hq + h) * D, j_ok, True).astype(kc_ref.dtype)
        vt = projected(tok, first_col + (Hq + Hkv + h) * D, j_ok, False).astype(kc_ref.dtype)
        return kt, vt

    def write_new(js, kt, vt):
        """Cache slots of positions length + js .. of new tokens js .. js + BKn - 1 (the last split's
        row block 0 only; dense caches: slots at or past S are not written, the interpreter's caches
        have a spare slot S; rings: mod S)."""
        jj = js + jnp.arange(BKn, dtype=jnp.int32)
        if ring:  # masked rows point at the spare slot: the interpreter stores them too, unchanged
            ok = (jj < Nq) & (rb == 0) & last
            slot = jnp.where(ok, (length + jj) % S, S)
        else:
            slot = length + jj
            ok = (jj < Nq) & (slot < S) & (rb == 0) & last
            slot = jnp.minimum(slot, S)
        plgpu.store(kc_out.at[b, h, slot[:, None], d[None, :]], kt, mask=dmask(ok))
        plgpu.store(vc_out.at[b, h, slot[:, None], d[None, :]], vt, mask=dmask(ok))

    # --- committed prefix, split s of NS
    if window is None:
        lo = jnp.int32(0)
    else:
        minpos = jnp.min(jnp.where(row_ok, pos_r, jnp.iinfo(jnp.int32).max))
        lo = jnp.clip(minpos - window + 1, 0, length)
    n = length - lo
    chunk = ((n + NS - 1) // NS + BK - 1) // BK * BK
    start = lo + s * chunk
    end = jnp.minimum(start + chunk, length)
    nkeys = jnp.maximum(end - start, 0)
    nfull = nkeys // BK  # full blocks: no load masks (and no key masks on full layers)
    nblk = (nkeys + BK - 1) // BK

    def prefix_step(t, carry, masked):
        ks = start + t * BK
        kk = ks + jnp.arange(BK, dtype=jnp.int32)
        if ring:  # keys are positions; a block of them may wrap around the ring: gathered rows
            k_ok = kk < end if masked else jnp.ones((BK,), jnp.bool_)
            slots = (kk % S)[:, None]
            if masked or not full_d:
                kt = plgpu.load(kc_ref.at[b, h, slots, d[None, :]], mask=dmask(k_ok), other=0)
                vt = plgpu.load(vc_ref.at[b, h, slots, d[None, :]], mask=dmask(k_ok), other=0)
            else:
                kt = plgpu.load(kc_ref.at[b, h, slots, d[None, :]])
                vt = plgpu.load(vc_ref.at[b, h, slots, d[None, :]])
            vis = k_ok[None, :] if masked else None
        elif masked:
            k_ok = kk < end
            kt = plgpu.load(kc_ref.at[b, h, pl.ds(ks, BK), pl.ds(0, Dp)], mask=dmask(k_ok), other=0)
            vt = plgpu.load(vc_ref.at[b, h, pl.ds(ks, BK), pl.ds(0, Dp)], mask=dmask(k_ok), other=0)
            vis = k_ok[None, :]
        elif full_d:
            kt = plgpu.load(kc_ref.at[b, h, pl.ds(ks, BK), pl.ds(0, Dp)])
            vt = plgpu.load(vc_ref.at[b, h, pl.ds(ks, BK), pl.ds(0, Dp)])
            vis = None
        else:
            ones = jnp.ones((BK,), jnp.bool_)
            kt = plgpu.load(kc_ref.at[b, h, pl.ds(ks, BK), pl.ds(0, Dp)], mask=dmask(ones), other=0)
            vt = plgpu.load(vc_ref.at[b, h, pl.ds(ks, BK), pl.ds(0, Dp)], mask=dmask(ones), other=0)
            vis = None
        if window is not None:
            inw = kk[None, :] > pos_r[:, None] - window
            vis = inw if vis is None else vis & inw
        return update(carry, kt, vt, vis)

    # --- the prefix loop, then the new tokens. With `preload` and one block of new tokens (Nq <= BKn),
    # that block's loads are issued before the prefix loop, so that their latency hides behind it.
    preload = preload_new and Nq <= BKn
    if preload:
        first_new = new_block(0, last)
    carry = jax.lax.fori_loop(0, nfull, functools.partial(prefix_step, masked=False), (m0, l0, acc0))
    carry = jax.lax.fori_loop(nfull, nblk, functools.partial(prefix_step, masked=True), carry)
    if preload:  # (a no-op in the other splits: nothing visible)
        m, l, acc = update(carry, *first_new)
        if rope is not None:
            write_new(0, *first_new[:2])
    else:
        if causal:
            jmax = jnp.minimum(jnp.max(jnp.where(row_ok, i_r, 0)) + 1, Nq)
        else:
            jmax = jnp.int32(Nq)
        nnew = jnp.where(last, (jmax + BKn - 1) // BKn, 0)

        def new_step(t, carry):
            kt, vt, vis = new_block(t, True)
            if causal and window is not None:  # long causal chunks on sliding layers: skip blocks outside the window
                any_vis = jnp.max(jnp.where(vis, 1, 0)) > 0
                return jax.lax.cond(any_vis, lambda c_: update(c_, kt, vt, vis), lambda c_: c_, carry)
            return update(carry, kt, vt, vis)

        m, l, acc = jax.lax.fori_loop(0, nnew, new_step, carry)
        if rope is not None:  # every new token's K/V to the cache (the loop above may stop early)
            n_write = jnp.where(last & (rb == 0), (jnp.int32(Nq) + BKn - 1) // BKn, jnp.int32(0))
            jax.lax.fori_loop(jnp.int32(0), n_write,
                              lambda t, c_: (write_new(t * BKn, *new_kv(t * BKn, True)), c_)[1], jnp.int32(0))

    if NS == 1:
        (out_ref,) = outs
        o = acc / l[:, None]
        plgpu.store(out_ref.at[b, i_st[:, None], hq_r[:, None], d[None, :]], o.astype(out_ref.dtype),
                    mask=dmask(row_ok))
        return
    o_ref, m_ref, l_ref = outs
    plgpu.store(o_ref.at[bh, rb, s, pl.ds(0, RB), pl.ds(0, Dp)], acc)
    plgpu.store(m_ref.at[bh, rb, s, pl.ds(0, RB)], m)
    plgpu.store(l_ref.at[bh, rb, s, pl.ds(0, RB)], l)


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, G, Hkv, D, Dp, RB, NS, NSp):
    """Split-K merge of one kernel row (query token x group head) per program: all its splits in one
    [NSp, Dp] tile, weights exp2(m_s - max m), out = sum_s w_s acc_s / sum_s w_s l_s."""
    r, bh = pl.program_id(0), pl.program_id(1)
    b, h = bh // Hkv, bh % Hkv
    rb, rr = r // RB, r % RB
    sp = jnp.arange(NSp, dtype=jnp.int32)
    s_ok = sp < NS
    s_c = jnp.minimum(sp, NS - 1)
    d = jnp.arange(Dp, dtype=jnp.int32)
    m = jnp.where(s_ok, plgpu.load(m_ref.at[bh, rb, s_c, rr]), M_INIT)
    lv = jnp.where(s_ok, plgpu.load(l_ref.at[bh, rb, s_c, rr]), 0.0)
    o = plgpu.load(o_ref.at[bh, rb, s_c[:, None], rr, d[None, :]])
    w = jnp.where(s_ok, jnp.exp2(m - jnp.max(m)), 0.0)
    row = jnp.sum(w[:, None] * o, axis=0) / jnp.sum(w * lv)
    at = lambda x: jnp.full((Dp,), x, jnp.int32)  # noqa: E731
    plgpu.store(out_ref.at[b, at(r // G), at(h * G + r % G), d], row.astype(out_ref.dtype), mask=d < D)


def attention_pallas(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, *, window, scale,
                     ring: bool = False, config: AttnConfig | None = None, interpret: bool = False, **overrides):
    """The Pallas kernel behind `attention` (same contract as `attention_reference`).

    `config` (or keyword overrides of its fields) fixes the launch; default: `attention_config`.
    """
    B, Nq, Hq, D = q.shape
    return _launch((q, k, v), None, k_cache, v_cache, lengths, positions, mask, sinks, B=B, Nq=Nq, Hq=Hq, D=D,
                   S=k_cache.shape[2], ring=ring, dtype=q.dtype, window=window, scale=scale, config=config,
                   interpret=interpret, overrides=overrides)


def rope_attention(qkv, bias, cos, sin, k_cache, v_cache, lengths, positions, mask, sinks, *, num_heads: int,
                   num_kv_heads: int, window, scale, ring: bool = False, config: AttnConfig | None = None,
                   interpret: bool = False, **overrides):
    """Attention's prologue and `attention_pallas` in one kernel: the fused projection qkv [B, T, (Hq + 2 Hkv) D]
    bf16 (before its bias [(Hq + 2 Hkv) D] or None), cos, sin f32 [B, T, D / 2] -> (out [B, T, Hq, D],
    k_cache, v_cache with the new tokens' K/V written at positions lengths .. lengths + T - 1, in place).
    q and the new K/V are formed in the kernel as `rope_write_reference` forms them (bias, NeoX RoPE);
    dense caches: slots at or past the cache's end are not written; a ring (`ring`, T <= S - window:
    the writes land outside every query's window) takes them mod S. The model's cached steps on GPUs (one launch less
    per layer than a separate prologue kernel)."""
    B, T, N = qkv.shape
    Hq, Hkv = num_heads, num_kv_heads
    D = N // (Hq + 2 * Hkv)
    S = k_cache.shape[2]
    if (N != (Hq + 2 * Hkv) * D or D % 2 or k_cache.shape != (B, Hkv, S, D) or v_cache.shape != k_cache.shape
            or cos.shape != (B, T, D // 2) or sin.shape != cos.shape or (bias is not None and bias.shape != (N,))):
        raise ValueError(f"rope_attention: qkv {qkv.shape} for {Hq} + 2 x {Hkv} heads, bias "
                         f"{None if bias is None else bias.shape}, cos {cos.shape}, sin {sin.shape} (expected "
                         f"{(B, T, D // 2)}), caches {k_cache.shape} / {v_cache.shape} (expected (B, {Hkv}, S, {D}))")
    if qkv.dtype != jnp.bfloat16 or k_cache.dtype != jnp.bfloat16:
        raise ValueError(f"rope_attention: qkv and the caches must be bfloat16, got {qkv.dtype}, {k_cache.dtype}")
    has_bias = bias is not None
    b_in = bias if has_bias else jnp.zeros((1,), qkv.dtype)
    kc, vc = k_cache, v_cache
    Dp = pow2(max(16, D))
    if interpret:  # the interpreter touches no index past an array's end, even masked: pad them
        qkv = jnp.pad(qkv, ((0, 0), (0, 0), (0, Dp - D)))
        b_in = jnp.pad(b_in, (0, N + Dp - D - b_in.shape[0]))
        kc, vc = (jnp.pad(c, ((0, 0), (0, 0), (0, 1), (0, Dp - D))) for c in (k_cache, v_cache))
    srcs = (qkv, b_in, cos.astype(jnp.float32), sin.astype(jnp.float32))
    if ring and (window is None or T > S - window):
        raise ValueError(f"rope_attention: a ring of {S} slots with window {window} takes at most "
                         f"{None if window is None else S - window} new tokens a call, got {T}")
    out, kc, vc = _launch(srcs, (Hq, has_bias), kc, vc, lengths, positions, mask, sinks, B=B, Nq=T, Hq=Hq,
                          D=D, S=S, ring=ring, dtype=qkv.dtype, window=window, scale=scale, config=config,
                          interpret=interpret, overrides=overrides)
    if interpret:
        kc, vc = kc[:, :, :S, :D], vc[:, :, :S, :D]
    return out, kc, vc


def rope_attention_reference(qkv, bias, cos, sin, k_cache, v_cache, lengths, positions, mask, sinks, *,
                             num_heads: int, num_kv_heads: int, window, scale, ring: bool = False):
    """Plain-jnp `rope_attention`: `rope_write_reference`, then `attention_reference`."""
    q, k, v, k_cache, v_cache = rope_write_reference(qkv, bias, cos, sin, k_cache, v_cache, lengths,
                                                     num_heads=num_heads, num_kv_heads=num_kv_heads, ring=ring)
    out = attention_reference(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, window=window, scale=scale,
                              ring=ring)
    return out, k_cache, v_cache


def rope_write_reference(qkv, bias, cos, sin, k_cache, v_cache, lengths, *, num_heads: int, num_kv_heads: int,
                         ring: bool = False):
    """q/k/v of the fused projection and the cache write, as `rope_attention` forms them: q and k
    (qkv + bias) rounded to qkv.dtype, then the NeoX half-split rotation (x1 c - x2 s, x2 c + x1 s) in
    f32, rounded; v qkv + bias, rounded; k and v written at slots lengths .. lengths + T - 1 (slots past
    the cache's end dropped; `ring`: mod S). -> (q [B, T, Hq, D], k, v [B, T, Hkv, D], k_cache, v_cache)."""
    B, T, N = qkv.shape
    Hq, Hkv = num_heads, num_kv_heads
    D = N // (Hq + 2 * Hkv)
    x = qkv if bias is None else qkv + bias
    # XLA may keep the biased values in f32 inside a fusion (excess precision); the kernel rounds them
    x = jax.lax.reduce_precision(x.astype(jnp.float32), jnp.finfo(qkv.dtype).nexp, jnp.finfo(qkv.dtype).nmant)
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
    slots = slots % S if ring else jnp.where(slots < S, slots, S)
    k_cache = k_cache.at[bi, :, slots].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[bi, :, slots].set(v.astype(v_cache.dtype), mode="drop")
    return qk[:, :, :Hq], k, v, k_cache, v_cache


def _launch(srcs, rope, k_cache, v_cache, lengths, positions, mask, sinks, *, B, Nq, Hq, D, S, ring, dtype, window,
            scale, config, interpret, overrides):
    """Both entry points' launch: srcs (q, k, v) or, with rope, (qkv, bias, cos, sin) -> out [B, Nq, Hq, D]
    (with rope: and the two caches, written in place)."""
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    if ring and window is None:
        raise ValueError("attention: a ring cache needs a sliding window")
    if config is None:
        config = attention_config(B, Nq, Hq, Hkv, D, S, window, num_sms=132 if interpret else util.num_sms(),
                                  **overrides)
    RB, NS = config.block_rows, config.num_splits
    Dp = pow2(max(16, D))
    R = Nq * G
    n_rb = -(-R // RB)
    causal = mask is None
    if causal:
        mask_arg = jnp.zeros((1, 1, 1), jnp.uint32)
    else:
        mask_arg = mask.astype(jnp.uint32)
    lengths = lengths.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    if not scale > 0:
        raise ValueError(f"attention: scale must be positive, got {scale}")
    kern = functools.partial(_attn_kernel, Nq=Nq, G=G, Hkv=Hkv, D=D, Dp=Dp, RB=RB, BK=config.block_k,
                             BKn=config.block_new, NS=NS, window=window, scale=float(scale), causal=causal,
                             preload_new=config.preload_new, interpret=interpret, rope=rope, S=S, ring=ring)
    params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    out_final = jax.ShapeDtypeStruct((B, Nq, Hq, D), dtype)
    if NS == 1:
        out_shape = (out_final,)
    else:
        f32 = jnp.float32
        out_shape = (jax.ShapeDtypeStruct((B * Hkv, n_rb, NS, RB, Dp), f32),
                     jax.ShapeDtypeStruct((B * Hkv, n_rb, NS, RB), f32),
                     jax.ShapeDtypeStruct((B * Hkv, n_rb, NS, RB), f32))
    caches, aliases = (), {}
    if rope is not None:  # the caches (inputs 2 + len(srcs), + 1) are outputs 0 and 1, in place
        caches = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                  jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
        aliases = {2 + len(srcs): 0, 3 + len(srcs): 1}
    res = pl.pallas_call(kern, out_shape=caches + out_shape, grid=(n_rb, NS, B * Hkv), compiler_params=params,
                         input_output_aliases=aliases, interpret=interpret, name="tree_attention")(
        lengths, positions, *srcs, k_cache, v_cache, mask_arg, sinks)
    caches, res = res[:len(caches)], res[len(caches):]
    if NS == 1:
        (out,) = res
    else:
        merge = functools.partial(_merge_kernel, G=G, Hkv=Hkv, D=D, Dp=Dp, RB=RB, NS=NS, NSp=pow2(NS))
        out = pl.pallas_call(merge, out_shape=out_final, grid=(R, B * Hkv), interpret=interpret,
                             compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
                             name="tree_attention_merge")(*res)
    return (out, *caches) if rope is not None else out


def attention(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks, *, window, scale, ring: bool = False,
              policy: select.KernelPolicy = select.AUTO):
    """The model's single attention entry point (same contract as `attention_reference`): the
    implementation `select.attention` names for these shapes on this platform. The Mosaic GPU kernel
    (attention_mosaic.py) for full layers with long caches and several query tokens on a GPU, else the
    Pallas (Triton) kernel on a GPU; the jnp reference elsewhere and for cache-free full-sequence
    passes (`forward`, training: the reference is differentiable, the kernels are not)."""
    impl = select.attention(q, k_cache, window, ring=ring, policy=policy)
    if impl == "mosaic":
        return attention_mosaic.attention_mosaic(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks,
                                                 window=window, scale=scale, interpret=policy.interpret)
    if impl == "triton":
        return attention_pallas(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks,
                                window=window, scale=scale, ring=ring, interpret=policy.interpret)
    return attention_reference(q, k, v, k_cache, v_cache, lengths, positions, mask, sinks,
                               window=window, scale=scale, ring=ring)
