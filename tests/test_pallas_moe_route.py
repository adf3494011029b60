"""MoE routing kernels (eagle3_jax/pallas/moe_route.py) against their jnp reference.

CPU: interpret mode, which poisons outputs before the grid runs (an element no program writes fails
the comparison). GPU: the Triton kernels at gpt-oss-120b sizes and in the model's MoE layer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.pallas import moe, moe_route

# jitted, as the model runs it (one fusion): eager, its 32-way maximum and packing compile op by op
# for every shape (about 1 s a call on CPU)
_f16_pairs = jax.jit(moe.f16_pairs)


def _case(rng, T, H, E, norm=True, h_std=3.0):
    h = jnp.asarray(rng.normal(0, h_std, (T, H)), jnp.bfloat16)
    scale = jnp.asarray(rng.normal(1, 0.3, (H,)), jnp.float32) if norm else None
    w = jnp.asarray(rng.normal(0, H ** -0.5, (H, E)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(0, 0.1, (E,)), jnp.bfloat16)
    return h, scale, w, b


def _check(args, k, interpret=True):
    got = moe_route.route(*args, eps=1e-5, k=k, interpret=interpret)
    ref = moe_route.route_reference(*args, eps=1e-5, k=k)
    x, xq, ids, w = (np.asarray(a) for a in got)
    rx, rxq, rids, rw = (np.asarray(a) for a in ref)
    T, H = args[0].shape
    assert x.shape == (T, H) and x.dtype == rx.dtype
    assert xq.shape == (T, H // 32, 5, 4) and xq.dtype == np.uint32
    assert ids.shape == w.shape == (T, k) and ids.dtype == np.int32 and w.dtype == np.float32
    # the norm's sum runs in another order than jnp.mean: at most one bf16 step apart, rarely
    xf, rxf = x.astype(np.float64), rx.astype(np.float64)
    np.testing.assert_allclose(xf, rxf, rtol=2 ** -7, atol=0)
    assert np.mean(xf != rxf) < 1e-3
    # xq is the pair layout of the kernel's own x, bit for bit
    np.testing.assert_array_equal(xq, np.asarray(_f16_pairs(jnp.asarray(x).astype(jnp.float32))))
    # routing of the kernel's own x, in float64 (x itself may differ from the reference's by one
    # bf16 step in rare elements, which moves the logits by more than the tolerance below)
    logits = xf @ np.asarray(args[2], np.float64) + np.asarray(args[3], np.float64)
    want = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(ids, want)
    top = np.take_along_axis(logits, want, -1)
    p = np.exp(top - top[:, :1])
    np.testing.assert_allclose(w, p / p.sum(-1, keepdims=True), rtol=2e-5, atol=1e-6)
    if np.array_equal(xf, rxf):
        np.testing.assert_array_equal(ids, rids)
    return got


@pytest.mark.parametrize("T,H,E,k,norm", [(1, 96, 16, 4, True), (1, 320, 40, 4, False), (5, 320, 24, 4, False),
                                          (17, 64, 128, 4, True), (40, 288, 40, 2, True), (3, 2880, 128, 4, True)])
def test_interpret_matches_reference(T, H, E, k, norm):
    # H not a multiple of the 256-input step, E not a multiple of the 16-expert tile, T across tiles
    _check(_case(np.random.default_rng(), T, H, E, norm), k)


def test_interpret_ties_and_extreme_rows():
    # equal logits go to the lower expert id, in descending order of logit (lax.top_k); rows of
    # zeros and of huge values normalize like the reference
    rng = np.random.default_rng()
    h, scale, w, b = _case(rng, 6, 128, 32)
    w = w.at[:, 9].set(w[:, 4]).at[:, 20].set(w[:, 4])
    b = b.at[jnp.array([4, 9, 20])].set(jnp.bfloat16(50.0))
    h = h.at[2].set(0.0).at[3].multiply(jnp.bfloat16(2.0 ** 60))
    _, _, ids, _ = _check((h, scale, w, b), 4)
    np.testing.assert_array_equal(np.asarray(ids)[:, :3], np.tile([4, 9, 20], (6, 1)))


def test_rejects_bad_input():
    rng = np.random.default_rng(0)
    h, scale, w, b = _case(rng, 2, 64, 8)
    with pytest.raises(ValueError, match="bfloat16"):
        moe_route.route(h.astype(jnp.float32), scale, w, b, eps=1e-5, k=4, interpret=True)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        moe_route.route(jnp.zeros((65, 64), jnp.bfloat16), scale, w, b, eps=1e-5, k=4, interpret=True)
    with pytest.raises(ValueError, match="router_w"):
        moe_route.route(h, scale, w[:32], b, eps=1e-5, k=4, interpret=True)
    with pytest.raises(ValueError, match="k 9"):
        moe_route.route(h, scale, w, b, eps=1e-5, k=9, interpret=True)
    with pytest.raises(ValueError, match="norm_scale"):
        moe_route.route(h, scale[:32], w, b, eps=1e-5, k=4, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 16, 40, 64])
def test_gpu_matches_reference(T):
    _check(_case(np.random.default_rng(T), T, 2880, 128), 4, interpret=False)
