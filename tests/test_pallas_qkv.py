"""Attention prologue kernel (eagle3_jax/pallas/qkv.py: bias, RoPE, cache write) against its jnp
reference. CPU: interpret mode (fresh outputs poisoned before the grid runs; the caches are random
and must change exactly at the written slots). GPU: the Triton kernel at gpt-oss-120b sizes."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from eagle3_jax.pallas import qkv as qkv_kernel


def _case(rng, B, T, Hq, Hkv, D, S, lengths, bias=True):
    N = (Hq + 2 * Hkv) * D
    qkv = jnp.asarray(rng.normal(0, 2, (B, T, N)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(0, 0.5, (N,)), jnp.bfloat16) if bias else None
    ang = rng.uniform(0, 100, (B, T, D // 2))
    cos, sin = jnp.asarray(np.cos(ang) * 1.1, jnp.float32), jnp.asarray(np.sin(ang) * 1.1, jnp.float32)
    kc = jnp.asarray(rng.normal(size=(B, Hkv, S, D)), jnp.bfloat16)
    vc = jnp.asarray(rng.normal(size=(B, Hkv, S, D)), jnp.bfloat16)
    return qkv, b, cos, sin, kc, vc, jnp.asarray(lengths, jnp.int32)


def _check(args, Hq, Hkv, interpret=True):
    ref = qkv_kernel.rope_write_reference(*args, num_heads=Hq, num_kv_heads=Hkv)
    got = qkv_kernel.rope_write(*args, num_heads=Hq, num_kv_heads=Hkv, interpret=interpret)
    for name, g, r in zip(("q", "k", "v", "k_cache", "v_cache"), got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32), err_msg=name)
    # against float64: the rotation of the rounded, biased inputs
    qkv, b, cos, sin = (None if a is None else np.asarray(a, np.float64) for a in args[:4])
    B, T, N = qkv.shape
    D = N // (Hq + 2 * Hkv)
    x = np.asarray(jnp.asarray(qkv + (0 if b is None else b), jnp.bfloat16), np.float64)
    qk = x[..., :(Hq + Hkv) * D].reshape(B, T, Hq + Hkv, D)
    c, s = cos[:, :, None], sin[:, :, None]
    want = np.concatenate([qk[..., :D // 2] * c - qk[..., D // 2:] * s, qk[..., D // 2:] * c + qk[..., :D // 2] * s], -1)
    np.testing.assert_allclose(np.asarray(got[0], np.float64), want[:, :, :Hq], rtol=2 ** -7, atol=1e-30)


@pytest.mark.parametrize("lengths,bias", [([0, 5], True), ([3, 7], False), ([9, 2], True)])
def test_interpret_matches_reference(lengths, bias):
    # S = 10, T = 3: lengths 7 fills the cache's last slot; 9 writes one slot and drops two
    rng = np.random.default_rng()
    _check(_case(rng, 2, 3, 4, 2, 8, 10, lengths, bias), 4, 2)


def test_rejects_bad_shapes():
    args = _case(np.random.default_rng(0), 1, 2, 4, 2, 8, 6, [0])
    with pytest.raises(ValueError, match="caches"):
        qkv_kernel.rope_write(*args[:4], args[4][:, :1], *args[5:], num_heads=4, num_kv_heads=2, interpret=True)
    with pytest.raises(ValueError, match="cos"):
        qkv_kernel.rope_write(args[0], args[1], args[2][:, :1], *args[3:], num_heads=4, num_kv_heads=2,
                              interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (4, 16)])
def test_gpu_matches_reference(B, T):
    rng = np.random.default_rng(T)
    args = _case(rng, B, T, 64, 8, 64, 256, rng.integers(0, 256 - T, B))
    _check(args, 64, 8, interpret=False)
    # in place inside a jitted, donated call
    f = jax.jit(lambda *a: qkv_kernel.rope_write(*a, num_heads=64, num_kv_heads=8), donate_argnums=(4, 5))
    jax.block_until_ready(f(*args[:4], jnp.array(args[4]), jnp.array(args[5]), args[6]))
