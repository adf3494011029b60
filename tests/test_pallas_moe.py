"""MXFP4 expert kernel (eagle3_jax/pallas/moe.py) against its jnp reference.

CPU: the kernels run in interpret mode, which fills every output with NaN before the grid runs
(poisoned outputs: an element no program writes fails the comparison). GPU (`-m gpu` or any run on
a CUDA machine): the Triton kernels at the gpt-oss hidden sizes, every decoder.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import dequantize_mxfp4_np

from eagle3_jax.formats import mxfp4
from eagle3_jax.pallas import moe, select

LIMIT, ALPHA = 7.0, 1.702


def _experts(rng, E, H, I, scale_lo=118, scale_hi=124):
    def packed(rows, fan_in):
        g = fan_in // 32
        return (jnp.asarray(rng.integers(0, 256, (E, rows, g, 16), dtype=np.uint8)),
                jnp.asarray(rng.integers(scale_lo, scale_hi, (E, rows, g), dtype=np.uint8)))

    gub, gus = packed(2 * I, H)
    dnb, dns = packed(H, I)
    gubias = jnp.asarray(rng.normal(0, 0.5, (E, 2 * I)), jnp.bfloat16)
    dnbias = jnp.asarray(rng.normal(0, 0.5, (E, H)), jnp.bfloat16)
    return gub, gus, gubias, dnb, dns, dnbias


def _routing(rng, T, E, k, pool=None):
    """Distinct experts per token, drawn from `pool` experts (a small pool forces sharing)."""
    pool = E if pool is None else pool
    ids = np.stack([rng.permutation(pool)[:k] for _ in range(T)]).astype(np.int32)
    w = jax.nn.softmax(jnp.asarray(rng.normal(size=(T, k)), jnp.float32), axis=-1)
    return jnp.asarray(ids), w


def _case(seed, T, E, H, I, k=4, pool=None, x_std=1.0):
    rng = np.random.default_rng(seed)
    experts = _experts(rng, E, H, I)
    x = jnp.asarray(rng.normal(0, x_std, (T, H)), jnp.bfloat16)
    ids, w = _routing(rng, T, E, k, pool)
    return (x, ids, w) + experts


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _check(args, config=None, interpret=True, tol=2e-3):
    ref = moe.mxfp4_moe_reference(*args, limit=LIMIT, alpha=ALPHA)
    out = moe.mxfp4_moe(*args, limit=LIMIT, alpha=ALPHA, config=config, interpret=interpret)
    out = np.asarray(out)
    assert out.shape == ref.shape and out.dtype == np.float32
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    err = _rel(out, ref)
    assert err < tol, err
    return err


def test_dequantize_every_byte_and_scale():
    # every byte value under every scale byte whose results are normal f32 values, against float64;
    # scale byte 255 (E8M0's NaN) gives NaN; bf16 holds the same values exactly
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (250, 1, 1))  # [250, 16 groups, 16]
    scales = np.repeat(np.arange(3, 253, dtype=np.uint8)[:, None], 16, axis=1)
    want = dequantize_mxfp4_np(blocks, scales)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = moe.dequantize(jnp.asarray(blocks), jnp.asarray(scales), dtype)
        assert got.dtype == dtype and got.shape == (250, 16 * 32)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32), np.float64), want)
    assert np.isnan(np.asarray(moe.dequantize(jnp.asarray(blocks[:1]), jnp.full((1, 16), 255, jnp.uint8)),
                               np.float32)).all()


def test_decoders_match_dequantize():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (5, 3, 8, 16), dtype=np.uint8)
    scales = rng.integers(35, 161, (5, 3, 8), dtype=np.uint8)
    ref = np.asarray(moe.dequantize(jnp.asarray(blocks), jnp.asarray(scales), jnp.float32))
    words = moe._as_words(jnp.asarray(blocks))  # [5, 3, 8, 4]
    for r in range(5):
        got = moe._interleaved(moe._decode_f16(words[r], jnp.asarray(scales[r])))
        got = np.asarray(got.astype(jnp.float32), np.float64)
        np.testing.assert_array_equal(got * 2.0 ** 32, ref[r].reshape(3, -1))


def test_fma_decoder_matches_dequantize():
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (5, 3, 8, 16), dtype=np.uint8)
    ref = np.asarray(moe.dequantize(jnp.asarray(blocks), jnp.full((5, 3, 8), 127, jnp.uint8), jnp.float32))
    words = jax.lax.bitcast_convert_type(moe._as_words(jnp.asarray(blocks)), jnp.int32)
    parts = np.stack([np.asarray(moe._raw_f16(words, i)) for i in range(8)], -1)  # [.., 4, 8]
    np.testing.assert_array_equal(parts.reshape(ref.shape) * 2.0 ** 14, ref)


def _run_ptx(asm, args, n_out):
    """A small interpreter for the PTX subset `_group_dot_asm` emits (b32 logic and shifts, prmt with a
    zero second operand, f16x2 mul / fma / add, f16 -> f32): returns the n_out f32 results."""
    reg = {f"${i + n_out}": np.uint32(a) for i, a in enumerate(args)}
    reg["0"] = np.uint32(0)

    def val(tok):
        return reg[tok] if tok in reg else np.uint32(int(tok, 16) if tok.startswith("0x") else int(tok))

    def halves(v):
        return np.array([int(v) & 0xFFFF, int(v) >> 16], np.uint16).view(np.float16).astype(np.float64)

    def pack(h):  # float64 pair -> f16x2 bits, rounded once
        return np.uint32(int.from_bytes(np.asarray(h, np.float16).tobytes(), "little"))

    for line in asm.split("\n"):
        op, _, rest = line.rstrip(";").partition(" ")
        if op in ("{", "}", ".reg"):
            continue
        if op == "mov.b32":  # mov.b32 {lo, hi}, a
            lo, hi = halves(reg[rest.split("}, ")[1]])
            reg["lo"], reg["hi"] = lo, hi
            continue
        d, *src = [t.strip() for t in rest.split(",")]
        if op == "cvt.f32.f16":
            reg[d] = reg[src[0]]
        elif op == "add.f32":
            reg[d] = np.float32(np.float32(reg[src[0]]) + np.float32(reg[src[1]]))
        elif op.endswith("f16x2"):
            a, b = halves(reg[src[0]]), halves(reg[src[1]])
            c = halves(reg[src[2]]) if op.startswith("fma") else 0.0
            reg[d] = pack(a + b if op.startswith("add") else a * b + c)
        elif op == "prmt.b32":
            data, sel = int(val(src[0])).to_bytes(4, "little") + bytes(4), int(val(src[2]))
            reg[d] = np.uint32(int.from_bytes(bytes(data[(sel >> 4 * i) & 7] for i in range(4)), "little"))
        else:
            a, b = int(val(src[0])), int(val(src[1]))
            f = {"and.b32": lambda: a & b, "or.b32": lambda: a | b, "shr.b32": lambda: a >> b,
                 "shl.b32": lambda: (a << b) & 0xFFFFFFFF}[op]
            reg[d] = np.uint32(f())
    return [float(reg[f"${t}"]) for t in range(n_out)]


@pytest.mark.parametrize("nt", [1, 2])
def test_group_dot_asm_interpreted(nt):
    # the FMA path's PTX block (GPU only) run by a PTX interpreter on random nibbles (both signs, zero
    # and -0, the subnormal 0.5) and small-integer activations, whose group sums are exact in f16
    rng = np.random.default_rng(nt)
    for _ in range(20):
        words = rng.integers(0, 2 ** 32, 4, dtype=np.uint64).astype(np.uint32)
        x = rng.integers(-8, 9, (nt, 32)).astype(np.float64)  # x' of one scale group per token
        pairs = []
        for t in range(nt):
            for k in range(4):
                for q in range(4):
                    lo, hi = x[t, 8 * q + 3 - k], x[t, 8 * q + 7 - k]
                    pairs.append(int.from_bytes(np.array([lo, hi], np.float16).tobytes(), "little"))
        nib = np.array([(int(words[i // 8]) >> 4 * (i % 8)) & 0xF for i in range(32)])
        prod = x * (mxfp4.E2M1[nib].astype(np.float64) * 2.0 ** -14)  # [nt, 32]
        np.testing.assert_array_equal(_run_ptx(moe._group_dot_asm(nt), [*words, *pairs], nt), prod.sum(1))
        if nt == 1:  # per word: the sums over inputs 8q .. 8q + 7
            got = _run_ptx(moe._group_dot_asm(1, per_word=True), [*words, *pairs], 4)
            np.testing.assert_array_equal(got, prod.reshape(4, 8).sum(1))


def test_f16_pairs_layout_round_trips():
    # the FMA path's activation layout: word [g, k, q] = (x[32g + 8q + 3 - k], x[32g + 8q + 7 - k]) as
    # f16 times 2^(14 - e_g), factor bits 2^e_g at [g, 4, 0]; bf16 groups from 2^-90 to 2^100 and a
    # zero group come back exactly
    rng = np.random.default_rng(3)
    scales = 2.0 ** np.array([-90, -3, 0, 7, 100, 0])
    x = rng.normal(size=(2, 6, 32)) * scales[None, :, None]
    x[:, 5] = 0.0
    x = np.asarray(jnp.asarray(x.reshape(2, 192), jnp.bfloat16).astype(jnp.float32), np.float64)
    words = np.asarray(moe.f16_pairs(jnp.asarray(x, jnp.float32)))  # [2, 6, 5, 4] uint32
    assert words.shape == (2, 6, 5, 4) and words.dtype == np.uint32
    factor = words[:, :, 4, 0].view(np.float32).astype(np.float64)
    assert (words[:, :, 4, 1:] == 0).all()
    halves = words[:, :, :4, :].astype(np.uint32)
    lo = (halves & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (halves >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    back = np.zeros((2, 6, 32))
    for k in range(4):
        for q in range(4):
            back[:, :, 8 * q + 3 - k] = lo[:, :, k, q]
            back[:, :, 8 * q + 7 - k] = hi[:, :, k, q]
    back = back * factor[..., None] * 2.0 ** -14
    np.testing.assert_array_equal(back.reshape(2, 192), x)
    assert (np.abs(lo) < 2 ** 14).all() and (np.abs(hi) < 2 ** 14).all()


@pytest.mark.parametrize("fma", [0, 2])
def test_interpret_units_not_a_multiple_of_the_k_step(fma):
    # a device's share of every expert under parallel's units split is any whole number of 32-input
    # groups (gpt-oss-120b over 4 devices: 736 = 23 groups, not a multiple of the default 4-group K
    # step): I = 96 is 3 groups, the down projection's K step 2 groups, its last step partial
    cfg = moe.MoeConfig(block_i=32, block_h=64, groups=2, fma_tokens=fma, fma_groups=2)
    _check(_case(40 + fma, 5, E=12, H=64, I=96), cfg)
    grouped = moe.GroupedConfig(block_i=64, block_h=32, groups=2)  # 96 = 1.5 blocks of act columns
    _check_grouped(_grouped_case(41 + fma, 16, [0, 3, 1, 2], 3, E=4, H=64, I=96), 3, grouped)


@pytest.mark.parametrize("T,seed,fma", [(1, 0, 0), (1, 0, 2), (3, 1, 2), (16, 2, 0), (21, 3, 2)])
def test_interpret_random_routing(T, seed, fma):
    # 12 experts, 4 per token: experts are shared between tokens; H = 96 is 3 scale groups (not a
    # multiple of the 2-group K step), I = 64 is 2; T = 21 is two token chunks, the second partial.
    # fma = 0: every expert on the tensor-core path; 2: experts of one or two tokens on the FMA path.
    cfg = moe.MoeConfig(block_i=32, block_h=64, groups=2, fma_tokens=fma, fma_groups=2)
    _check(_case(seed, T, E=12, H=96, I=64), cfg)


@pytest.mark.parametrize("fma,groups", [(1, 4), (3, 2)])
def test_interpret_fma_and_mma_experts_mixed(fma, groups):
    # 16 tokens over 40 experts: experts of 1..5 tokens, so both paths run in one call and write the
    # same output; H = 160 is 5 scale groups (a partial FMA K step)
    args = _case(13, 16, E=40, H=160, I=64)
    counts = np.bincount(np.asarray(args[1]).ravel(), minlength=40)
    assert (counts[counts > 0] <= fma).any() and (counts > fma).any()
    _check(args, moe.MoeConfig(block_i=32, block_h=32, groups=2, fma_tokens=fma, fma_groups=groups))


def test_interpret_all_tokens_same_experts():
    # every token picks the same 4 experts (in different orders): each expert has 20 tokens (two
    # chunks), 76 of the 80 pairs are duplicates that must not add their expert again.
    args = _case(7, 20, E=6, H=64, I=96, pool=4)
    _check(args, moe.MoeConfig(block_i=64, block_h=32, groups=4, prefetch=1, fma_tokens=4))


def test_interpret_fresh_inputs_same_executable():
    # loads reach past the last K step on both paths
    cfg = moe.MoeConfig(block_i=32, block_h=32, groups=2, prefetch=5, fma_groups=2, fma_prefetch=3)
    errs = [_check(_case(seed, 5, E=8, H=64, I=64), cfg) for seed in (10, 11, 12)]
    assert max(errs) < 2e-3


def _skipping(args, seed):
    """args with about half the pairs' ids set to -1 (experts held by other devices), and the same
    call with those pairs' true ids and zero weights: what the skipping call must equal."""
    x, ids, w, *experts = args
    skip = np.random.default_rng(seed).random(ids.shape) < 0.5
    skip[0] = len(skip) > 1  # a token with no pair at all (where another token is left to compare)
    skip[-1, 0] = False
    return (x, jnp.where(skip, -1, ids), w, *experts), (x, ids, jnp.where(skip, 0.0, w), *experts)


