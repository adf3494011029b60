"""Tree / prefix attention kernel (eagle3_jax/pallas/attention.py) against its jnp reference.

CPU: the Pallas kernel in interpret mode on fresh random inputs (outputs start as NaN in interpret
mode, so an unwritten element fails), with the cache's scratch slots (>= lengths) poisoned with huge
values that would dominate the result if they were read. GPU (@pytest.mark.gpu): the compiled kernel.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.formats.packed_mask import mask_words
from eagle3_jax.pallas import attention_mosaic as mosaic
from eagle3_jax.pallas import select
from eagle3_jax.pallas.attention import (
    attention,
    attention_pallas,
    attention_reference,
    rope_attention,
    rope_attention_reference,
)
from eagle3_jax.pallas.tree_mask import tree_mask_reference

TOL = 1.5e-2
_tree_ref = jax.jit(tree_mask_reference)  # bf16 inputs and output; float32 softmax


def random_parents(rng, B, N, fan=3):
    p = np.zeros((B, N), np.int32)
    p[:, 0] = -1
    for i in range(1, N):
        p[:, i] = rng.integers(max(0, i - fan), i, B)
    return p


def make_inputs(seed, B, Nq, Hq, Hkv, D, S, *, kind="tree", lengths=None, dtype=jnp.bfloat16):
    """kind: 'tree' (random tree, positions = len + depth), 'causal' (chunk: mask None, positions
    len + i), 'random_mask' (arbitrary bits, consecutive positions)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, Nq, Hq, D))
    k = rng.normal(size=(B, Nq, Hkv, D))
    v = rng.normal(size=(B, Nq, Hkv, D))
    kc = rng.normal(size=(B, Hkv, S, D))
    vc = rng.normal(size=(B, Hkv, S, D))
    if lengths is None:
        lengths = rng.integers(0, S - Nq + 1, B)
    lengths = np.asarray(lengths, np.int32)
    for b in range(B):  # poison the scratch slots
        kc[b, :, lengths[b]:] = 30.0
        vc[b, :, lengths[b]:] = 1e4
    if kind == "tree":
        parents = random_parents(rng, B, Nq)
        bits, _, positions, _, _ = _tree_ref(jnp.asarray(parents), jnp.asarray(lengths))
        mask = bits
    elif kind == "causal":
        mask, positions = None, lengths[:, None] + np.arange(Nq)[None]
    else:
        mask = jnp.asarray(rng.integers(0, 2**32, (B, Nq, mask_words(Nq)), dtype=np.uint32))
        positions = lengths[:, None] + np.arange(Nq)[None]
    sinks = rng.normal(size=(Hq,)) * 2
    c = lambda x: jnp.asarray(x, dtype)
    return (c(q), c(k), c(v), c(kc), c(vc), jnp.asarray(lengths), jnp.asarray(positions, jnp.int32),
            mask, jnp.asarray(sinks, jnp.float32))


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all(), "non-finite (unwritten or poisoned) output"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


