"""MXFP4 expert matmul for few tokens (decode, verify) and for tiles of many (prefill), the experts
kept packed as the HF checkpoint stores them (`eagle3_jax.formats.mxfp4`; rows are outputs):

  gate_up_blocks u8 [E, 2I, H/32, 16], gate_up_scales u8 [E, 2I, H/32], gate_up_bias [E, 2I]
  down_blocks    u8 [E, H, I/32, 16],  down_scales    u8 [E, H, I/32],  down_bias    [E, H]

`mxfp4_moe(x, ids, weights, <experts>)`: for T <= MAX_TOKENS tokens routed to k experts each, f32
`out[t] = sum_j weights[t, j] * FFN_{ids[t, j]}(x[t])`, `FFN_e(x) = W2_e act(W1_e x + b1_e) + b2_e`,
`act` the clamped, interleaved SwiGLU. Two Pallas (Triton) kernels per path: gate_up + SwiGLU, then
down + the weighted combine (f32 atomics into out, which kernel 1 zeroes). The FMA path (experts of
at most `MoeConfig.fma_tokens` tokens: by default all) runs one pass per (token, expert) pair on the
CUDA cores: each weight word decoded in registers to f16x2 E2M1 * 2^-14 and multiplied by inline PTX
(`_group_dot_asm`) with the token's activations in the f16 pair layout (`f16_pairs`: one power-of-two
factor per 32-input group, |x'| < 2^14, values below 2^-24 of the group's maximum flushed;
`moe_route.route` writes it with the routing); each group's 32 products are summed in f16 (at most 96
in magnitude), then in f32, times 2^(scale - 127) and the group's factor. The MMA
path (experts of more tokens) runs 16-token chunks on the tensor cores, the weights decoded to bf16
times 2^-32 (exact for scale bytes 35..160). The interpreter decodes through f16 with f32 products.

`mxfp4_moe_grouped`: the tokens grouped by expert into tiles of 16-256 rows (`gpt_oss.MoE._grouped`),
every tile at once, the MMA path's decode and tensor-core products. `mxfp4_moe_reference` is the
plain-jnp function of `mxfp4_moe`'s signature; CPU tests run the kernels with interpret=True.

A device's share of every expert (tensor parallel) launches with `config_for(units)`. Figures (device
time against the HBM roofline), what was tried, and the variants removed: docs/perf/moe.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle3_jax.formats.mxfp4 import BLOCK, dequantize, pow2_f32, scale_exp2
from eagle3_jax.pallas import util
from eagle3_jax.pallas.lowering import inline_asm_multi

F32 = jnp.float32
TOKEN_TILE = 16  # rows of one MMA tile of tokens
MAX_TOKENS = 64
_SHIFT = 32  # the kernels' weights are the true weights times 2^-_SHIFT (keeps scale bytes up to 160 finite)
_UNSCALE = float(2.0 ** _SHIFT)
_MASK = np.int32(np.uint32(0x81C00000).view(np.int32))  # f32 sign | exponent bits 0-1 | mantissa bit 22
_MASK16 = np.int32(np.uint32(0x8E000000).view(np.int32))  # the same fields of an f16 in the top half


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Launch parameters of both paths (see the module docstring; the defaults are the fastest of the
    launches measured on whole experts, docs/perf/moe.md; `config_for` picks a device's share's).

    FMA path: fma_tokens: an expert chosen by at most this many tokens takes it (0 turns it off);
    fma_block_i: act columns per gate_up program (8, 16 or 32: 8-column blocks of the pair layout),
    fma_block_h: down outputs per program, fma_warps: warps per program, fma_groups: 32-input scale
    groups per K step of gate_up (power of 2), fma_down_groups: down's (None: fma_groups),
    fma_prefetch: K steps whose loads are issued ahead of the math (0: each step's loads at its
    start, so no loaded tile is held across steps).

    MMA path: block_i: SwiGLU outputs per gate_up program (it reads 2*block_i rows); block_h: outputs
    per down program; groups: scale groups per K step (power of 2); num_warps, num_stages: Triton's;
    decode: "bits" (f32 integer ops; needs subnormal f32 multiplies), "ptx" (bf16x2 inline PTX) or
    "f16" (through f16 conversions); "ptx" also runs the FMA path in f16x2 inline PTX, the others run
    it in jnp (f16 decode, f32 products); the interpreter always uses "f16" (XLA:CPU flushes
    subnormals). prefetch: K steps loaded ahead (>= 1)."""

    block_i: int = 32
    block_h: int = 32
    groups: int = 4
    num_warps: int = 4
    num_stages: int = 3
    decode: str = "ptx"
    prefetch: int = 2
    fma_tokens: int = MAX_TOKENS
    fma_groups: int = 32
    fma_down_groups: int | None = None
    fma_prefetch: int = 0
    fma_block_i: int = 8
    fma_block_h: int = 16
    fma_warps: int = 2


DEFAULT_CONFIG = MoeConfig()
# Experts split over devices (`parallel.split_experts`): (most units, config), the first that holds a
# device's share. Each chosen from a sweep of launches at its share (T = 1 and 4, both kernels, against
# DEFAULT_CONFIG; the figures: docs/perf/moe.md, "A device's share of the experts").
SHARE_CONFIGS = (
    (1024, MoeConfig(fma_warps=4)),  # 736 units (4 devices)
    (2048, MoeConfig(fma_warps=4, fma_down_groups=16)),  # 1472 units (2 devices)
)


def config_for(units: int) -> MoeConfig:
    """The launch config `mxfp4_moe` takes by default for experts of `units` intermediate units: the
    first of SHARE_CONFIGS that holds them, else DEFAULT_CONFIG (whole gpt-oss experts: 2880)."""
    return next((c for most, c in SHARE_CONFIGS if units <= most), DEFAULT_CONFIG)


# -- dequantization in registers ----------------------------------------------------------------

def _raw_bits(w, i):
    """w int32 [...] (8 nibbles per word) -> f32: nibble i as E2M1 * 2^-126 (exact; the magnitude 0.5
    is an f32 subnormal, so GPU only)."""
    t = w if i == 7 else lax.shift_left(w, jnp.int32(28 - 4 * i))
    return lax.bitcast_convert_type(lax.shift_right_arithmetic(t, jnp.int32(6)) & _MASK, F32)


def _raw_f16(w, i):
    """`_raw_bits` through f16: E2M1 * 2^-14, normal in f32 (exact where f32 subnormals flush)."""
    t = w if i == 7 else lax.shift_left(w, jnp.int32(28 - 4 * i))
    bits = lax.shift_right_arithmetic(lax.shift_right_arithmetic(t, jnp.int32(3)) & _MASK16, jnp.int32(16))
    return lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16).astype(F32)


def _scaled_parts(w, sc, raw, unit):
    """w uint32 [R, G, 4] (8 nibbles each, input 8q + i in nibble i), sc uint8 [R, G] -> 8 parts
    bf16 [R, G * 4] (part i: inputs 8m + i, m = 4g + q) equal to the dequantized weights times 2^-32;
    raw(w, i) decodes nibble i in units of 2^unit. `_interleaved(parts)` is the [R, G * 32] tile in
    input order."""
    R, G, _ = w.shape
    wi = lax.bitcast_convert_type(w, jnp.int32)
    f = scale_exp2(sc, -unit - _SHIFT)[:, :, None]
    return [(raw(wi, i) * f).astype(jnp.bfloat16).reshape(R, G * 4) for i in range(8)]