@pytest.mark.parametrize("fma", [0, 64])
def test_interpret_negative_ids_skip_pairs(fma):
    # both paths (fma 0: tensor cores only; 64: the FMA path) drop pairs whose id is negative
    skipping, zeroed = _skipping(_case(21, 6, E=8, H=64, I=64), 3)
    cfg = moe.MoeConfig(block_i=32, block_h=32, groups=2, fma_tokens=fma, fma_groups=2)
    out = moe.mxfp4_moe(*skipping, limit=LIMIT, alpha=ALPHA, config=cfg, interpret=True)
    ref = moe.mxfp4_moe_reference(*zeroed, limit=LIMIT, alpha=ALPHA)
    assert np.isfinite(np.asarray(out)).all() and _rel(out, ref) < 2e-3
    np.testing.assert_array_equal(np.asarray(out)[0], 0.0)
    np.testing.assert_allclose(moe.mxfp4_moe_reference(*skipping, limit=LIMIT, alpha=ALPHA), ref, rtol=1e-6)


@pytest.mark.parametrize("fma", [0, 64])
def test_interpret_down_bias_flag(fma):
    # down_bias_on (traced, as under shard_map): False adds no b2 on either path, True the usual output
    args = _case(23, 5, E=8, H=64, I=64)
    cfg = moe.MoeConfig(block_i=32, block_h=32, groups=2, fma_tokens=fma, fma_groups=2)
    run = jax.jit(lambda on, *a: moe.mxfp4_moe(*a, limit=LIMIT, alpha=ALPHA, config=cfg, interpret=True,
                                              down_bias_on=on))
    off, on = np.asarray(run(jnp.bool_(False), *args)), np.asarray(run(jnp.bool_(True), *args))
    plain = np.asarray(moe.mxfp4_moe(*args, limit=LIMIT, alpha=ALPHA, config=cfg, interpret=True))
    np.testing.assert_array_equal(on, plain)
    unbiased = args[:-1] + (jnp.zeros_like(args[-1]),)
    ref = moe.mxfp4_moe_reference(*unbiased, limit=LIMIT, alpha=ALPHA)
    assert np.isfinite(off).all() and _rel(off, ref) < 2e-3
    assert _rel(off, plain) > 0.01  # the bias mattered
    np.testing.assert_array_equal(moe.mxfp4_moe_reference(*args, limit=LIMIT, alpha=ALPHA, down_bias_on=False), ref)


