"""Every Pallas kernel lowers to Triton IR for CUDA, on any machine (CPU CI included).

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs the Pallas Triton lowering (the
kernel's jaxpr to Triton MLIR) without a GPU, on abstract inputs at gpt-oss-120b shapes. It catches
what the interpreter cannot: a primitive, index or shape the Triton lowering rejects, in the launch
configurations the GPU really runs. Triton's own compile to PTX still needs a GPU (the `gpu` tests).
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from eagle3_jax.formats.packed_mask import mask_words
from eagle3_jax.pallas import accept, attention, gemv, kv_rewind, moe, moe_route, norm, tree_mask

TRITON = "__gpu$xla.gpu.triton"
Hq, Hkv, D, H, I, E = 64, 8, 64, 2880, 2880, 128  # gpt-oss-120b
bf16, f32, i32, u8, u32 = jnp.bfloat16, jnp.float32, jnp.int32, jnp.uint8, jnp.uint32


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _triton_calls(fn, *args):
    """Lowers fn(*args) for CUDA; returns how many Triton kernels the module launches."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text.count(TRITON)


def _attention_args(B, Nq, S, mask):
    return (_sds((B, Hkv, S, D), bf16), _sds((B, Hkv, S, D), bf16), _sds((B,), i32), _sds((B, Nq), i32),
            _sds((B, Nq, mask_words(Nq)), u32) if mask else None, _sds((Hq,), f32))


@pytest.mark.parametrize("B,Nq,S,window,ring", [(1, 1, 32768, None, False), (4, 16, 32768, None, False),
                                                (1, 4, 4096, 128, False), (2, 64, 1024, None, False),
                                                (1, 128, 256, 128, False), (1, 1, 256, 128, True),
                                                (4, 16, 256, 128, True), (2, 512, 256, 128, True)])
def test_attention_lowers(B, Nq, S, window, ring):
    # decode, tree verify (split-K over a long prefix), sliding layers (dense and ring caches), prefill
    # chunks (mask None; a ring's longer than its spare slots take the plain kernel alone)
    kc, vc, lengths, positions, mask, sinks = _attention_args(B, Nq, S, mask=Nq <= 64)
    qkv = _sds((B, Nq, (Hq + 2 * Hkv) * D), bf16)
    bias, cs = _sds(((Hq + 2 * Hkv) * D,), bf16), _sds((B, Nq, D // 2), f32)
    if not ring or Nq <= S - window:
        fused = functools.partial(attention.rope_attention, num_heads=Hq, num_kv_heads=Hkv, window=window,
                                  scale=D ** -0.5, ring=ring)
        assert _triton_calls(fused, qkv, bias, cs, cs, kc, vc, lengths, positions, mask, sinks) >= 1
    q, kv = _sds((B, Nq, Hq, D), bf16), _sds((B, Nq, Hkv, D), bf16)
    plain = functools.partial(attention.attention_pallas, window=window, scale=D ** -0.5, ring=ring)
    assert _triton_calls(plain, q, kv, kv, kc, vc, lengths, positions, mask, sinks) >= 1


@pytest.mark.parametrize("B,N", [(1, 8), (4, 64)])
def test_tree_kernels_lower(B, N):
    L = 12  # layers of caches
    parents, tokens, lengths = _sds((B, N), i32), _sds((B, N), i32), _sds((B,), i32)
    assert _triton_calls(tree_mask.tree_mask_pallas, parents, lengths) == 1
    assert _triton_calls(accept.accept_greedy_pallas, tokens, parents, _sds((B, N), i32)) == 1
    probs = _sds((B, N, 32000), f32)
    # walk, chunk sums, bonus
    assert _triton_calls(accept.accept_sample_pallas, tokens, parents, probs, probs, jax.random.key(0)) == 3
    caches = tuple(_sds((B, Hkv, 4096, D), bf16) for _ in range(L))
    path, acc = _sds((B, 8), i32), _sds((B,), i32)
    assert _triton_calls(lambda k, v, *a: kv_rewind.kv_rewind_pallas(k, v, *a), caches, caches, lengths, path,
                         acc) == 1
    mixed = tuple(_sds((B, Hkv, 256 if i % 2 == 0 else 4096, D), bf16) for i in range(L))  # rings and dense layers
    rings = tuple(i % 2 == 0 for i in range(L))
    assert _triton_calls(lambda k, v, *a: kv_rewind.kv_rewind_pallas(k, v, *a, rings), mixed, mixed, lengths, path,
                         acc) == 1


def _experts():
    return (_sds((E, 2 * I, H // 32, 16), u8), _sds((E, 2 * I, H // 32), u8), _sds((E, 2 * I), bf16),
            _sds((E, H, I // 32, 16), u8), _sds((E, H, I // 32), u8), _sds((E, H), bf16))


@pytest.mark.parametrize("config", ["", "fma_tokens=0", "fma_tokens=2", "decode=bits/fma_tokens=0",
                                    "fma_block_i=32/fma_block_h=32/fma_warps=1"])
@pytest.mark.parametrize("T", [1, 16, 64])
def test_moe_lowers(config, T):
    kw = {k: (v if k == "decode" else int(v)) for k, v in (p.split("=") for p in config.split("/") if p)}
    cfg = moe.MoeConfig(**kw)
    x, ids, w = _sds((T, H), bf16), _sds((T, 4), i32), _sds((T, 4), f32)
    fn = functools.partial(moe.mxfp4_moe, limit=7.0, alpha=1.702, config=cfg)
    n = _triton_calls(fn, x, ids, w, *_experts())
    fma, mma = min(cfg.fma_tokens, T) > 0, T > cfg.fma_tokens
    assert n == 2 * fma + 2 * mma, n


@pytest.mark.parametrize("tm", [16, 128, 256])
def test_moe_grouped_and_route_lower(tm):
    n = 4096 * 4 // tm
    fn = functools.partial(moe.mxfp4_moe_grouped, limit=7.0, alpha=1.702)
    assert _triton_calls(fn, _sds((n, tm, H), bf16), _sds((n,), i32), _sds((), i32), _sds((n, tm), f32),
                         *_experts()) == 2
    for T in (1, tm // 4):
        route = functools.partial(moe_route.route, eps=1e-5, k=4)
        assert _triton_calls(route, _sds((T, H), bf16), _sds((H,), f32), _sds((H, E), bf16), _sds((E,), bf16)) == 2
    for shape in ((1, H), (tm, H)):
        add = functools.partial(norm.add_rms_norm, eps=1e-5)
        assert _triton_calls(add, _sds(shape, bf16), _sds((H,), f32), _sds(shape, f32)) == 1


@pytest.mark.parametrize("M", [2, 4, 8])
def test_rows_matmul_lowers(M):
    # a device's o_proj and q|k|v at one row, the model's launches (the defaults)
    o = functools.partial(gemv.rows_matmul, out_dtype=f32)  # o_proj's bias on one device: a flag
    assert _triton_calls(o, _sds((1, Hq * D // M), bf16), _sds((H, Hq * D // M), bf16), _sds((H,), bf16),
                         _sds((), jnp.bool_)) == 1
    qkv = functools.partial(gemv.rows_matmul, out_dtype=bf16)
    N = (Hq + 2 * Hkv) * D // M
    assert _triton_calls(qkv, _sds((1, H), bf16), _sds((N, H), bf16), _sds((N,), bf16)) == 1
