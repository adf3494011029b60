"""experiments/moe_mosaic_probe.py on CPU: its float64 unpacking of the pair layout, and that the Mosaic GPU
kernel lowers for CUDA (its timing and GPU check run on the device only)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
probe = pytest.importorskip("moe_mosaic_probe")

from eagle3_jax.pallas import moe  # noqa: E402


def test_unpair_inverts_the_pair_layout():
    x = np.random.default_rng(0).normal(size=(3, 4 * 32)).astype(np.float32)
    x[1, 32:64] *= 1e-3  # a group with a small maximum: its own factor
    back = probe.unpair(np.asarray(moe.f16_pairs(jnp.asarray(x))).reshape(3, 4, 20))
    np.testing.assert_allclose(back, x, rtol=2e-3, atol=0)


@pytest.mark.parametrize("T, compute", [(1, True), (3, False)])
def test_kernel_lowers_for_cuda(T, compute):
    E, R, G, k = 5, 64, 90, 4
    wq = jnp.zeros((E, R, G, 16), jnp.uint8)
    sc = jnp.zeros((E, R, G), jnp.uint8)
    xq = jnp.zeros((T, G, 20), jnp.uint32)
    ids = jnp.asarray(np.random.default_rng(T).integers(0, E, T * k), jnp.int32)
    fn = jax.jit(lambda *a: probe.fma_matvec(*a, k=k, num_ctas=8, compute=compute))
    text = fn.trace(wq, sc, xq, ids).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