@pytest.mark.parametrize("tiles", [dict(fma_block_i=16, fma_block_h=16),
                                   dict(fma_block_i=32, fma_block_h=32, fma_groups=4)])
def test_interpret_fma_tiles(tiles):
    # other FMA tilings: 16 or 32 act columns a gate_up program (two or four 8-column blocks of the
    # pair layout), 16 or 32 outputs a down program; 9 tokens over 10 experts share them
    _check(_case(17, 9, E=10, H=96, I=64), moe.MoeConfig(**tiles))


def test_interpret_fma_down_groups():
    # down's K step apart from gate_up's: H = 160 (5 groups) in 2 steps of 4 (the last partial), I = 96
    # (3 groups) in 3 steps of 1
    _check(_case(29, 6, E=10, H=160, I=96), moe.MoeConfig(fma_groups=4, fma_down_groups=1))


def test_config_for_shares():
    # a device's share of gpt-oss's 2880 units takes its measured config; whole experts the default
    assert moe.config_for(2880) is moe.DEFAULT_CONFIG
    assert moe.config_for(736) == moe.SHARE_CONFIGS[0][1] and moe.config_for(1472) == moe.SHARE_CONFIGS[1][1]
    assert [most for most, _ in moe.SHARE_CONFIGS] == sorted(most for most, _ in moe.SHARE_CONFIGS)
    assert all(most < 2880 for most, _ in moe.SHARE_CONFIGS)


