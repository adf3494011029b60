"""Sliding layers' ring caches (models/kv_cache.py) against dense caches: attention (reference and
the Pallas kernel in interpret mode), the fused rope kernel's writes, kv_rewind, the whole model
(prefill chunks of several sizes, ragged prompts, trees straddling the wrap, rewinds that wrap) and
decode; rings must give the dense caches' numbers to float rounding and the same greedy tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle3_jax.formats.packed_mask import pack_mask
from eagle3_jax.models import GptOssConfig, eagle3, gpt_oss
from eagle3_jax.pallas.attention import attention_pallas, attention_reference, rope_attention, rope_attention_reference
from eagle3_jax.pallas.kv_rewind import kv_rewind_pallas, kv_rewind_reference
from eagle3_jax.spec import decode, generate


def to_ring(dense, lengths, S, rng):
    """dense [B, H, Smax, D] -> a ring of S slots holding each row's last S committed positions; the
    other slots get garbage (finite: masked keys multiply zero weights)."""
    ring = 50 * rng.normal(size=dense.shape[:2] + (S,) + dense.shape[3:]).astype(np.float32)
    for b, n in enumerate(lengths):
        for p in range(max(0, n - S), n):
            ring[b, :, p % S] = dense[b, :, p]
    return ring


def tree(rng, B, N, lengths):
    """Random trees of N nodes: (parents [B, N], depth [B, N], ancestor mask bool [B, N, N], positions)."""
    par = np.full((B, N), -1, np.int32)
    depth = np.zeros((B, N), np.int32)
    anc = np.zeros((B, N, N), bool)
    for b in range(B):
        for i in range(N):
            if i:
                par[b, i] = rng.integers(max(0, i - 3), i)
                depth[b, i] = depth[b, par[b, i]] + 1
                anc[b, i] = anc[b, par[b, i]]
            anc[b, i, i] = True
    return par, depth, anc, np.asarray(lengths)[:, None] + depth


# lengths: shorter than the window, the ring exactly full, wrapped by one, wrapped several times and
# with the new nodes' slots straddling the end of the ring
@pytest.mark.parametrize("lengths", [(3, 12), (5, 13), (14, 40), (27, 61)])
@pytest.mark.parametrize("impl", ["reference", "kernel", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_attention_ring_equals_dense(lengths, impl):
    rng = np.random.default_rng()
    B, Hq, Hkv, D, W, N = 2, 4, 2, 16, 8, 5
    S, Smax = W + N, 72
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    q, k, v = f(B, N, Hq, D), f(B, N, Hkv, D), f(B, N, Hkv, D)
    kd, vd = f(B, Hkv, Smax, D), f(B, Hkv, Smax, D)
    kr, vr = to_ring(kd, lengths, S, rng), to_ring(vd, lengths, S, rng)
    _, _, anc, pos = tree(rng, B, N, lengths)
    args = (jnp.asarray(lengths, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(pack_mask(jnp.asarray(anc))),
            jnp.asarray(f(Hq)))
    want = attention_reference(q, k, v, kd, vd, *args, window=W, scale=0.25)
    if impl == "reference":
        got = attention_reference(q, k, v, kr, vr, *args, window=W, scale=0.25, ring=True)
    else:
        got = attention_pallas(q, k, v, kr, vr, *args, window=W, scale=0.25, ring=True, interpret=impl == "kernel")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("lengths", [(2, 9), (19, 44)])
@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_rope_kernel_writes_the_ring(lengths, interpret):
    """The fused kernel writes the new tokens at positions mod S and attends like the dense reference."""
    rng = np.random.default_rng()
    B, Hq, Hkv, D, W, T = 2, 4, 2, 16, 8, 4
    S, Smax = W + T, 64
    bf = jnp.bfloat16
    f = lambda *s: jnp.asarray(rng.normal(size=s), bf)  # noqa: E731
    qkv, bias = f(B, T, (Hq + 2 * Hkv) * D), f((Hq + 2 * Hkv) * D)
    ang = rng.uniform(0, 6, (B, T, D // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    kd, vd = (np.asarray(f(B, Hkv, Smax, D), np.float32) for _ in range(2))
    kr, vr = (jnp.asarray(to_ring(c, lengths, S, rng), bf) for c in (kd, vd))
    L = jnp.asarray(lengths, jnp.int32)
    pos = L[:, None] + jnp.arange(T)
    sinks = jnp.asarray(rng.normal(size=Hq), jnp.float32)
    kw = dict(num_heads=Hq, num_kv_heads=Hkv, window=W, scale=0.25)
    want, kd2, _ = rope_attention_reference(qkv, bias, cos, sin, jnp.asarray(kd, bf), jnp.asarray(vd, bf), L, pos,
                                            None, sinks, **kw)
    ref, kr_ref, vr_ref = rope_attention_reference(qkv, bias, cos, sin, kr, vr, L, pos, None, sinks, ring=True, **kw)
    got, kr2, vr2 = rope_attention(qkv, bias, cos, sin, jnp.copy(kr), jnp.copy(vr), L, pos, None, sinks, ring=True,
                                   interpret=interpret, **kw)
    # bf16 outputs (|o| up to ~5, where one bf16 step is 0.03): a few steps apart at most
    np.testing.assert_allclose(np.asarray(ref, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=1e-2)
    np.testing.assert_array_equal(np.asarray(kr2, np.float32), np.asarray(kr_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(vr2, np.float32), np.asarray(vr_ref, np.float32))
    for b, n in enumerate(lengths):  # the new tokens sit at their positions mod S, as in the dense cache
        for p in range(n, n + T):
            np.testing.assert_array_equal(np.asarray(kr2[b, :, p % S], np.float32),
                                          np.asarray(kd2[b, :, p], np.float32))
    with pytest.raises(ValueError, match="at most 4 new tokens a call, got 5"):
        rope_attention(jnp.concatenate([qkv, qkv[:, :1]], 1), bias,
                       *(jnp.concatenate([c, c[:, :1]], 1) for c in (cos, sin)),
                       kr, vr, L, jnp.concatenate([pos, pos[:, -1:] + 1], 1), None, sinks, ring=True,
                       interpret=True, **kw)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_kv_rewind_on_rings_and_dense_layers(interpret):
    """One call over a dense layer and a ring layer (different S): the ring's moves wrap."""
    rng = np.random.default_rng()
    B, H, D, N, Smax, S = 3, 2, 16, 7, 48, 11
    # tree: 1, 2 <- 0; 3 <- 1; 4 <- 2; 5 <- 4; 6 <- 3. Accepted paths of 3, 3 and 2 drafts
    path = jnp.asarray([[0, 2, 4, 5], [0, 1, 3, 6], [0, 2, 4, -1]], jnp.int32)
    acc = jnp.asarray([3, 3, 2], jnp.int32)
    lengths = np.array([9, 20, 30])  # slots lengths + node wrap past S for the last two
    dense = [jnp.asarray(rng.normal(size=(B, H, Smax, D)), jnp.float32) for _ in range(2)]
    # the nodes' K/V written at lengths .. + N - 1
    ring = [jnp.asarray(to_ring(np.asarray(c), lengths + N, S, rng)) for c in dense]
    L = jnp.asarray(lengths, jnp.int32)
    dk, dv = kv_rewind_reference((dense[0],), (dense[1],), L, path, acc)
    rk, rv = kv_rewind_reference((ring[0],), (ring[1],), L, path, acc, rings=(True,))
    for d_, r_ in ((dk[0], rk[0]), (dv[0], rv[0])):
        d_, r_ = np.asarray(d_), np.asarray(r_)
        for b, n in enumerate(lengths):
            for p in range(n + int(acc[b]) + 1 - S + N, n + int(acc[b]) + 1):
                np.testing.assert_array_equal(r_[b, :, p % S], d_[b, :, p])
    mixed = (jnp.asarray(dense[0], jnp.bfloat16), jnp.asarray(ring[0], jnp.bfloat16))
    mixed_v = (jnp.asarray(dense[1], jnp.bfloat16), jnp.asarray(ring[1], jnp.bfloat16))
    want = kv_rewind_reference(mixed, mixed_v, L, path, acc, rings=(False, True))
    got = kv_rewind_pallas(mixed, mixed_v, L, path, acc, (False, True), interpret=interpret)  # donated on GPUs
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert int(jnp.max(acc)) >= 2


