"""pallas/gemv.py: rows_matmul against a float64 numpy product, in interpret mode on CPU and compiled on GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.pallas import gemv, select


def check(R, K, N, bias, out_dtype, seed, **kw):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((N, K)) / np.sqrt(K), jnp.bfloat16)  # [out, in]
    b = jnp.asarray(rng.standard_normal(N), jnp.bfloat16) if bias else None
    got = np.asarray(gemv.rows_matmul(x, w, b, out_dtype=out_dtype, **kw), np.float64)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T + (0 if b is None else np.asarray(b, np.float64))
    assert got.shape == (R, N) and np.isfinite(got).all()
    tol = 1e-5 if out_dtype == jnp.float32 else 2 ** -7
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    ref = np.asarray(gemv.rows_matmul_reference(x, w, b, out_dtype=out_dtype), np.float64)
    np.testing.assert_allclose(ref, want, rtol=tol, atol=tol)


# ragged K and N (masked tails), one row and the most, with and without bias, both output dtypes
@pytest.mark.parametrize("R,K,N,bias,out_dtype,bn", [(1, 200, 48, True, jnp.float32, 4),
                                                     (3, 64, 16, False, jnp.bfloat16, 8),
                                                     (gemv.MAX_ROWS, 130, 33, True, jnp.bfloat16, 4)])
def test_interpret_matches_numpy(R, K, N, bias, out_dtype, bn):
    check(R, K, N, bias, out_dtype, seed=R * K + N, block_n=bn, block_k=64, interpret=True)


@pytest.mark.parametrize("on", [True, False])
def test_bias_flag(on):
    # bias_on as a traced flag (as a row-parallel projection passes it): the bias only where it is set
    rng = np.random.default_rng(int(on))
    x = jnp.asarray(rng.standard_normal((2, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((40, 96)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(40) + 3.0, jnp.bfloat16)
    run = jax.jit(lambda flag: gemv.rows_matmul(x, w, b, flag, out_dtype=jnp.float32, block_k=32, interpret=True))
    got = np.asarray(run(jnp.asarray(on)), np.float64)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T + on * np.asarray(b, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ref = gemv.rows_matmul_reference(x, w, b, jnp.asarray(on), out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, rtol=1e-5, atol=1e-5)


def test_bad_input_and_dispatch():
    x, w = jnp.zeros((1, 64), jnp.bfloat16), jnp.zeros((32, 64), jnp.bfloat16)
    for args, kw, what in (((jnp.zeros((9, 64), jnp.bfloat16), w), {}, "x \\(9, 64\\)"),
                           ((x, w.T), {}, "w \\(64, 32\\)"), ((x, w, jnp.zeros(31)), {}, "bias \\(31,\\)"),
                           ((x, w, None, True), {}, "bias_on"),
                           ((x, w, jnp.zeros(32), jnp.ones(2, bool)), {}, "bias_on"),
                           ((x, w), {"block_n": 3}, "powers of two")):
        with pytest.raises(ValueError, match=what):
            gemv.rows_matmul(*args, out_dtype=jnp.float32, interpret=True, **kw)

    # a device's o_proj and q|k|v (w [N, K]) at 2 and 4 devices take the kernel at one bf16 row on
    # GPUs only; one device's whole projections keep XLA's GEMV
    def pick(rows, N, K, dtype=jnp.bfloat16, platform="gpu"):
        return select.rows_matmul(jnp.zeros((rows, K), dtype), jax.ShapeDtypeStruct((N, K), jnp.bfloat16), platform)

    for N, K in ((2880, 1024), (1280, 2880), (2880, 2048), (2560, 2880)):
        assert pick(1, N, K) == "kernel"
    assert pick(1, 2880, 1024, platform="cpu") == "xla"
    assert pick(2, 2880, 1024) == "xla"
    assert pick(1, 2880, 1024, jnp.float32) == "xla"
    assert pick(1, 2880, 4096) == pick(1, 5120, 2880) == "xla"


@pytest.mark.gpu
@pytest.mark.parametrize("R,K,N,bias,out_dtype,bn,bk", [(1, 1024, 2880, False, jnp.float32, 4, 1024),
                                                         (1, 2880, 1280, True, jnp.bfloat16, 4, 1024),
                                                         (1, 2880, 2560, False, jnp.bfloat16, 4, 1024),
                                                         (5, 1000, 2900, True, jnp.float32, 8, 512)])
def test_kernel_matches_numpy_gpu(R, K, N, bias, out_dtype, bn, bk):
    check(R, K, N, bias, out_dtype, seed=7, block_n=bn, block_k=bk)