def test_interpret_tiny_and_unclamped_act():
    # act's factors follow its 8-column blocks: gate_up weights near 2^-90 (act near 2^-85) and an
    # infinite limit (act unbounded) both come through the FMA path
    rng = np.random.default_rng(19)
    E, H, I, T = 8, 64, 64, 3
    gub, gus, _, dnb, dns, dnbias = _experts(rng, E, H, I, scale_lo=36, scale_hi=45)
    x = jnp.asarray(rng.normal(0, 1, (T, H)), jnp.bfloat16)
    ids, w = _routing(rng, T, E, 4)
    tiny = (x, ids, w, gub, gus, jnp.zeros((E, 2 * I), jnp.bfloat16), dnb, dns + 110, dnbias * 0)
    _check(tiny, moe.MoeConfig(fma_groups=2))
    big = _case(23, T, E=8, H=64, I=64, x_std=30.0)
    ref = moe.mxfp4_moe_reference(*big, limit=float("inf"), alpha=ALPHA)
    out = moe.mxfp4_moe(*big, limit=float("inf"), alpha=ALPHA, config=moe.MoeConfig(fma_groups=2), interpret=True)
    assert np.isfinite(np.asarray(out)).all() and _rel(out, ref) < 2e-3


def _grouped_case(seed, tm, tile_expert, num_live, E, H, I):
    """Tiles of tm rows for `mxfp4_moe_grouped`: live tiles get random rows (the last live tile's tail
    zero rows of weight 0: padding), dead tiles random rows that must not matter."""
    rng = np.random.default_rng(seed)
    experts = _experts(rng, E, H, I)
    n = len(tile_expert)
    x = rng.normal(0, 1, (n, tm, H))
    w = rng.random((n, tm))
    x[num_live - 1, tm // 2:] = 0
    w[num_live - 1, tm // 2:] = 0
    return (jnp.asarray(x, jnp.bfloat16), jnp.asarray(tile_expert, jnp.int32), jnp.int32(num_live),
            jnp.asarray(w, jnp.float32)) + experts


def _check_grouped(args, num_live, config=None, interpret=True, tol=2e-3):
    x, te, _, w, *experts = args
    n, tm, H = x.shape
    got = np.asarray(moe.mxfp4_moe_grouped(*args, limit=LIMIT, alpha=ALPHA, config=config, interpret=interpret))
    assert got.shape == (n, tm, H) and got.dtype == np.float32
    live = slice(0, num_live * tm)
    ids = jnp.repeat(te[:num_live], tm)[:, None]
    ref = moe.mxfp4_moe_reference(x.reshape(-1, H)[live], ids, w.reshape(-1, 1)[live], *experts,
                                  limit=LIMIT, alpha=ALPHA)
    got = got.reshape(-1, H)[live]
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    err = _rel(got, ref)
    assert err < tol, err
    return err


@pytest.mark.parametrize("tm,seed", [(16, 0), (32, 1)])
def test_interpret_grouped_tiles(tm, seed):
    # 6 tiles over 5 experts: expert 3 spans tiles 1 and 2, tile 4 is the last live one (half padding),
    # tile 5 is dead; H = 96 is 3 scale groups (not a multiple of the 2-group K step), I = 160 is 5
    # groups and not a multiple of the output blocks either
    cfg = moe.GroupedConfig(block_i=16 * 128 // tm, block_h=32 * 128 // tm, groups=2, prefetch=2)
    _check_grouped(_grouped_case(seed, tm, [0, 3, 3, 1, 4, 2], 5, E=5, H=96, I=160), 5, cfg)


def test_interpret_model_grouped_path_uses_kernel():
    # the model's grouped path through the kernels agrees with its gathered path: 300 tokens on 6
    # experts, most on experts 0..3, so that experts span several tiles of 128 rows
    from flax import nnx

    from eagle3_jax.models import GptOssConfig, gpt_oss

    cfg = GptOssConfig.preset("gpt-oss-120b").replace(hidden_size=64, intermediate_size=64, num_local_experts=6)
    layer = gpt_oss.MoE(cfg, jnp.bfloat16, nnx.Rngs(3))
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(300, 64)), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((300, 6)) + np.array([0, 0, 0, 0, 0.6, 0.9]), axis=1)[:, :4], jnp.int32)
    w = jax.nn.softmax(jnp.asarray(rng.normal(size=(300, 4)), jnp.float32), axis=-1)
    # jitted: one program each (eager, ~170 ops compile one by one)
    got = nnx.jit(lambda m, *a: m._grouped(*a, select.KernelPolicy(interpret=True)))(layer, x, ids, w)
    ref = nnx.jit(lambda m, *a: m._gathered(*a))(layer, x, ids, w)
    assert np.isfinite(np.asarray(got)).all() and _rel(got, ref) < 2e-3
    # pairs with id -1 (experts held by another device) get no tile: as the same pairs with weight 0
    skip = jnp.asarray(rng.random(ids.shape) < 0.4)
    got = nnx.jit(lambda m, *a: m._grouped(*a, select.KernelPolicy(interpret=True)))(
        layer, x, jnp.where(skip, -1, ids), w)
    ref = nnx.jit(lambda m, *a: m._gathered(*a))(layer, x, ids, jnp.where(skip, 0.0, w))
    assert np.isfinite(np.asarray(got)).all() and _rel(got, ref) < 2e-3
    scan = nnx.jit(lambda m, *a: m._grouped(*a, select.KernelPolicy(moe_grouped="scan")))(
        layer, x, jnp.where(skip, -1, ids), w)
    assert _rel(scan, ref) < 2e-3


