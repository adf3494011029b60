"""kv_rewind (eagle3_jax/pallas/kv_rewind.py): kernel vs reference vs a numpy move, chains untouched."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.pallas.accept import accept_greedy_reference
from eagle3_jax.pallas.kv_rewind import kv_rewind, kv_rewind_pallas, kv_rewind_reference


def make(seed, layers, B, H, S, D, N, max_depth):
    rng = np.random.default_rng(seed)
    par = np.full((B, N), -1, np.int32)
    for i in range(1, N):
        par[:, i] = rng.integers(max(0, i - 3), i, B)
    tok = rng.integers(0, 2, (B, N)).astype(np.int32)
    tgt = rng.integers(0, 2, (B, N)).astype(np.int32)
    acc, path, _ = accept_greedy_reference(jnp.asarray(tok), jnp.asarray(par), jnp.asarray(tgt), max_depth=max_depth)
    k = tuple(jnp.asarray(rng.normal(size=(B, H, S, D)), jnp.bfloat16) for _ in range(layers))
    v = tuple(jnp.asarray(rng.normal(size=(B, H, S, D)), jnp.bfloat16) for _ in range(layers))
    lengths = jnp.asarray(rng.integers(0, S - N + 1, B), jnp.int32)
    lengths = lengths.at[0].set(0)  # an empty prefix
    return k, v, lengths, path, acc


def numpy_rewind(c, lengths, path, acc):
    c = np.array(c, np.float32)
    out = c.copy()
    for b in range(c.shape[0]):
        for d in range(1, int(acc[b]) + 1):
            out[b, :, lengths[b] + d] = c[b, :, lengths[b] + int(path[b, d])]
    return out


def test_reference_matches_numpy():
    k, v, lengths, path, acc = make(0, 2, 3, 2, 48, 16, 12, 6)
    rk, rv = kv_rewind_reference(k, v, lengths, path, acc)
    for c, r in zip(k + v, rk + rv):
        np.testing.assert_array_equal(np.asarray(r, np.float32), numpy_rewind(c, np.asarray(lengths),
                                                                             np.asarray(path), np.asarray(acc)))
    assert int(jnp.max(acc)) >= 2


@pytest.mark.parametrize("group_size", [None, 1, 3])
def test_kernel_matches_reference_interpret(group_size):
    k, v, lengths, path, acc = make(1, 3, 3, 2, 40, 16, 12, 7)
    rk, rv = jax.jit(kv_rewind_reference)(k, v, lengths, path, acc)
    ok, ov = kv_rewind_pallas(k, v, lengths, path, acc, interpret=True, group_size=group_size)
    for a, b in zip(ok + ov, rk + rv):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_chain_moves_nothing():
    k, v, lengths, _, _ = make(2, 2, 2, 2, 32, 16, 8, 5)
    path = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    acc = jnp.array([5, 3], jnp.int32)
    ok, ov = kv_rewind_pallas(k, v, lengths, path, acc, interpret=True)
    for a, b in zip(ok + ov, k + v):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_dispatch_cpu_is_reference():
    k, v, lengths, path, acc = make(3, 1, 2, 2, 32, 16, 8, 5)
    for a, b in zip(sum(kv_rewind(k, v, lengths, path, acc), ()),
                    sum(kv_rewind_reference(k, v, lengths, path, acc), ())):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
def test_kernel_matches_reference_gpu_in_place():
    k, v, lengths, path, acc = make(4, 36, 4, 8, 512, 64, 64, 10)
    rk, rv = jax.jit(kv_rewind_reference)(k, v, lengths, path, acc)
    ptr = k[0].unsafe_buffer_pointer()
    ok, ov = kv_rewind(k, v, lengths, path, acc)  # donates k, v
    assert ok[0].unsafe_buffer_pointer() == ptr, "not in place"
    for a, b in zip(ok + ov, rk + rv):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