CPU_CASES = [
    # id, B, Nq, Hq, Hkv, D, S, kind, window, overrides, lengths
    ("decode_splitk_len0", 2, 1, 8, 2, 16, 150, "causal", None, dict(num_splits=3, block_k=16), [0, 130]),
    ("decode_splitk_no_preload", 2, 1, 8, 2, 16, 150, "causal", None,
     dict(num_splits=3, block_k=16, preload_new=False), [7, 130]),
    ("tree_siblings_N40", 2, 40, 8, 2, 16, 200, "tree", None, dict(num_splits=2, block_k=32, block_new=16), None),
    ("window_tree_default_config", 3, 12, 8, 2, 16, 200, "tree", 8, {}, [0, 5, 170]),
    ("causal_chunk_window", 2, 37, 4, 2, 16, 120, "causal", 8, dict(block_rows=32, block_new=16, block_k=16), None),
    ("causal_chunk_full_splitk", 1, 50, 2, 1, 16, 90, "causal", None,
     dict(block_rows=32, block_new=16, num_splits=2), [30]),
    ("random_mask_N33_D24_mha", 1, 33, 2, 2, 24, 64, "random_mask", None, dict(num_splits=3, block_k=16), None),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_kernel_matches_reference_interpret(case):
    name, B, Nq, Hq, Hkv, D, S, kind, window, ov, lengths = case
    seed = zlib.crc32(name.encode())
    args = make_inputs(seed, B, Nq, Hq, Hkv, D, S, kind=kind, lengths=lengths)
    kw = dict(window=window, scale=D ** -0.5)
    ref = jax.jit(lambda *a: attention_reference(*a, **kw))(*args)
    out = jax.jit(lambda *a: attention_pallas(*a, **kw, interpret=True, **ov))(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < TOL


def test_kernel_rejects_nonpositive_scale():
    """The kernel folds the scale into exp2's argument after the row max, which needs scale > 0."""
    args = make_inputs(6, 1, 2, 4, 2, 16, 32, kind="tree")
    with pytest.raises(ValueError, match="scale must be positive"):
        attention_pallas(*args, window=None, scale=-0.25, interpret=True)


def test_attention_dispatch_cpu_is_reference():
    args = make_inputs(4, 1, 3, 4, 2, 16, 32, kind="tree")
    kw = dict(window=8, scale=0.25)
    np.testing.assert_array_equal(np.asarray(attention(*args, **kw), np.float32),
                                  np.asarray(attention_reference(*args, **kw), np.float32))


def test_sliding_window_keys_outside_window_are_not_read():
    """Poison every prefix slot outside the window: the result must not change."""
    B, Nq, Hq, Hkv, D, S, W = 2, 4, 4, 2, 16, 160, 16
    q, k, v, kc, vc, lengths, positions, mask, sinks = make_inputs(5, B, Nq, Hq, Hkv, D, S, kind="tree",
                                                                   lengths=[100, 140])
    kw = dict(window=W, scale=0.25)
    ref = jax.jit(lambda *a: attention_reference(*a, **kw))(q, k, v, kc, vc, lengths, positions, mask, sinks)
    kc2 = kc.at[:, :, :100 - W].set(jnp.nan)  # slots before the earliest window
    vc2 = vc.at[:, :, :100 - W].set(jnp.nan)
    out = attention_pallas(q, k, v, kc2, vc2, lengths, positions, mask, sinks, **kw, interpret=True,
                           block_k=16)
    assert rel_err(out, ref) < TOL


# ------------------------------------------------------------------ Mosaic GPU kernel (attention_mosaic.py)
# On CPU the prefix partials come from `prefix_reference` (the Mosaic interpreter runs no warp-specialized
# kernel) and the finish kernel (sink, new tokens, merge) runs in the Pallas interpreter; the prefix
# kernel itself is lowered for CUDA here and run against the reference on GPUs.

MOSAIC_CASES = [
    # id, B, Nq, Hq, Hkv, D, S, kind, lengths, overrides
    ("tree_key_phases_len0", 3, 3, 16, 2, 64, 320, "tree", [300, 0, 37], dict(splits=3)),
    ("causal_two_row_groups", 2, 12, 16, 2, 64, 512, "causal", [1, 497], dict(splits=2, block_k=128, stages=2)),
    ("random_mask_D128", 1, 5, 16, 2, 128, 256, "random_mask", [200], dict(splits=5)),
    ("decode_empty_splits", 3, 1, 32, 2, 64, 136, "causal", [64, 129, 1], {}),
]


@pytest.mark.parametrize("case", MOSAIC_CASES, ids=[c[0] for c in MOSAIC_CASES])
def test_mosaic_matches_reference_interpret(case):
    name, B, Nq, Hq, Hkv, D, S, kind, lengths, ov = case
    args = make_inputs(zlib.crc32(name.encode()), B, Nq, Hq, Hkv, D, S, kind=kind, lengths=lengths)
    kw = dict(window=None, scale=D ** -0.5)
    ref = jax.jit(lambda *a: attention_reference(*a, **kw))(*args)
    out = mosaic.attention_mosaic(*args, **kw, interpret=True, **ov)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("B,Nq,D,ov", [(1, 16, 64, {}), (4, 3, 64, dict(block_k=64)), (1, 8, 128, {})])
def test_mosaic_kernel_lowers_for_cuda(B, Nq, D, ov):
    """The prefix kernel and the finish kernel lower for CUDA at gpt-oss-120b shapes (64 / 8 heads)."""
    S = 4096
    sds = jax.ShapeDtypeStruct
    args = (sds((B, Nq, 64, D), jnp.bfloat16), sds((B, Nq, 8, D), jnp.bfloat16), sds((B, Nq, 8, D), jnp.bfloat16),
            sds((B, 8, S, D), jnp.bfloat16), sds((B, 8, S, D), jnp.bfloat16), sds((B,), jnp.int32),
            sds((B, Nq), jnp.int32), sds((B, Nq, 1), jnp.uint32), sds((64,), jnp.float32))
    fn = jax.jit(lambda *a: mosaic.attention_mosaic(*a, window=None, scale=D ** -0.5, **ov))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "attention_prefix" in text and "attention_finish" in text
    launch = mosaic.launch_config(args[0], args[3], **ov)
    for probe in ("stream", "compute"):  # experiments/attention_floor.py's variants
        fn = jax.jit(lambda q, kc, vc, n: mosaic._prefix_call(q, kc, vc, n, scale=0.125, probe=probe, **launch))
        assert "attention_prefix" in fn.trace(args[0], args[3], args[4], args[5]).lower(
            lowering_platforms=("cuda",)).as_text()


def test_mosaic_dispatch_and_bad_input():
    q = jnp.zeros((1, 4, 64, 64), jnp.bfloat16)
    kc = jnp.zeros((1, 8, 4096, 64), jnp.bfloat16)
    pick = functools.partial(select.attention, platform="gpu")
    assert pick(q, kc, None) == "mosaic"
    assert pick(q, kc, 128) == "triton"  # sliding layers: the Triton kernel reads only the window
    assert pick(q[:, :1], kc, None) == "triton"  # one query token
    assert pick(q, kc[:, :, :2048], None) == "triton"  # short caches
    assert pick(q, kc[:, :, :0], None) == "reference"  # no cache
    assert select.attention(q, kc, None, platform="cpu") == "reference"
    assert not mosaic.mosaic_fits(q[:, :, :16], kc[:, :4], None)  # G = 4: a token is half an 8-row tile
    assert not mosaic.mosaic_fits(q, kc[:, :, :4095], None)  # the flat cache's TMA tiling
    assert not mosaic.mosaic_fits(jnp.zeros((1, 17, 64, 64), jnp.bfloat16), kc, None)  # > 128 rows
    args = make_inputs(3, 1, 2, 16, 2, 64, 64, kind="tree")
    with pytest.raises(ValueError, match="full layers"):
        mosaic.attention_mosaic(*args, window=16, scale=0.125, interpret=True)
    with pytest.raises(ValueError, match="scale must be positive"):
        mosaic.attention_mosaic(*args, window=None, scale=-0.125, interpret=True)
    with pytest.raises(ValueError, match="key phases"):
        mosaic.attention_mosaic(*args, window=None, scale=0.125, stages=3, interpret=True)
    with pytest.raises(ValueError, match="shared memory"):
        mosaic.attention_mosaic(*args, window=None, scale=0.125, block_k=128, stages=8, interpret=True)


# ------------------------------------------------------------------------------------------ GPU

GPU_CASES = [
    # B, Nq, kind, window, S, lengths
    (1, 1, "causal", None, 4096, [4000]),
    (4, 1, "causal", None, 4096, [0, 1, 2049, 4095]),
    (2, 16, "tree", None, 4096, [3000, 17]),
    (4, 64, "tree", None, 2048, None),
    (2, 16, "tree", 128, 4096, [3000, 100]),
    (3, 8, "tree", 128, 1024, [0, 127, 1000]),
    (1, 256, "causal", None, 2048, [1024]),
    (2, 256, "causal", 128, 2048, [0, 1500]),
]
GPU_OVERRIDES = [dict(num_splits=7), dict(num_splits=40, block_k=32, preload_new=False)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_kernel_matches_reference_gpu(case):
    B, Nq, kind, window, S, lengths = case
    args = make_inputs(zlib.crc32(repr(case).encode()), B, Nq, 64, 8, 64, S, kind=kind, lengths=lengths)
    kw = dict(window=window, scale=0.125)
    ref = jax.jit(lambda *a: attention_reference(*a, **kw))(*args)
    out = jax.jit(lambda *a: attention(*a, **kw))(*args)
    assert rel_err(out, ref) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("ov", GPU_OVERRIDES, ids=["ns7", "ns40_bk32_no_preload"])
@pytest.mark.parametrize("case", GPU_CASES[:4], ids=lambda c: f"B{c[0]}_Nq{c[1]}")
def test_split_counts_gpu(case, ov):
    B, Nq, kind, window, S, lengths = case
    args = make_inputs(zlib.crc32(repr(case).encode()), B, Nq, 64, 8, 64, S, kind=kind, lengths=lengths)
    kw = dict(window=window, scale=0.125)
    ref = jax.jit(lambda *a: attention_reference(*a, **kw))(*args)
    out = jax.jit(lambda *a: attention_pallas(*a, **kw, **ov))(*args)
    assert rel_err(out, ref) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(1, 1, "causal", 4096, [4000], {}), (2, 3, "tree", 1104, [1000, 37], {}),
                                  (2, 16, "tree", 4096, [3000, 0], {}), (1, 13, "causal", 64, [1], {}),
                                  (3, 8, "tree", 800, [100, 700, 64], dict(splits=3, block_k=64, stages=4))])
def test_mosaic_matches_reference_gpu(case):
    B, Nq, kind, S, lengths, ov = case
    args = make_inputs(zlib.crc32(repr(case).encode()), B, Nq, 64, 8, 64, S, kind=kind, lengths=lengths)
    kw = dict(window=None, scale=0.125)
    ref = jax.jit(lambda *a: attention_reference(*a, **kw))(*args)
    out = mosaic.attention_mosaic(*args, **kw, **ov)
    assert rel_err(out, ref) < TOL


def rope_inputs(seed, B, Nq, Hq, Hkv, D, S, kind, lengths, bias=True):
    """make_inputs' caches, lengths, positions, mask and sinks, with a fused projection qkv, its bias and
    the rows' cos, sin instead of q, k, v."""
    _, _, _, kc, vc, lengths, positions, mask, sinks = make_inputs(seed, B, Nq, Hq, Hkv, D, S, kind=kind,
                                                                   lengths=lengths)
    rng = np.random.default_rng(seed + 1)
    qkv = jnp.asarray(rng.normal(size=(B, Nq, (Hq + 2 * Hkv) * D)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=((Hq + 2 * Hkv) * D,)), jnp.bfloat16) if bias else None
    ang = rng.uniform(0, 2 * np.pi, (B, Nq, D // 2))
    return qkv, b, jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32), kc, vc, \
        lengths, positions, mask, sinks


ROPE_CASES = [c for c in CPU_CASES if c[0] in ("decode_splitk_len0", "decode_splitk_no_preload", "tree_siblings_N40",
                                                "causal_chunk_window", "random_mask_N33_D24_mha")]


@pytest.mark.parametrize("case", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_rope_attention_matches_reference_interpret(case):
    # q/k/v formed in the attention kernel from the fused projection, and the new K/V written to the
    # caches (poisoned past lengths), against rope_write_reference + attention_reference
    name, B, Nq, Hq, Hkv, D, S, kind, window, ov, lengths = case
    args = rope_inputs(zlib.crc32(name.encode()), B, Nq, Hq, Hkv, D, S, kind, lengths, bias=name != "tree_siblings_N40")
    kw = dict(num_heads=Hq, num_kv_heads=Hkv, window=window, scale=D ** -0.5)
    ref = jax.jit(lambda *a: rope_attention_reference(*a, **kw))(*args)
    got = jax.jit(lambda *a: rope_attention(*a, **kw, interpret=True, **ov))(*args)
    assert rel_err(got[0], ref[0]) < TOL
    for c, rc in zip(got[1:], ref[1:]):  # the caches: new slots one bf16 step apart at most, the rest as they were
        c, rc = np.asarray(c, np.float64), np.asarray(rc, np.float64)
        assert c.shape == rc.shape
        np.testing.assert_allclose(c, rc, rtol=2 ** -7, atol=1e-6)
        assert np.mean(c != rc) < 1e-3


def test_rope_attention_cache_slots_interpret():
    # D = 8 (< the kernel's 16 columns), slots past the cache's end dropped (S = 10, T = 3, lengths 9),
    # and the written K against the float64 rotation of the rounded, biased projection
    B, T, Hq, Hkv, D, S = 2, 3, 4, 2, 8, 10
    args = rope_inputs(11, B, T, Hq, Hkv, D, S, "causal", [9, 2])
    kw = dict(num_heads=Hq, num_kv_heads=Hkv, window=None, scale=D ** -0.5)
    ref = jax.jit(lambda *a: rope_attention_reference(*a, **kw))(*args)  # jitted: one program (eager, ~90 ops)
    got = jax.jit(lambda *a: rope_attention(*a, **kw, interpret=True))(*args)
    assert rel_err(got[0], ref[0]) < TOL
    for c, rc in zip(got[1:], ref[1:]):
        np.testing.assert_array_equal(np.asarray(c, np.float32), np.asarray(rc, np.float32))
    qkv, b, cos, sin = (np.asarray(a, np.float64) for a in args[:4])
    x = np.asarray(jnp.asarray(qkv + b, jnp.bfloat16), np.float64)[..., Hq * D:(Hq + Hkv) * D]
    x = x.reshape(B, T, Hkv, D)
    c, s_ = cos[:, :, None], sin[:, :, None]
    want = np.concatenate([x[..., :D // 2] * c - x[..., D // 2:] * s_, x[..., D // 2:] * c + x[..., :D // 2] * s_], -1)
    kc = np.asarray(got[1], np.float64)
    for bi, L in enumerate([9, 2]):
        n = min(T, S - L)
        np.testing.assert_allclose(kc[bi, :, L:L + n], want[bi, :n].transpose(1, 0, 2), rtol=2 ** -7, atol=1e-30)


def test_rope_attention_rejects_bad_input():
    args = rope_inputs(3, 1, 2, 4, 2, 16, 32, "tree", [3])
    kw = dict(num_heads=4, num_kv_heads=2, window=None, scale=0.25, interpret=True)
    with pytest.raises(ValueError, match="cos"):
        rope_attention(args[0], args[1], args[2][:, :1], *args[3:], **kw)
    with pytest.raises(ValueError, match="bfloat16"):
        rope_attention(args[0].astype(jnp.float32), *args[1:], **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_rope_attention_matches_reference_gpu(case):
    B, Nq, kind, window, S, lengths = case
    args = rope_inputs(zlib.crc32(repr(case).encode()), B, Nq, 64, 8, 64, S, kind, lengths)
    kw = dict(num_heads=64, num_kv_heads=8, window=window, scale=0.125)
    ref = jax.jit(lambda *a: rope_attention_reference(*a, **kw))(*args)
    # in place: the caches donated to the jitted call
    f = jax.jit(lambda *a: rope_attention(*a, **kw), donate_argnums=(4, 5))
    got = f(*args[:4], jnp.array(args[4]), jnp.array(args[5]), *args[6:])
    assert rel_err(got[0], ref[0]) < TOL
    for c, rc in zip(got[1:], ref[1:]):
        c, rc = np.asarray(c, np.float64), np.asarray(rc, np.float64)
        np.testing.assert_allclose(c, rc, rtol=2 ** -7, atol=1e-6)
        assert np.mean(c != rc) < 1e-3