def test_rejects_bad_input():
    args = _case(0, 2, E=4, H=64, I=64)
    with pytest.raises(ValueError, match="tokens"):
        big = (jnp.zeros((65, 64), jnp.bfloat16), jnp.zeros((65, 4), jnp.int32), jnp.zeros((65, 4))) + args[3:]
        moe.mxfp4_moe(*big, limit=LIMIT, alpha=ALPHA, interpret=True)
    with pytest.raises(ValueError, match="do not fit"):
        moe.mxfp4_moe(args[0][:, :32], *args[1:], limit=LIMIT, alpha=ALPHA, interpret=True)
    with pytest.raises(ValueError, match="decode"):
        moe.mxfp4_moe(*args, limit=LIMIT, alpha=ALPHA, config=moe.MoeConfig(decode="nope"), interpret=True)
    with pytest.raises(ValueError, match="fma_prefetch >= 0"):
        moe.mxfp4_moe(*args, limit=LIMIT, alpha=ALPHA, config=moe.MoeConfig(fma_prefetch=-1), interpret=True)
    with pytest.raises(ValueError, match="powers of two"):
        moe.mxfp4_moe(*args, limit=LIMIT, alpha=ALPHA, config=moe.MoeConfig(fma_down_groups=3), interpret=True)
    g = _grouped_case(0, 16, [0, 1], 2, E=4, H=64, I=64)
    with pytest.raises(ValueError, match="do not fit"):
        moe.mxfp4_moe_grouped(g[0][:, :, :32], *g[1:], limit=LIMIT, alpha=ALPHA, interpret=True)
    with pytest.raises(ValueError, match="do not fit"):  # tiles of 12 rows: not a power of two
        moe.mxfp4_moe_grouped(g[0][:, :12], g[1], g[2], g[3][:, :12], *g[4:], limit=LIMIT, alpha=ALPHA, interpret=True)
    with pytest.raises(ValueError, match="fma_block_i 8, 16"):  # FMA act words are written 8 columns at a time
        moe.mxfp4_moe(*args, limit=LIMIT, alpha=ALPHA, config=moe.MoeConfig(fma_block_i=4), interpret=True)