def _decode_bits(w, sc):
    """`_scaled_parts` through `_raw_bits` (exact for scale bytes 35..160; needs f32 subnormals)."""
    return _scaled_parts(w, sc, _raw_bits, -126)


def _decode_f16(w, sc):
    """`_scaled_parts` through `_raw_f16`: needs no subnormal f32 arithmetic, so it is exact where f32
    subnormals are flushed (XLA:CPU, the interpreter); slower on GPUs."""
    return _scaled_parts(w, sc, _raw_f16, -14)


# Pair (i, i + 4) of each 32-bit word lands in one bf16x2: nibble i sits at bits 4i..4i+3 and
# nibble i + 4 sixteen bits higher, so one shift per field serves both halves. $8 = word, $9 = the
# bf16x2 factor 2^(scale - 33); outputs $0..$7 = inputs 8q + 0..7.
def _ptx_asm() -> str:
    lines = ["{", ".reg .b32 a, b;"]
    for i in range(4):
        mag, sign = 6 - 4 * i, 12 - 4 * i  # nibble bit 0 -> bf16 bit 6; nibble bit 3 -> bf16 bit 15
        lines.append(f"shl.b32 a, $8, {mag};" if mag >= 0 else f"shr.b32 a, $8, {-mag};")
        lines.append("and.b32 a, a, 0x01C001C0;")
        lines.append(f"shl.b32 b, $8, {sign};" if sign > 0 else "mov.b32 b, $8;")
        lines.append("and.b32 b, b, 0x80008000;")
        lines.append("or.b32 a, a, b;")
        lines.append("mul.rn.bf16x2 a, a, $9;")
        lines.append(f"mov.b32 {{${i}, ${i + 4}}}, a;")
    lines.append("}")
    return "\n".join(lines)


def _decode_ptx(w, sc):
    """`_decode_bits` in inline PTX on bf16x2 registers (GPU only): about 2.5 instructions a weight
    instead of about 4.5, and no f32 -> bf16 conversions."""
    R, G, _ = w.shape
    s = sc.astype(jnp.int32) + (126 - _SHIFT)  # bf16 exponent field of 2^(s - 1 - 32)
    fac = jnp.broadcast_to(((s << 7) | (s << 23))[:, :, None], (R, G, 4))
    wi = lax.bitcast_convert_type(w, jnp.int32)
    outs = inline_asm_multi(_ptx_asm(), [wi, fac], ",".join(["=h"] * 8 + ["r", "r"]), 8, jnp.bfloat16)
    return [o.reshape(R, G * 4) for o in outs]


def _interleaved(parts):
    """8 decoded parts [R, N] -> [R, 8N] in input order."""
    R, N = parts[0].shape
    return _interleave8(parts).reshape(R, 8 * N)


def _interleave8(v):
    """8 arrays [R, N] (v[i] = element 8n + i) -> [R, N, 2, 2, 2] in element order (pairwise joins)."""
    j = [jnp.stack([v[r], v[r + 4]], axis=-1) for r in range(4)]  # axis: bit 2 of i
    k = [jnp.stack([j[b0], j[2 + b0]], axis=-1) for b0 in range(2)]  # axis: bit 1
    return jnp.stack(k, axis=-1)  # axis: bit 0


_DECODERS = {"bits": _decode_bits, "ptx": _decode_ptx, "f16": _decode_f16}


# -- routing inside the kernels -----------------------------------------------------------------

def _pair_expert(ids_ref, s, P):
    """Expert e of pair s (of P), is_e bool [Pp]: pair q chose e, and q int32 [Pp]."""
    e = ids_ref[s]
    q = lax.broadcasted_iota(jnp.int32, (util.pow2(P),), 0)
    return e, util.load(ids_ref, pl.ds(0, q.shape[0]), mask=q < P, other=-1) == e, q


def _slot_tokens(ids_ref, s, c, *, T, k):
    """Expert of pair s, whether s is its first pair, which tokens of chunk c chose it, and all pairs.
    Returns (e, first, member bool [16], eq bool [16, kp], flat index int32 [16, kp] into [T * k],
    is_e bool [Pp]: pair q chose e)."""
    kp = util.pow2(k)
    e, is_e, q = _pair_expert(ids_ref, s, T * k)
    first = jnp.sum((is_e & (q < s)).astype(jnp.int32)) == 0
    t = c * TOKEN_TILE + lax.broadcasted_iota(jnp.int32, (TOKEN_TILE, kp), 0)
    j = lax.broadcasted_iota(jnp.int32, (TOKEN_TILE, kp), 1)
    ok = (t < T) & (j < k)
    idx = jnp.where(ok, t * k + j, 0)
    mine = util.load(ids_ref, idx, mask=ok, other=-1)
    eq = (mine == e) & ok
    member = jnp.sum(eq.astype(jnp.int32), axis=1) > 0
    return e, first, member, eq, idx, is_e


