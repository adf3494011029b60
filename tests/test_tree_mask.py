"""tree_mask (eagle3_jax/pallas/tree_mask.py): kernel (interpret on CPU, compiled on GPU) vs reference,
and the reference vs a brute-force numpy walk of the parent pointers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.pallas.tree_mask import tree_mask, tree_mask_pallas, tree_mask_reference


def random_parents(rng, B, N, fan=4):
    p = np.full((B, N), -1, np.int32)
    for i in range(1, N):
        p[:, i] = rng.integers(max(0, i - fan), i, B)
    return p


def brute_force(parents, lengths):
    B, N = parents.shape
    W = -(-N // 32)
    bits = np.zeros((B, N, W), np.uint32)
    depth = np.zeros((B, N), np.int32)
    fc = np.full((B, N), -1, np.int32)
    ns = np.full((B, N), -1, np.int32)
    for b in range(B):
        for i in range(N):
            j = i
            while j >= 0:
                bits[b, i, j // 32] |= np.uint32(1) << np.uint32(j % 32)
                depth[b, i] += j != i
                j = parents[b, j]
            kids = [c for c in range(N) if parents[b, c] == i]
            fc[b, i] = kids[0] if kids else -1
            if i > 0:
                sibs = [c for c in range(i + 1, N) if parents[b, c] == parents[b, i]]
                ns[b, i] = sibs[0] if sibs else -1
    return bits, depth, lengths[:, None] + depth, fc, ns


SHAPES = [(2, 1), (3, 7), (2, 33), (4, 64), (1, 70)]


@pytest.mark.parametrize("B,N", SHAPES)
def test_reference_matches_brute_force(B, N):
    rng = np.random.default_rng(N)
    par = random_parents(rng, B, N)
    L = rng.integers(0, 1000, B).astype(np.int32)
    got = jax.jit(tree_mask_reference)(jnp.asarray(par), jnp.asarray(L))
    for g, e in zip(got, brute_force(par, L)):
        np.testing.assert_array_equal(np.asarray(g), e)


@pytest.mark.parametrize("B,N", SHAPES)
def test_kernel_matches_reference_interpret(B, N):
    rng = np.random.default_rng(100 + N)
    par = jnp.asarray(random_parents(rng, B, N))
    L = jnp.asarray(rng.integers(0, 1000, B), jnp.int32)
    ref = jax.jit(tree_mask_reference)(par, L)
    out = tree_mask_pallas(par, L, interpret=True)  # interpret outputs start poisoned (INT_MIN)
    for o, r in zip(out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype
        np.testing.assert_array_equal(np.asarray(o), np.asarray(r))


def test_chain_and_star():
    N = 40
    chain = jnp.asarray(np.arange(-1, N - 1, dtype=np.int32)[None])
    star = jnp.asarray(np.array([[-1] + [0] * (N - 1)], np.int32))
    L = jnp.array([5], jnp.int32)
    bits, depth, pos, fc, ns = tree_mask_pallas(chain, L, interpret=True)
    np.testing.assert_array_equal(np.asarray(depth[0]), np.arange(N))
    np.testing.assert_array_equal(np.asarray(pos[0]), 5 + np.arange(N))
    assert int(bits[0, 35, 1]) == 0b1111 and int(bits[0, 35, 0]) == 0xFFFFFFFF
    bits, depth, pos, fc, ns = tree_mask_pallas(star, L, interpret=True)
    assert int(fc[0, 0]) == 1 and int(ns[0, 1]) == 2 and int(ns[0, N - 1]) == -1 and int(ns[0, 0]) == -1
    assert int(bits[0, 33, 1]) == 0b10 and int(bits[0, 33, 0]) == 1


def test_dispatch_cpu_is_reference():
    par = jnp.asarray(random_parents(np.random.default_rng(0), 2, 9))
    L = jnp.array([3, 4], jnp.int32)
    for a, b in zip(tree_mask(par, L), tree_mask_reference(par, L)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("B,N", SHAPES + [(8, 128)])
def test_kernel_matches_reference_gpu(B, N):
    rng = np.random.default_rng(200 + N)
    par = jnp.asarray(random_parents(rng, B, N))
    L = jnp.asarray(rng.integers(0, 1000, B), jnp.int32)
    for o, r in zip(tree_mask(par, L), jax.jit(tree_mask_reference)(par, L)):
        np.testing.assert_array_equal(np.asarray(o), np.asarray(r))