# -- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("decode", ["ptx", "bits", "f16", "ptx/fma0", "bits/fma16", "ptx/fma3"])
@pytest.mark.parametrize("T", [1, 5, 16, 64])
def test_gpu_matches_reference(decode, T):
    # gpt-oss sizes (H = I = 2880), 16 experts so that tokens share them; fma0: tensor cores only,
    # fma16: every expert of up to 16 tokens on the FMA path
    dec, _, variant = decode.partition("/")
    cfg = moe.MoeConfig(decode=dec, fma_tokens=int(variant[3:]) if variant.startswith("fma") else 2)
    for seed in (T, T + 100):  # fresh inputs through the same executable
        _check(_case(seed, T, E=16, H=2880, I=2880), cfg, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("I", [1440, 736])
@pytest.mark.parametrize("T", [1, 16])
def test_gpu_units_split_widths(I, T):
    # each device's share of every expert under parallel's units split (the default on a mesh):
    # gpt-oss-120b's 2880 units over 2 devices, and over 4 padded to 2944 (23 groups a device);
    # the decode kernel and the grouped kernel at those widths against the references
    for seed in (T, T + 100):
        _check(_case(seed, T, E=16, H=2880, I=I), interpret=False)
    _check_grouped(_grouped_case(T, 64, [0, 3, 3, 1, 4, 2, 0], 6, E=5, H=2880, I=I), 6, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16])