@pytest.fixture(scope="module")
def tiny():
    return gpt_oss.GptOss(GptOssConfig.preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(3))


def test_init_cache_allocates_rings(tiny):
    cache = gpt_oss.init_cache(tiny, 2, 64, max_step_tokens=5)
    assert cache.rings == (True, False, True, False) and cache.max_len == 64 and cache.max_step_tokens == 5
    assert [k.shape[2] for k in cache.k] == [13, 64, 13, 64]
    dense = gpt_oss.init_cache(tiny, 2, 12, max_step_tokens=5)  # window + 5 > 12: no ring needed
    assert dense.rings == (False,) * 4 and [k.shape[2] for k in dense.k] == [12] * 4
    assert gpt_oss.init_cache(tiny, 1, 4096).nbytes == 2 * 2 * (4096 + 8 + 128) * 2 * 16 * 4


# jitted as decode runs them (eager, each op compiled on its own: 19 s against 8 for the first chunk size)
PREFILL = nnx.jit(gpt_oss.prefill, static_argnames=("chunk", "feature_ids"))
STEP = nnx.jit(gpt_oss.step, static_argnames=("feature_ids",))


@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_model_ring_equals_dense(tiny, chunk):
    """Prefill (prompts shorter and longer than the window, ragged), a tree verify straddling the
    ring's wrap, a rewind, a decode step: logits and features of the ring cache equal the dense cache's."""
    rng = np.random.default_rng()
    B, N, P = 3, 6, 32
    lens = np.array([5, 29, 17])
    prompts = np.zeros((B, P), np.int32)
    for b, n in enumerate(lens):
        prompts[b, :n] = rng.integers(3, 256, n)
    ring = gpt_oss.init_cache(tiny, B, 64, max_step_tokens=N)
    dense = gpt_oss.init_cache(tiny, B, 64, max_step_tokens=64)
    assert ring.rings[0] and not dense.rings[0]
    out = {}
    for name, cache in (("ring", ring), ("dense", dense)):
        cache = jax.tree.map(lambda a: a + 1e3, cache)  # unwritten slots must not be read
        cache, h, feats = PREFILL(tiny, cache, jnp.asarray(prompts), jnp.asarray(lens), chunk=chunk, feature_ids=(1, 3))
        r = np.random.default_rng(5)  # the same tree and tokens for both caches
        par, _, anc, pos = tree(r, B, N, lens)
        toks = jnp.asarray(r.integers(3, 256, (B, N)), jnp.int32)
        logits, f2, cache = STEP(tiny, cache, toks, jnp.asarray(pos, jnp.int32), jnp.asarray(lens, jnp.int32),
                                 pack_mask(jnp.asarray(anc)), feature_ids=(2,))
        # an accepted path along each tree (random draws would rarely match): its moves wrap on the ring
        path = np.zeros((B, 4), np.int32)
        acc = np.zeros(B, np.int32)
        for b in range(B):
            node = N - 1 - b
            chain = [node]
            while par[b, chain[-1]] > 0:
                chain.append(int(par[b, chain[-1]]))
            chain = chain[::-1][:3]
            acc[b] = len(chain)
            path[b, 1:1 + len(chain)] = chain
        acc = jnp.asarray(acc)
        path = jnp.asarray(path)
        k, v = kv_rewind_reference(cache.k, cache.v, jnp.asarray(lens, jnp.int32), path, acc, cache.rings)
        cache = cache.replace(k=k, v=v)
        L2 = jnp.asarray(lens, jnp.int32) + acc + 1
        nxt = jnp.asarray(r.integers(3, 256, (B, 1)), jnp.int32)
        logits2, _, _ = STEP(tiny, cache, nxt, L2[:, None], L2)
        valid = np.arange(P)[None, :, None] < lens[:, None, None]  # padding positions' features are scratch
        out[name] = [np.asarray(x) for x in (h, np.where(valid, feats, 0), logits, f2, logits2)]
    for a, b in zip(out["ring"], out["dense"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_step_longer_than_the_ring_raises(tiny):
    cache = gpt_oss.init_cache(tiny, 1, 64, max_step_tokens=4)
    t = jnp.zeros((1, 5), jnp.int32)
    with pytest.raises(ValueError, match=r"5 tokens a step.*max_step_tokens=4.*max_step_tokens=5\)"):
        gpt_oss.step(tiny, cache, t, jnp.arange(5)[None] + 20, jnp.asarray([20]))


@pytest.mark.slow
def test_decode_with_windowed_draft_and_rings_is_lossless(tiny):
    """Greedy decode (a windowed draft: its cache a ring too) equals generate over long outputs that
    wrap every ring several times; a tree and a chain."""
    from test_decode import draft_config
    draft = eagle3.Eagle3(draft_config(sliding_window=6, target_num_layers=tiny.config.num_hidden_layers),
                          dtype=jnp.float32, rngs=nnx.Rngs(4))
    assert eagle3.init_cache(draft, 1, 64, max_step_tokens=4).rings == (True,)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 256, n).tolist() for n in (4, 23, 11)]
    want = generate(tiny, prompts, 40, eos_ids=(), prefill_chunk=16).tokens
    for kw in (dict(num_spec_tokens=3), dict(num_spec_tokens=3, branching=3, num_draft_tokens=7)):
        assert decode(tiny, draft, prompts, 40, eos_ids=(), prefill_chunk=16, **kw).tokens == want, kw


