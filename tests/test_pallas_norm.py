"""Residual add + RMSNorm kernel (eagle3_jax/pallas/norm.py) against its jnp reference (CPU: interpret
mode, outputs poisoned before the grid runs; GPU: the Triton kernel)."""

import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.pallas import norm


def _check(shape, residual, interpret=True, seed=None):
    rng = np.random.default_rng(seed)
    H = shape[-1]
    x = jnp.asarray(rng.normal(0, 4, shape), jnp.bfloat16)
    res = jnp.asarray(rng.normal(0, 4, shape), jnp.float32) if residual else None
    scale = jnp.asarray(rng.normal(1, 0.3, (H,)), jnp.float32)
    s, y = norm.add_rms_norm(x, scale, res, eps=1e-5, interpret=interpret)
    rs, ry = norm.add_rms_norm_reference(x, scale, res, eps=1e-5)
    assert s.shape == y.shape == x.shape and s.dtype == y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(rs, np.float32))  # the add is exact
    y, ry = np.asarray(y, np.float64), np.asarray(ry, np.float64)
    # the mean's sum runs in another order: at most one bf16 step apart, rarely
    np.testing.assert_allclose(y, ry, rtol=2 ** -7, atol=0)
    assert np.mean(y != ry) < 1e-3
    if residual:  # against float64
        t = np.asarray(rs, np.float64)
        want = t / np.sqrt(np.mean(t * t, -1, keepdims=True) + 1e-5) * np.asarray(scale, np.float64)
        np.testing.assert_allclose(y, want, rtol=2 ** -7)


@pytest.mark.parametrize("shape,residual", [((1, 1, 2880), True), ((5, 96), False), ((3, 4, 100), True)])
def test_interpret_matches_reference(shape, residual):
    _check(shape, residual)


def test_rejects_bad_shapes():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="scale"):
        norm.add_rms_norm(x, jnp.ones((32,)), eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="residual"):
        norm.add_rms_norm(x, jnp.ones((64,)), jnp.zeros((1, 64)), eps=1e-5, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,residual", [((1, 1, 2880), True), ((4, 16, 2880), True), ((7, 2880), False)])
def test_gpu_matches_reference(shape, residual):
    _check(shape, residual, interpret=False, seed=0)