def test_gpu_negative_ids_skip_pairs(T):
    skipping, zeroed = _skipping(_case(T + 7, T, E=16, H=2880, I=2880), T)
    out = moe.mxfp4_moe(*skipping, limit=LIMIT, alpha=ALPHA)
    ref = moe.mxfp4_moe_reference(*zeroed, limit=LIMIT, alpha=ALPHA)
    assert np.isfinite(np.asarray(out)).all() and _rel(out, ref) < 2e-3
    if T > 1:
        np.testing.assert_array_equal(np.asarray(out)[0], 0.0)


@pytest.mark.gpu
def test_gpu_extreme_scales_and_tiles():
    # gate_up scale bytes 36..44 (weights near 2^-90, subnormal steps in the decoders), down scale
    # bytes 150..158, and tiles that do not divide the sizes
    rng = np.random.default_rng(5)
    E, H, I, T = 8, 2880, 2880, 7
    gub, gus, gubias, _, _, _ = _experts(rng, E, H, I, scale_lo=36, scale_hi=45)
    _, _, _, dnb, dns, dnbias = _experts(rng, E, H, I, scale_lo=150, scale_hi=159)
    x = jnp.asarray(rng.normal(0, 1, (T, H)), jnp.bfloat16)
    ids, w = _routing(rng, T, E, 4)
    args = (x, ids, w, gub, gus, gubias * 0, dnb, dns, dnbias * 0)
    for decode, fma in (("ptx", 64), ("ptx", 0), ("bits", 0), ("f16", 0)):
        _check(args, moe.MoeConfig(block_i=128, block_h=128, groups=8, decode=decode, fma_tokens=fma), interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["fma_block_i=16/fma_block_h=16/fma_warps=2",
                                   "fma_block_i=32/fma_block_h=32/fma_groups=32"])