def _expert_rows(x_ref, x_lead, wq_ref, sc_ref, e, row_sets, r_ok, c, *, K, BG, decode, x_rows, depth,
                 tile=TOKEN_TILE):
    """[acc f32 [n, tile] = W_e[rows] @ x[chunk c]^T times 2^-32 for rows in row_sets] (chunk c: token
    rows [c * tile, (c + 1) * tile)), streaming the
    K inputs (K / 32 scale groups) in steps of BG groups; the activations are loaded once per step.
    Loads run `depth` steps ahead of the math (a queue in the loop carry), so each program keeps
    several tiles in flight. row_sets: index tuples of n output rows each (a pl.ds, then maybe an
    int); r_ok bool [n]: rows that exist; x_ref[*x_lead] [>= x_rows, >= K]."""
    n = r_ok.shape[0]
    K_groups = K // BLOCK
    nk = -(-K_groups // BG)
    t_ok = (c * tile + lax.broadcasted_iota(jnp.int32, (tile,), 0)) < x_rows
    g_iota = lax.broadcasted_iota(jnp.int32, (BG,), 0)
    c_iota = lax.broadcasted_iota(jnp.int32, (BG * BLOCK,), 0)

    def load_step(kk):
        live = kk < nk
        g0 = jnp.minimum(kk, nk - 1) * BG  # in bounds; steps past the end load nothing (masked)
        wmask = r_ok[:, None] & (g0 + g_iota < K_groups)[None, :] & live  # [n, BG]
        rows_x = pl.ds(c * tile, tile)
        xmask = t_ok[:, None] & (g0 * BLOCK + c_iota < K)[None, :] & live
        xt = util.load(x_ref, (*x_lead, rows_x, pl.ds(g0 * BLOCK, BG * BLOCK)), mask=xmask, other=0)
        ws = []
        for rows in row_sets:
            ws.append(util.load(wq_ref, (e, *rows, pl.ds(g0, BG), slice(None)),
                            mask=jnp.broadcast_to(wmask[:, :, None], (n, BG, 4)), other=0))
            ws.append(util.load(sc_ref, (e, *rows, pl.ds(g0, BG)), mask=wmask, other=0))
        return (xt, *ws)

    def body(kk, carry):
        accs, queue = carry
        ahead = load_step(kk + depth)  # issued before the math on the oldest tile
        xt, *ws = queue[0]
        out = []
        dims = (((1,), (1,)), ((), ()))
        for r, acc in enumerate(accs):
            wd = _interleaved(decode(ws[2 * r], ws[2 * r + 1]))  # 8 x [n, BG * 4] bf16 -> [n, BG * 32]
            acc = acc + lax.dot_general(wd, xt.astype(wd.dtype), dims, preferred_element_type=F32)
            out.append(acc)
        return tuple(out), (*queue[1:], ahead)

    init = (tuple(jnp.zeros((n, tile), F32) for _ in row_sets), tuple(load_step(d) for d in range(depth)))
    accs, _ = lax.fori_loop(0, nk, body, init)
    return accs


# -- the FMA path: an expert chosen by few tokens, on the CUDA cores --------------------------------
# Its activations come as f16 pairs, u32 [.., G, 5, 4] (20 words a scale group): word [g, k, q] for
# k < 4 = (x'[32g + 8q + 3 - k] low half, x'[32g + 8q + 7 - k] high half), with x' = x * 2^(14 - e_g)
# for a per-group exponent e_g (|x| < 2^e_g in the group, so |x'| < 2^14); word [g, 4, 0] holds the
# f32 bits of the group's factor 2^e_g (the rest of row 4 is 0). Pair k meets nibbles 3 - k and 7 - k
# of each weight word: the nibbles at the top of the word's two halves after a left shift by 4k.
PAIR_ROWS = 5  # rows of 4 words per scale group: 4 of pairs, 1 for the factor
PAIR_WORDS, GROUP_WORDS = 16, 4 * PAIR_ROWS  # a group's pair words; all its words (the factor at 16)

_E_MIN, _E_MAX = -100, 127  # clamp of the groups' exponents (f32-normal factors 2^e and 2^(14 - e))


def group_exponent(m):
    """m f32 >= 0 -> int32 e with m < 2^e (m = 0: the floor), clamped to [_E_MIN, _E_MAX]."""
    biased = lax.shift_right_logical(lax.bitcast_convert_type(m, jnp.int32), jnp.int32(23)) & 0xFF
    return jnp.clip(biased - 126, _E_MIN, _E_MAX)


def pack_f16x2(lo, hi):
    """f32 arrays -> u32 f16 pairs (lo in the low half), rounded to nearest."""
    def bits(v):
        return lax.bitcast_convert_type(v.astype(jnp.float16), jnp.int16).astype(jnp.int32) & 0xFFFF
    return lax.bitcast_convert_type(bits(lo) | lax.shift_left(bits(hi), jnp.int32(16)), jnp.uint32)


def pair_inputs(n):
    """For the first n / 16 groups of the pair layout: the inputs (low, high) of its n pair words
    ([g, k, q] order) and the words' flat indices (int32 [n] each)."""
    m = lax.broadcasted_iota(jnp.int32, (n,), 0)
    lo = (m // PAIR_WORDS) * BLOCK + (m % 4) * 8 + 3 - (m // 4) % 4
    return lo, lo + 4, (m // PAIR_WORDS) * GROUP_WORDS + m % PAIR_WORDS


def f16_pairs(v):
    """v f32 [T, G * 32] -> u32 [T, G, 5, 4]: the FMA path's pair layout (XLA side, for the gate_up
    activations; the group maxima as elementwise maxima, so that all of it is one fusion)."""
    T, K = v.shape
    vg = v.reshape(T, K // BLOCK, BLOCK)
    m = functools.reduce(jnp.maximum, [jnp.abs(vg[..., i]) for i in range(BLOCK)])
    e = group_exponent(m)
    h = (vg * pow2_f32(14 - e)[..., None]).reshape(T, K // BLOCK, 4, 2, 4)  # [t, g, q, half, i]
    h = h[..., ::-1].transpose(0, 1, 4, 2, 3)  # [t, g, k, q, half]: input 32g + 8q + 4 half + 3 - k
    factor = lax.bitcast_convert_type(pow2_f32(e), jnp.uint32)[:, :, None, None]
    trailer = jnp.concatenate([factor, jnp.zeros((T, K // BLOCK, 1, 3), jnp.uint32)], axis=-1)
    return jnp.concatenate([pack_f16x2(h[..., 0], h[..., 1]), trailer], axis=2)


def _group_dot_asm(nt: int, per_word: bool = False) -> str:
    """PTX: $t (t < nt) = sum over the 32 nibbles of the group's words $n..$(n + 3) (n = nt outputs)
    of E2M1 * 2^-14 times the token's matching f16 activation, pair words $(n + 4 + 16t + 4k + q)
    (pair k of word q); per_word (nt = 1): four results, $q the sum over word q's 8 nibbles.
    Each word is first rewritten byte by byte: zo holds its odd nibbles (each byte's high one), ze its
    even ones, each as the high byte of an f16 of E2M1 * 2^-14 (sign in bit 7, magnitude bits in 1-3;
    0.5 is an f16 subnormal): zo = (w >> 3 & 0x0E..) | (w & 0x80..), ze = (w << 1 & 0x0E..) |
    (w << 4 & 0x80..). Pair k (nibbles n = 3 - k and n + 4, bytes n // 2 and n // 2 + 2) is then one
    byte permute into an f16x2 with zero low bytes, and one f16x2 multiply-add per token, into two
    accumulators (even and odd k: two shorter dependency chains; per_word: one a word). A sum (16
    products a half, at most 96 in magnitude) goes to f32 once. Decode: about 12 instructions a word
    in SASS, 4 of them byte permutes, 4 a word for the fma, 4 a sum (the decodes measured against it:
    docs/perf/moe.md)."""
    assert nt == 1 or not per_word
    n_out = 4 if per_word else nt
    accs = [f"a{q}" for q in range(4)] if per_word else [r for t in range(nt) for r in (f"a{t}", f"c{t}")]
    lines = ["{", ".reg .b32 u, v, zo, ze, p;", ".reg .b32 " + ", ".join(accs) + ";",
             ".reg .f16 lo, hi;", ".reg .f32 fl, fh;"]
    for qw in range(4):
        w = f"${n_out + qw}"
        lines += [f"shr.b32 u, {w}, 3;", "and.b32 u, u, 0x0E0E0E0E;", f"and.b32 v, {w}, 0x80808080;",
                  "or.b32 zo, u, v;", f"shl.b32 u, {w}, 1;", "and.b32 u, u, 0x0E0E0E0E;", f"shl.b32 v, {w}, 4;",
                  "and.b32 v, v, 0x80808080;", "or.b32 ze, u, v;"]
        for k in range(4):
            n = 3 - k
            b = n // 2
            sel = ((b + 2) << 12) | (4 << 8) | (b << 4) | 4  # bytes: 0, z[b], 0, z[b + 2] (4 = the zero operand)
            lines.append(f"prmt.b32 p, {'zo' if n % 2 else 'ze'}, 0, 0x{sel:04X};")
            for t in range(nt):
                x = f"${n_out + 4 + 16 * t + 4 * k + qw}"
                acc = f"a{qw}" if per_word else (f"c{t}" if k % 2 else f"a{t}")
                first = k == 0 if per_word else (qw == 0 and k < 2)
                lines.append(f"mul.rn.f16x2 {acc}, p, {x};" if first else f"fma.rn.f16x2 {acc}, p, {x}, {acc};")
    if not per_word:
        lines += [f"add.rn.f16x2 a{t}, a{t}, c{t};" for t in range(nt)]
    for t in range(n_out):
        lines += [f"mov.b32 {{lo, hi}}, a{t};", "cvt.f32.f16 fl, lo;", "cvt.f32.f16 fh, hi;", f"add.f32 ${t}, fl, fh;"]
    lines.append("}")
    return "\n".join(lines)


def _f16_half(x, high):
    """u32 f16 pairs -> f32 of the low or high half."""
    xi = lax.bitcast_convert_type(x, jnp.int32)
    bits = lax.shift_right_logical(xi, jnp.int32(16)) if high else xi & 0xFFFF
    return lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16).astype(F32)


def _unstack_last(a):
    """[..., m] -> m arrays [...] (m a power of two; a register split in the Triton lowering)."""
    return [p.reshape(p.shape[:-1]) for p in jnp.split(a, a.shape[-1], axis=-1)]


def _group_dots(words, xs, decoder, per_word=False):
    """words: the 4 int32 [n, BG] words of each (row, group); xs: per token 16 u32 [n, BG] pair words
    (index 4k + q) -> per token f32 [n, BG]: each group's sum of E2M1 * 2^-14 * x' (per_word, one
    token: the 4 sums over the words q instead). "ptx": `_group_dot_asm` (GPU only); "f16": jnp,
    products in f32."""
    if decoder == "ptx":
        n_out = 4 if per_word else len(xs)
        cons = ",".join(["=f"] * n_out + ["r"] * (4 + 16 * len(xs)))
        return inline_asm_multi(_group_dot_asm(len(xs), per_word), [*words, *(x for xt in xs for x in xt)], cons,
                                 n_out, F32)
    out = []
    for xt in xs:
        sums = [sum(_raw_f16(w, 3 - k) * _f16_half(xt[4 * k + q], False)
                    + _raw_f16(w, 7 - k) * _f16_half(xt[4 * k + q], True)
                    for k in range(4)) for q, w in enumerate(words)]
        out += sums if per_word else [sum(sums)]
    return out


def _tile_index(e, rows, g0, BG, words):
    """Index of expert e's tile [n, BG] of scale groups g0.. (words: [n, BG, 4] of their words) in the
    rows `rows`: (pl.ds, maybe an int) or (int32 [n] array, maybe an int), the latter as full array
    indices (the interpreter takes no mix of arrays and slices)."""
    if not isinstance(rows[0], jax.Array):
        return (e, *rows, pl.ds(g0, BG)) + ((slice(None),) if words else ())
    g = g0 + lax.broadcasted_iota(jnp.int32, (BG,), 0)
    if not words:
        return (e, *(r[:, None] if r.ndim else r for r in rows), g[None, :])
    q = lax.broadcasted_iota(jnp.int32, (4,), 0)
    return (e, *(r[:, None, None] if r.ndim else r for r in rows), g[None, :, None], q[None, None, :])


def _fma_rows(xq_ref, x_lead, toks, wq_ref, sc_ref, e, row_sets, r_ok, *, K, BG, decoder, depth, per_word=False):
    """[[f32 [n] per token] per row set]: W_e[rows] @ x[tok] (true values) for the tokens `toks`
    (int32 scalars), streaming K inputs in steps of BG scale groups (the last step's groups past K
    masked: loading nothing, decoded as zeros); the weights, scales and the tokens' activations are
    loaded `depth` steps ahead (0: at the start of the step that uses them). xq_ref[*x_lead, tok]: u32
    [>= K / 32, 20] (the pair layout above, a group's 20 words in a row); each (row, group) sum is
    scaled once by 2^(scale - 127) (scale byte 0, 2^-127, reads as 0) and the group's factor, word 16;
    per_word (one token): each word q's sum by its own factor, word 16 + q (masked steps rather than
    straight-line partial ones: docs/perf/moe.md)."""
    n = r_ok.shape[0]
    K_groups = K // BLOCK
    nk = -(-K_groups // BG)
    nf = 4 if per_word else 1
    g_iota = lax.broadcasted_iota(jnp.int32, (BG,), 0)

    def load_step(kk):
        g0 = jnp.minimum(kk, nk - 1) * BG
        gmask = (g0 + g_iota < K_groups) & (kk < nk)
        wmask = r_ok[:, None] & gmask[None, :]
        ws = []
        for rows in row_sets:
            ws.append(util.load(wq_ref, _tile_index(e, rows, g0, BG, True),
                            mask=jnp.broadcast_to(wmask[:, :, None], (n, BG, 4)), other=0))
            ws.append(util.load(sc_ref, _tile_index(e, rows, g0, BG, False), mask=wmask, other=0))
        xmask = jnp.broadcast_to(gmask[:, None], (BG, PAIR_WORDS))
        xs = tuple(util.load(xq_ref, (*x_lead, t, pl.ds(g0, BG), pl.ds(0, PAIR_WORDS)), mask=xmask, other=0)
                   for t in toks)
        xf = tuple(util.load(xq_ref, (*x_lead, t, pl.ds(g0, BG), pl.ds(PAIR_WORDS, nf)),
                         mask=jnp.broadcast_to(gmask[:, None], (BG, nf)), other=0) for t in toks)
        return tuple(ws), xs, xf

    def body(kk, carry):
        accs, queue = carry
        if depth:
            ahead = load_step(kk + depth)
            (ws, xs, xf), queue = queue[0], (*queue[1:], ahead)
        else:  # loaded where used: no loaded tile is carried from one step to the next
            ws, xs, xf = load_step(kk)
        xw = [[jnp.broadcast_to(x[None], (n, BG)) for x in _unstack_last(xt)] for xt in xs]  # 16 x [n, BG]
        xf = [[lax.bitcast_convert_type(f, F32)[None, :] for f in _unstack_last(ft)] for ft in xf]  # nf x [1, BG]
        new = []
        for r, acc_r in enumerate(accs):
            words = _unstack_last(lax.bitcast_convert_type(ws[2 * r], jnp.int32))  # 4 x [n, BG]
            f = scale_exp2(ws[2 * r + 1], 0)  # 2^(scale - 127)
            sums = _group_dots(words, xw, decoder, per_word)
            if per_word:
                sums = [sum(sq * fq for sq, fq in zip(sums, xf[0]))]
                new.append((acc_r[0] + sums[0] * f,))
            else:
                new.append(tuple(acc + s * (f * xft[0]) for acc, s, xft in zip(acc_r, sums, xf)))
        return tuple(new), queue

    zeros = tuple(tuple(jnp.zeros((n, BG), F32) for _ in toks) for _ in row_sets)
    accs, _ = lax.fori_loop(0, nk, body, (zeros, tuple(load_step(d) for d in range(depth))))
    return [[jnp.sum(a, axis=1) for a in acc_r] for acc_r in accs]


def _swiglu(hg, hl, bg, bl, limit, alpha):
    gate = jnp.minimum(hg + bg, limit)
    lin = jnp.clip(hl + bl, -limit, limit)
    return gate * (1.0 / (1.0 + jnp.exp(-alpha * gate))) * (lin + 1.0)


def _zero_out(out_ref, j, zero_cols):
    """out[:, j * zero_cols : (j + 1) * zero_cols] = 0 (the down kernels accumulate into out)."""
    To, Ho = out_ref.shape
    Tz = util.pow2(To)
    r = lax.broadcasted_iota(jnp.int32, (Tz, zero_cols), 0)
    col = j * zero_cols + lax.broadcasted_iota(jnp.int32, (Tz, zero_cols), 1)
    util.store(out_ref, (pl.ds(0, Tz), pl.ds(j * zero_cols, zero_cols)), jnp.zeros((Tz, zero_cols), F32),
           mask=(r < To) & (col < Ho))


_GATE, _LIN = 0, 1  # gate_up rows viewed as [I, 2]: row 2i (gate i) = [i, 0], row 2i + 1 (linear i) = [i, 1]


def _gate_up_kernel(ids_ref, x_ref, wq_ref, sc_ref, b_ref, act_ref, *out_ref, T, k, H, I, BI, BG, limit, alpha,
                    decode, zero_cols, depth, fma_tokens):
    """MMA path of gate_up: experts chosen by more than fma_tokens tokens; grid (slot, chunk, I tile).
    With an out_ref (no FMA kernel ran before), its programs also zero out."""
    s, c, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if out_ref:
        pl.when((s == 0) & (c == 0))(lambda: _zero_out(out_ref[0], j, zero_cols))
    e, first, member, _, _, is_e = _slot_tokens(ids_ref, s, c, T=T, k=k)
    u = j * BI + lax.broadcasted_iota(jnp.int32, (BI,), 0)
    i_ok = u < I
    row_sets = [(pl.ds(j * BI, BI), jnp.int32(_GATE)), (pl.ds(j * BI, BI), jnp.int32(_LIN))]

    @pl.when((e >= 0) & first & (jnp.sum(is_e.astype(jnp.int32)) > fma_tokens)
             & (jnp.sum(member.astype(jnp.int32)) > 0))
    def _mma():
        hg, hl = _expert_rows(x_ref, (), wq_ref, sc_ref, e, row_sets, i_ok, c, K=H, BG=BG,
                              decode=decode, x_rows=T, depth=depth)
        bias = [util.load(b_ref, (e, pl.ds(j * BI, BI), jnp.int32(col)), mask=i_ok, other=0).astype(F32)[:, None]
                for col in (_GATE, _LIN)]
        act = _swiglu(hg * _UNSCALE, hl * _UNSCALE, *bias, limit, alpha)
        mask = jnp.broadcast_to(i_ok[None, :], (TOKEN_TILE, BI))
        util.store(act_ref, (s, pl.ds(c * TOKEN_TILE, TOKEN_TILE), pl.ds(j * BI, BI)), act.T.astype(act_ref.dtype),
               mask=mask)


def _fma_gate_up_kernel(ids_ref, xq_ref, wq_ref, sc_ref, b_ref, actq_ref, out_ref, *, T, k, H, BF, limit, alpha,
                        dtype, zero_cols, fma):
    """FMA path of gate_up: experts chosen by at most fma.tokens tokens; grid (pair, I / BF). Program j
    owns act columns [BF j, BF (j + 1)) (BF / 8 blocks of 8) and writes them in kernel 2's pair layout
    with one factor 2^e_b per block b (|act| < 2^e_b in the block): block b's pair k is
    (act[8b + 3 - k], act[8b + 7 - k]) * 2^(14 - e_b) at word 20 (b // 4) + 4 k + b % 4, its factor at
    word 20 (b // 4) + 16 + b % 4."""
    s, j = pl.program_id(0), pl.program_id(1)
    if zero_cols:
        pl.when(s == 0)(lambda: _zero_out(out_ref, j, zero_cols))
    e, is_e, _ = _pair_expert(ids_ref, s, T * k)

    @pl.when((e >= 0) & (jnp.sum(is_e.astype(jnp.int32)) <= fma.tokens))
    def _fma():
        m = lax.broadcasted_iota(jnp.int32, (BF // 2,), 0)
        blk, kk = j * (BF // 8) + m // 4, m % 4  # 8-column block and pair of each word
        lo = 8 * blk + 3 - kk
        at = (blk // 4) * GROUP_WORDS + 4 * kk + blk % 4
        ok = jnp.ones(lo.shape, jnp.bool_)
        sets = [(lo, jnp.int32(_GATE)), (lo + 4, jnp.int32(_GATE)), (lo, jnp.int32(_LIN)), (lo + 4, jnp.int32(_LIN))]
        hs = [h for [h] in _fma_rows(xq_ref, (), [s // k], wq_ref, sc_ref, e, sets, ok, K=H, BG=fma.groups,
                                     decoder=fma.decoder, depth=fma.prefetch)]
        b = [util.load(b_ref, (e, *rows)).astype(F32) for rows in sets]
        a_lo, a_hi = (_swiglu(hs[h], hs[2 + h], b[h], b[2 + h], limit, alpha).astype(dtype).astype(F32)
                      for h in (0, 1))
        big = jnp.maximum(jnp.abs(a_lo), jnp.abs(a_hi))
        nb = BF // 8
        c = lax.broadcasted_iota(jnp.int32, (nb,), 0)
        ex = jnp.zeros(m.shape, jnp.int32)  # each 8-column block's exponent, per word ...
        ex_b = jnp.zeros((nb,), jnp.int32)  # ... and per block
        for i in range(nb):
            e_i = group_exponent(jnp.max(jnp.where(m // 4 == i, big, 0.0)))
            ex, ex_b = jnp.where(m // 4 == i, e_i, ex), jnp.where(c == i, e_i, ex_b)
        sc = pow2_f32(14 - ex)
        util.store(actq_ref, (s, at), pack_f16x2(a_lo * sc, a_hi * sc))
        blk_b = j * nb + c
        factor = lax.bitcast_convert_type(pow2_f32(ex_b), jnp.uint32)
        util.store(actq_ref, (s, (blk_b // 4) * GROUP_WORDS + PAIR_WORDS + blk_b % 4), factor)


def _down_kernel(ids_ref, w_ref, act_ref, wq_ref, sc_ref, b_ref, out_in_ref, on_ref, out_ref, *, T, k, H, I, BN, BG,
                 decode, interpret, depth, fma_tokens):
    """MMA path of down + combine; grid (slot, chunk, H tile); on_ref [1]: whether the bias is added."""
    del out_in_ref  # aliased with out_ref
    s, c, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e, first, member, eq, idx, is_e = _slot_tokens(ids_ref, s, c, T=T, k=k)
    cols = j * BN + lax.broadcasted_iota(jnp.int32, (BN,), 0)
    n_ok = cols < H

    @pl.when((e >= 0) & first & (jnp.sum(is_e.astype(jnp.int32)) > fma_tokens)
             & (jnp.sum(member.astype(jnp.int32)) > 0))
    def _mma():
        [y] = _expert_rows(act_ref, (s,), wq_ref, sc_ref, e, [(pl.ds(j * BN, BN),)], n_ok, c,
                           K=I, BG=BG, decode=decode, x_rows=act_ref.shape[1], depth=depth)
        b = util.load(b_ref, (e, pl.ds(j * BN, BN)), mask=n_ok & (on_ref[0] != 0), other=0).astype(F32)
        wt = util.load(w_ref, idx, mask=eq, other=0.0)
        wtok = jnp.sum(jnp.where(eq, wt, 0.0), axis=1)  # [16] routing weight of this expert per token
        val = (y * _UNSCALE + b[:, None]) * wtok[None, :]  # [BN, 16]
        rows = c * TOKEN_TILE + lax.broadcasted_iota(jnp.int32, (BN, TOKEN_TILE), 1)
        mask = member[None, :] & n_ok[:, None]
        _combine(out_ref, rows, jnp.broadcast_to(cols[:, None], rows.shape), val, mask, interpret)


def _fma_down_kernel(ids_ref, w_ref, actq_ref, wq_ref, sc_ref, b_ref, out_in_ref, on_ref, out_ref, *, T, k, H, I,
                     BN, interpret, fma):
    """FMA path of down + combine; grid (pair, H / BN); on_ref [1]: whether the bias is added."""
    del out_in_ref  # aliased with out_ref
    s, j = pl.program_id(0), pl.program_id(1)
    e, is_e, _ = _pair_expert(ids_ref, s, T * k)
    cols = j * BN + lax.broadcasted_iota(jnp.int32, (BN,), 0)
    n_ok = cols < H

    @pl.when((e >= 0) & (jnp.sum(is_e.astype(jnp.int32)) <= fma.tokens))
    def _fma():
        [[y]] = _fma_rows(actq_ref, (), [s], wq_ref, sc_ref, e, [(pl.ds(j * BN, BN),)], n_ok, K=I, BG=fma.down_groups,
                          decoder=fma.decoder, depth=fma.prefetch, per_word=True)
        b = util.load(b_ref, (e, pl.ds(j * BN, BN)), mask=n_ok & (on_ref[0] != 0), other=0).astype(F32)
        _combine(out_ref, jnp.broadcast_to(s // k, (BN,)), cols, (y + b) * w_ref[s], n_ok, interpret)


def _combine(out_ref, rows, cols, val, mask, interpret):
    """out[rows, cols] += val where mask (f32 atomics)."""
    if interpret:  # the interpreter's atomics take no mask; out is padded so every index is valid
        plgpu.atomic_add(out_ref, (rows, cols), jnp.where(mask, val, 0.0))
    else:
        plgpu.atomic_add(out_ref, (rows, cols), val, mask=mask)


@dataclasses.dataclass(frozen=True)
class _Fma:
    tokens: int  # experts chosen by at most this many tokens take the FMA path
    groups: int  # scale groups a K step: gate_up's
    down_groups: int  # down's
    prefetch: int
    decoder: str


def _as_words(blocks):
    """u8 [E, R, G, 16] -> u32 [E, R, G, 4] (a bitcast: little-endian, nibble i of word q = input 8q + i)."""
    E, R, G, B = blocks.shape
    return lax.bitcast_convert_type(blocks.reshape(E, R, G, B // 4, 4), jnp.uint32)


def _kernel_experts(gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias, pad=None):
    """The packed experts as the kernels read them, ((gate_up words, scales, bias), (down words, scales,
    bias)): blocks as u32 words, gate_up rows as [I, 2] (gate, linear); free reshapes of the HF layout.
    pad (the interpreter): (gate_up rows I', its groups, down rows, its groups) to pad up to."""
    E, R1, G1, _ = gate_up_blocks.shape
    I = R1 // 2
    gu = (_as_words(gate_up_blocks).reshape(E, I, 2, G1, 4), gate_up_scales.reshape(E, I, 2, G1),
          gate_up_bias.reshape(E, I, 2))
    dn = (_as_words(down_blocks), down_scales, down_bias)
    if pad is None:
        return gu, dn
    r1, g1, r2, g2 = pad
    return ((util.pad(gu[0], (E, r1, 2, g1, 4)), util.pad(gu[1], (E, r1, 2, g1)), util.pad(gu[2], (E, r1, 2))),
            (util.pad(dn[0], (E, r2, g2, 4)), util.pad(dn[1], (E, r2, g2)), util.pad(dn[2], (E, r2))))


@functools.partial(jax.jit, static_argnames=("limit", "alpha", "config", "interpret"))
def mxfp4_moe(x, ids, weights, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias,
              *, limit: float, alpha: float, config: MoeConfig | None = None, interpret: bool = False, xq=None,
              down_bias_on=None):
    """x [T, H] (bf16), ids int [T, k], weights f32 [T, k] -> f32 [T, H]; T <= MAX_TOKENS. xq: x in the
    FMA path's pair layout (`f16_pairs(x)`, u32 [T, H/32, 5, 4]) where it is already at hand
    (`moe_route.route` writes it), else computed here. down_bias_on: a bool scalar, traced or not
    (None: True); where False, b2 is taken as zero (tensor-parallel experts add it on one device:
    a flag the down kernel reads, not a zeroed copy of the [E, H] bias each call).

    out[t] = sum_j weights[t, j] * (W2 act(W1 x[t] + b1) + b2) of expert ids[t, j], act(h) =
    g * sigmoid(alpha * g) * (l + 1), g = min(h[0::2], limit), l = clip(h[1::2], -limit, limit);
    act is rounded to x.dtype before the down projection (as the jnp model does). Each token's k
    expert ids must be distinct (top-k routing); a negative id skips its pair (expert parallel: an
    expert held by another device), which then reads no weights."""
    cfg = config or config_for(gate_up_blocks.shape[1] // 2)
    T, H = x.shape
    k = ids.shape[1]
    E, R1, G1, _ = gate_up_blocks.shape
    I = R1 // 2
    G2 = I // BLOCK
    if T > MAX_TOKENS:
        raise ValueError(f"mxfp4_moe: {T} tokens > {MAX_TOKENS}; use a grouped path for prefill")
    if (G1 * BLOCK != H or I % BLOCK or gate_up_blocks.shape[-1] != 16
            or tuple(down_blocks.shape) != (E, H, G2, 16) or tuple(ids.shape) != tuple(weights.shape)):
        raise ValueError(f"mxfp4_moe: shapes x {x.shape}, ids {ids.shape}, weights {weights.shape}, gate_up "
                         f"{gate_up_blocks.shape}, down {down_blocks.shape} do not fit together")
    down_groups = cfg.fma_groups if cfg.fma_down_groups is None else cfg.fma_down_groups
    for bsz in (cfg.block_i, cfg.block_h, cfg.groups, cfg.fma_groups, down_groups, cfg.fma_block_h):
        if bsz != util.pow2(bsz):
            raise ValueError(f"mxfp4_moe: tile sizes must be powers of two, got {cfg}")
    if cfg.prefetch < 1 or cfg.fma_prefetch < 0 or cfg.fma_tokens < 0 or cfg.fma_block_i not in (8, 16, 32):
        raise ValueError(f"mxfp4_moe: prefetch must be >= 1, fma_prefetch >= 0, fma_tokens >= 0, and fma_block_i 8, "
                         f"16 or 32, got {cfg}")
    if cfg.decode not in _DECODERS:
        raise ValueError(f"mxfp4_moe: decode {cfg.decode!r}, expected one of {sorted(_DECODERS)}")
    decode = _decode_f16 if interpret else _DECODERS[cfg.decode]
    fma = _Fma(tokens=min(cfg.fma_tokens, T), groups=cfg.fma_groups, down_groups=down_groups,
               prefetch=cfg.fma_prefetch, decoder="ptx" if cfg.decode == "ptx" and not interpret else "f16")
    P, Pp = T * k, util.pow2(T * k)
    nc = -(-T // TOKEN_TILE)
    Tp = nc * TOKEN_TILE
    BI, BN, BG, BF, BNf = cfg.block_i, cfg.block_h, cfg.groups, cfg.fma_block_i, cfg.fma_block_h
    nj1, nj2, nf1, nf2 = -(-I // BI), -(-H // BN), I // BF, -(-H // BNf)
    Gp1, Gp2 = -(-G1 // BG) * BG, -(-G2 // BG) * BG
    Gf1, Gf2 = -(-G1 // fma.groups) * fma.groups, -(-G2 // fma.down_groups) * fma.down_groups
    mma = T > fma.tokens  # some expert may have more tokens than the FMA path takes
    zero_cols = util.pow2(-(-H // (nf1 if fma.tokens else nj1)))  # kernel 1's programs zero out, zero_cols each
    # out: exactly [T, H] on GPU (masked stores and atomics); the interpreter gets every index in bounds
    To, Ho = ((max(Tp, util.pow2(T)), max(nj2 * BN, nf2 * BNf, (nf1 if fma.tokens else nj1) * zero_cols))
              if interpret else (T, H))
    Ia = max(Gp2 * BLOCK, nj1 * BI)  # act columns: every K step of kernel 2 and every store of kernel 1 in bounds
    ids_flat = ids.reshape(-1).astype(jnp.int32)
    w_flat = weights.reshape(-1).astype(F32)
    on = jnp.ones((1,), jnp.int32) if down_bias_on is None else jnp.asarray(down_bias_on, jnp.int32).reshape(1)
    if xq is None:
        xq = f16_pairs(x.astype(F32))  # the FMA path's activations
    elif tuple(xq.shape) != (T, G1, PAIR_ROWS, 4) or xq.dtype != jnp.uint32:
        raise ValueError(f"mxfp4_moe: xq {xq.shape} {xq.dtype}, expected uint32 {(T, G1, PAIR_ROWS, 4)}")
    pad = (nj1 * BI, max(Gp1, Gf1), max(nj2 * BN, nf2 * BNf), max(Gp2, Gf2)) if interpret else None
    (gu_w, gu_s, gu_b), (dn_w, dn_s, dn_b) = _kernel_experts(gate_up_blocks, gate_up_scales, gate_up_bias,
                                                             down_blocks, down_scales, down_bias, pad)
    if interpret:
        ids_flat = util.pad(ids_flat, (Pp,), -1)
        x = util.pad(x, (Tp, Gp1 * BLOCK))
        xq = util.pad(xq, (T, Gf1, PAIR_ROWS, 4))
        params = fma_params = None
    else:
        params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        fma_params = plgpu.CompilerParams(num_warps=cfg.fma_warps, num_stages=1)
    out = jax.ShapeDtypeStruct((To, Ho), F32)
    if fma.tokens:  # kernel 1, FMA path (zeroes out)
        actq, out = pl.pallas_call(
            functools.partial(_fma_gate_up_kernel, T=T, k=k, H=H, BF=BF, limit=float(limit), alpha=float(alpha),
                              dtype=x.dtype, zero_cols=zero_cols, fma=fma),
            grid=(P, nf1),
            out_shape=(jax.ShapeDtypeStruct((P, Gf2 * GROUP_WORDS), jnp.uint32), out),
            compiler_params=fma_params, interpret=interpret, name="mxfp4_moe_gate_up_fma",
        )(ids_flat, xq.reshape(*xq.shape[:2], GROUP_WORDS), gu_w, gu_s, gu_b)
    if mma:  # kernel 1, MMA path (zeroes out where no FMA kernel did)
        act, *zeroed = pl.pallas_call(
            functools.partial(_gate_up_kernel, T=T, k=k, H=H, I=I, BI=BI, BG=BG, limit=float(limit), alpha=float(alpha),
                              decode=decode, zero_cols=zero_cols, depth=cfg.prefetch, fma_tokens=fma.tokens),
            grid=(P, nc, nj1),
            out_shape=(jax.ShapeDtypeStruct((P, Tp, Ia), x.dtype),) + (() if fma.tokens else (out,)),
            compiler_params=params, interpret=interpret, name="mxfp4_moe_gate_up",
        )(ids_flat, x, gu_w, gu_s, gu_b)
        out = zeroed[0] if zeroed else out
    if fma.tokens:  # kernel 2, FMA path
        out = pl.pallas_call(
            functools.partial(_fma_down_kernel, T=T, k=k, H=H, I=I, BN=BNf, interpret=interpret, fma=fma),
            grid=(P, nf2),
            out_shape=jax.ShapeDtypeStruct((To, Ho), F32),
            input_output_aliases={6: 0},
            compiler_params=fma_params, interpret=interpret, name="mxfp4_moe_down_fma",
        )(ids_flat, w_flat, actq.reshape(P, Gf2, GROUP_WORDS), dn_w, dn_s, dn_b, out, on)
    if mma:  # kernel 2, MMA path
        out = pl.pallas_call(
            functools.partial(_down_kernel, T=T, k=k, H=H, I=I, BN=BN, BG=BG, decode=decode, interpret=interpret,
                              depth=cfg.prefetch, fma_tokens=fma.tokens),
            grid=(P, nc, nj2),
            out_shape=jax.ShapeDtypeStruct((To, Ho), F32),
            input_output_aliases={6: 0},
            compiler_params=params, interpret=interpret, name="mxfp4_moe_down",
        )(ids_flat, w_flat, act, dn_w, dn_s, dn_b, out, on)
    return out if (To, Ho) == (T, H) else out[:T, :H]


# -- the grouped path: many tokens (prefill), tiles of one expert's tokens on the tensor cores ------

@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Launch parameters of `mxfp4_moe_grouped` for tiles of tm token rows. block_i: SwiGLU outputs per
    gate_up program (it reads 2 * block_i weight rows), block_h: outputs per down program, both for
    tm <= 128 and scaled down by tm / 128 above (at least 16), so that a program's accumulators stay
    the same size. groups: 32-input scale groups per K step; prefetch: K steps loaded ahead; num_warps,
    num_stages: Triton's; decode: as in MoeConfig ("ptx" on GPUs). The defaults: the fastest launch
    measured for one gpt-oss-120b layer at 2048 tokens, tm = 128 (the launches: docs/perf/moe.md)."""

    block_i: int = 128
    block_h: int = 128
    groups: int = 2
    prefetch: int = 1
    num_warps: int = 8
    num_stages: int = 1
    decode: str = "ptx"

    def blocks(self, tm: int) -> tuple[int, int]:
        f = max(1, tm // 128)
        return max(16, self.block_i // f), max(16, self.block_h // f)


def _grouped_gate_up_kernel(te_ref, nl_ref, x_ref, wq_ref, sc_ref, b_ref, act_ref, *, H, I, BI, BG, TM, limit,
                            alpha, decode, depth):
    """gate_up + SwiGLU of one tile; grid (tile, I / BI). act[t, :, BI j : BI (j + 1)] in act's dtype."""
    t, j = pl.program_id(0), pl.program_id(1)
    i_ok = j * BI + lax.broadcasted_iota(jnp.int32, (BI,), 0) < I

    @pl.when(t < nl_ref[0])
    def _():
        e = te_ref[t]
        row_sets = [(pl.ds(j * BI, BI), jnp.int32(_GATE)), (pl.ds(j * BI, BI), jnp.int32(_LIN))]
        hg, hl = _expert_rows(x_ref, (t,), wq_ref, sc_ref, e, row_sets, i_ok, 0, K=H, BG=BG, decode=decode,
                              x_rows=TM, depth=depth, tile=TM)
        bias = [util.load(b_ref, (e, pl.ds(j * BI, BI), jnp.int32(col)), mask=i_ok, other=0).astype(F32)[:, None]
                for col in (_GATE, _LIN)]
        act = _swiglu(hg * _UNSCALE, hl * _UNSCALE, *bias, limit, alpha)  # [BI, TM]
        util.store(act_ref, (t, pl.ds(0, TM), pl.ds(j * BI, BI)), act.T.astype(act_ref.dtype),
               mask=jnp.broadcast_to(i_ok[None, :], (TM, BI)))


def _grouped_down_kernel(te_ref, nl_ref, rw_ref, act_ref, wq_ref, sc_ref, b_ref, y_ref, *, H, I, BN, BG, TM,
                         decode, depth):
    """down + bias of one tile, times each row's routing weight; grid (tile, H / BN)."""
    t, j = pl.program_id(0), pl.program_id(1)
    n_ok = j * BN + lax.broadcasted_iota(jnp.int32, (BN,), 0) < H

    @pl.when(t < nl_ref[0])
    def _():
        e = te_ref[t]
        [y] = _expert_rows(act_ref, (t,), wq_ref, sc_ref, e, [(pl.ds(j * BN, BN),)], n_ok, 0, K=I, BG=BG,
                           decode=decode, x_rows=TM, depth=depth, tile=TM)
        b = util.load(b_ref, (e, pl.ds(j * BN, BN)), mask=n_ok, other=0).astype(F32)
        w = util.load(rw_ref, (t, pl.ds(0, TM)))
        val = (y * _UNSCALE + b[:, None]) * w[None, :]  # [BN, TM]
        util.store(y_ref, (t, pl.ds(0, TM), pl.ds(j * BN, BN)), val.T, mask=jnp.broadcast_to(n_ok[None, :], (TM, BN)))


@functools.partial(jax.jit, static_argnames=("limit", "alpha", "config", "interpret"))
def mxfp4_moe_grouped(x_tiles, tile_expert, num_live, row_weight, gate_up_blocks, gate_up_scales, gate_up_bias,
                      down_blocks, down_scales, down_bias, *, limit: float, alpha: float,
                      config: GroupedConfig | None = None, interpret: bool = False):
    """The experts for many tokens (prefill), grouped by expert into tiles of tm rows.

    x_tiles [n, tm, H] (bf16): tile t's rows are tokens routed to expert tile_expert[t] (int32 [n]);
    num_live int32 []: tiles [0, num_live) hold tokens, the rest are skipped (their output rows are
    not written); row_weight f32 [n, tm]: each row's routing weight (0 on padding rows). Returns
    y f32 [n, tm, H], y[t, r] = row_weight[t, r] * (W2 act(W1 x + b1) + b2) of expert tile_expert[t]
    (act as in `mxfp4_moe`, rounded to x's dtype). Two kernels, grid (tile, output block): each
    program streams its rows of the tile's packed expert once, decodes them in registers
    (bf16 times 2^-32, exact for scale bytes 35..160, as the MMA path) and multiplies them with the
    tile's rows on the tensor cores."""
    cfg = config or GroupedConfig()
    n, TM, H = x_tiles.shape
    E, R1, G1, _ = gate_up_blocks.shape
    I = R1 // 2
    G2 = I // BLOCK
    if (G1 * BLOCK != H or I % BLOCK or gate_up_blocks.shape[-1] != 16 or tuple(down_blocks.shape) != (E, H, G2, 16)
            or tuple(tile_expert.shape) != (n,) or tuple(row_weight.shape) != (n, TM) or TM < 16
            or TM != util.pow2(TM)):
        raise ValueError(f"mxfp4_moe_grouped: shapes x_tiles {x_tiles.shape} (tm a power of two >= 16), tile_expert "
                         f"{tile_expert.shape}, row_weight {row_weight.shape}, gate_up {gate_up_blocks.shape}, down "
                         f"{down_blocks.shape} do not fit together")
    if cfg.decode not in _DECODERS or cfg.prefetch < 1 or cfg.groups != util.pow2(cfg.groups):
        raise ValueError(f"mxfp4_moe_grouped: bad config {cfg}")
    decode = _decode_f16 if interpret else _DECODERS[cfg.decode]
    BI, BN = cfg.blocks(TM)
    BG = cfg.groups
    nj1, nj2 = -(-I // BI), -(-H // BN)
    Gp1, Gp2 = -(-G1 // BG) * BG, -(-G2 // BG) * BG
    Ia = max(Gp2 * BLOCK, nj1 * BI)  # act columns: every K step of kernel 2 and every store of kernel 1 in bounds
    Ho = nj2 * BN if interpret else H
    (gu_w, gu_s, gu_b), (dn_w, dn_s, dn_b) = _kernel_experts(
        gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias,
        (nj1 * BI, Gp1, Ho, Gp2) if interpret else None)
    te = tile_expert.astype(jnp.int32)
    nl = jnp.reshape(num_live, (1,)).astype(jnp.int32)
    if interpret:
        x_tiles = util.pad(x_tiles, (n, TM, Gp1 * BLOCK))
        params = None
    else:
        params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    act = pl.pallas_call(
        functools.partial(_grouped_gate_up_kernel, H=H, I=I, BI=BI, BG=BG, TM=TM, limit=float(limit),
                          alpha=float(alpha), decode=decode, depth=cfg.prefetch),
        grid=(n, nj1), out_shape=jax.ShapeDtypeStruct((n, TM, Ia), x_tiles.dtype),
        compiler_params=params, interpret=interpret, name="mxfp4_moe_grouped_gate_up",
    )(te, nl, x_tiles, gu_w, gu_s, gu_b)
    y = pl.pallas_call(
        functools.partial(_grouped_down_kernel, H=H, I=I, BN=BN, BG=BG, TM=TM, decode=decode, depth=cfg.prefetch),
        grid=(n, nj2), out_shape=jax.ShapeDtypeStruct((n, TM, Ho), F32),
        compiler_params=params, interpret=interpret, name="mxfp4_moe_grouped_down",
    )(te, nl, row_weight.astype(F32), act, dn_w, dn_s, dn_b)
    return y if Ho == H else y[..., :H]


# -- reference ---------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("limit", "alpha", "config", "interpret"))
def mxfp4_moe_reference(x, ids, weights, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales,
                        down_bias, *, limit: float, alpha: float, config: MoeConfig | None = None,
                        interpret: bool = False, down_bias_on=None):
    """Plain-jnp `mxfp4_moe`: dequantize each (token, expert) pair's expert (tokens four at a time,
    so that full-size experts fit in memory); pairs with negative ids add nothing. f32 [T, H]."""
    del config, interpret
    if down_bias_on is not None:
        down_bias = jnp.where(down_bias_on, down_bias, jnp.zeros((), down_bias.dtype))

    def one_token(args):
        xt, it, wt = args  # [H], [k], [k]
        wt = jnp.where(it >= 0, wt, 0)  # negative ids: skipped pairs
        it = jnp.maximum(it, 0)
        w1 = dequantize(gate_up_blocks[it], gate_up_scales[it], x.dtype)  # [k, 2I, H]
        w2 = dequantize(down_blocks[it], down_scales[it], x.dtype)  # [k, H, I]
        h = jnp.einsum("h,koh->ko", xt, w1, preferred_element_type=F32) + gate_up_bias[it].astype(F32)
        gate = jnp.minimum(h[..., ::2], limit)
        lin = jnp.clip(h[..., 1::2], -limit, limit)
        act = (gate * jax.nn.sigmoid(alpha * gate) * (lin + 1)).astype(x.dtype)
        y = jnp.einsum("ki,koi->ko", act, w2, preferred_element_type=F32) + down_bias[it].astype(F32)
        return jnp.einsum("ko,k->o", y, wt.astype(F32))

    return lax.map(one_token, (x, ids, weights), batch_size=4)


def expert_bytes(gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias) -> int:
    """Bytes one expert's packed weights, scales and biases occupy."""
    arrs = (gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias)
    return sum(math.prod(a.shape[1:]) * jnp.dtype(a.dtype).itemsize for a in arrs)