@pytest.mark.gpu
@pytest.mark.parametrize("B,Nq", [(1, 1), (4, 1), (1, 16), (4, 16)])
def test_kernels_on_gpt_oss_ring_shapes_gpu(B, Nq):
    """gpt-oss-120b's sliding layers (64 / 8 heads, D 64, window 128, a ring of 256 slots), bf16,
    contexts past several wraps: the compiled kernels against the ring reference."""
    rng = np.random.default_rng()
    Hq, Hkv, D, W, S = 64, 8, 64, 128, 256
    bf = jnp.bfloat16
    lengths = rng.integers(3 * S, 4 * S, B)
    f = lambda *s: jnp.asarray(rng.normal(size=s), bf)  # noqa: E731
    qkv, bias = f(B, Nq, (Hq + 2 * Hkv) * D), f((Hq + 2 * Hkv) * D)
    ang = rng.uniform(0, 6, (B, Nq, D // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    kr, vr = f(B, Hkv, S, D), f(B, Hkv, S, D)
    L = jnp.asarray(lengths, jnp.int32)
    par, _, anc, pos = tree(rng, B, Nq, lengths)
    mask = pack_mask(jnp.asarray(anc)) if Nq > 1 else None
    pos = jnp.asarray(pos if Nq > 1 else lengths[:, None], jnp.int32)
    sinks = jnp.asarray(rng.normal(size=Hq), jnp.float32)
    kw = dict(num_heads=Hq, num_kv_heads=Hkv, window=W, scale=D ** -0.5, ring=True)
    ref, kref, vref = rope_attention_reference(qkv, bias, cos, sin, kr, vr, L, pos, mask, sinks, **kw)
    got, k2, v2 = rope_attention(qkv, bias, cos, sin, jnp.copy(kr), jnp.copy(vr), L, pos, mask, sinks, **kw)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=1e-2)
    np.testing.assert_array_equal(np.asarray(k2, np.float32), np.asarray(kref, np.float32))
    np.testing.assert_array_equal(np.asarray(v2, np.float32), np.asarray(vref, np.float32))


@pytest.mark.gpu
def test_model_ring_equals_dense_bf16_gpu():
    """The tiny model in bf16 on a GPU (the fused rope kernel writes the rings): prefill, a tree
    verify across the wrap and a decode step give the dense caches' logits to bf16 rounding."""
    model = gpt_oss.GptOss(GptOssConfig.preset("tiny"), dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(1)
    B, N, P = 2, 6, 32
    lens = np.array([29, 11])
    prompts = jnp.asarray(rng.integers(3, 256, (B, P)), jnp.int32)
    par, _, anc, pos = tree(rng, B, N, lens)
    toks = jnp.asarray(rng.integers(3, 256, (B, N)), jnp.int32)
    out = {}
    for name, m in (("ring", N), ("dense", 64)):
        cache = gpt_oss.init_cache(model, B, 64, max_step_tokens=m)
        cache, _, _ = gpt_oss.prefill(model, cache, prompts, jnp.asarray(lens), chunk=16)
        logits, _, cache = gpt_oss.step(model, cache, toks, jnp.asarray(pos, jnp.int32), jnp.asarray(lens, jnp.int32),
                                        pack_mask(jnp.asarray(anc)))
        L2 = jnp.asarray(lens + 1, jnp.int32)
        logits2, _, _ = gpt_oss.step(model, cache, toks[:, 1:2], L2[:, None], L2)
        out[name] = np.concatenate([np.asarray(logits), np.asarray(logits2)], 1)
    scale = np.abs(out["dense"]).max()
    assert np.abs(out["ring"] - out["dense"]).max() < 3e-2 * scale