@pytest.mark.parametrize("T", [3, 64])
def test_gpu_fma_tiles(tiles, T):
    # the FMA path's other tilings, 16 experts (T=64: about 16 pairs an expert, each its own pass)
    cfg = moe.MoeConfig(**{k: int(v) for k, v in (kv.split("=") for kv in tiles.split("/"))})
    _check(_case(T + 7, T, E=16, H=2880, I=2880), cfg, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 16, 40])
def test_gpu_model_moe_uses_kernel(T):
    # the model's MoE (random MXFP4 experts, gpt-oss hidden sizes, 16 experts) routes few bf16
    # tokens through the kernels on a GPU (norm and router: pallas/moe_route.py); it agrees with its
    # gathered jnp path, with and without the norm
    from flax import nnx

    from eagle3_jax.models import GptOssConfig, gpt_oss

    cfg = GptOssConfig.preset("gpt-oss-120b").replace(num_local_experts=16)
    layer = gpt_oss.MoE(cfg, jnp.bfloat16, nnx.Rngs(T))
    norm = gpt_oss.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.scale[...] = jax.random.uniform(jax.random.key(T + 1), (cfg.hidden_size,), minval=0.5, maxval=2.0)
    x = jax.random.normal(jax.random.key(T), (T, cfg.hidden_size), jnp.bfloat16) * 4
    assert select.moe(x, num_experts=16, top_k=cfg.num_experts_per_tok, packed=True) == "kernel"
    for nm in (None, norm):
        got = jax.jit(lambda m, v: m(v, norm=nm))(layer, x)
        ref = jax.jit(lambda m, v: m(v, path="gathered", norm=nm))(layer, x)
        assert _rel(got.astype(jnp.float32), ref.astype(jnp.float32)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tm", [64, 128, 256])
def test_gpu_grouped_tiles(tm):
    # gpt-oss sizes (H = I = 2880), 7 tiles over 5 experts (expert 3 over two tiles), one dead tile
    _check_grouped(_grouped_case(tm, tm, [0, 3, 3, 1, 4, 2, 0], 6, E=5, H=2880, I=2880), 6, interpret=False)


@pytest.mark.gpu
def test_gpu_model_grouped_path_uses_kernel():
    # prefill-sized calls (300 tokens, 32 experts at gpt-oss sizes) take the grouped path through the
    # kernels on a GPU; they agree with the grouped path's scan (each tile's expert dequantized in XLA)
    from flax import nnx

    from eagle3_jax.models import GptOssConfig, gpt_oss

    cfg = GptOssConfig.preset("gpt-oss-120b").replace(num_local_experts=32)
    layer = gpt_oss.MoE(cfg, jnp.bfloat16, nnx.Rngs(5))
    x = jax.random.normal(jax.random.key(np.random.randint(1 << 30)), (300, cfg.hidden_size), jnp.bfloat16)
    assert select.moe(x, num_experts=32, top_k=cfg.num_experts_per_tok, packed=True) == "grouped"
    got = jax.jit(lambda m, v: m(v, dtype=jnp.float32))(layer, x)
    ids, w = layer.route(x)
    ref = jax.jit(lambda m, v, i, u: m._grouped(v, i, u, select.KernelPolicy(moe_grouped="scan")))(layer, x, ids, w)
    assert _rel(got, ref) < 2e-3
