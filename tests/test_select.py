"""pallas/select.py: the table of which implementation runs, checked for each platform on CPU."""

import jax
import jax.numpy as jnp
import pytest

from eagle3_jax.pallas import select

bf16, f32 = jnp.bfloat16, jnp.float32


def _z(shape, dtype=bf16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_glue_norm_and_target_attention():
    x, x32 = _z((1, 1, 2880)), _z((1, 1, 2880), f32)
    kc, empty = _z((1, 8, 4096, 64)), _z((1, 8, 0, 64))
    assert select.glue_kernels(x, "gpu") and not select.glue_kernels(x32, "gpu") and not select.glue_kernels(x, "cpu")
    assert select.norm(x, "gpu") == "kernel" and select.norm(x, "cpu") == select.norm(x32, "gpu") == "reference"
    assert select.target_attention(x, kc, "gpu") == "rope_kernel"
    for args in ((x, empty, "gpu"), (x32, kc, "gpu"), (x, _z((1, 8, 64, 64), f32), "gpu"),
                 (x, _z((1, 8, 64, 512)), "gpu"), (x, kc, "cpu")):
        assert select.target_attention(*args) == "plain", args


def test_attention():
    q, kc = _z((1, 4, 64, 64)), _z((1, 8, 4096, 64))
    assert select.attention(q, kc, None, "gpu") == "mosaic"
    assert select.attention(q, kc, 128, "gpu") == "triton"  # sliding layer
    assert select.attention(_z((1, 1, 64, 64)), kc, None, "gpu") == "triton"  # Nq = 1
    assert select.attention(q, _z((1, 8, select.MOSAIC_MIN_CACHE - 8, 64)), None, "gpu") == "triton"
    assert select.attention(_z((1, 4, 64, 64), f32), _z((1, 8, 4096, 64), f32), None, "gpu") == "triton"
    assert select.attention(q, _z((1, 8, 0, 64)), None, "gpu") == "reference"  # no cache: forward, training
    assert select.attention(_z((1, 4, 8, 512)), _z((1, 1, 4096, 512)), None, "gpu") == "reference"  # D > 256
    assert select.attention(q, kc, None, "cpu") == "reference"


def test_moe_paths():
    def path(T, E=128, k=4, packed=True, dtype=bf16, platform="gpu"):
        return select.moe(_z((T, 2880), dtype), num_experts=E, top_k=k, packed=packed, platform=platform)

    assert [path(T) for T in (1, 16, 64, 65)] == ["kernel"] * 3 + ["grouped"]
    assert path(1, packed=False) == path(16, platform="cpu") == path(16, dtype=f32) == "gathered"
    assert path(17, platform="cpu") == "grouped" and path(17, E=16, platform="cpu") == "dense"
    # packed experts that "dense" takes go dense at any size ("gathered" would gather and decode a copy
    # of an expert's MXFP4 weights a pair; "dense" decodes every expert once); unpacked ones gather
    assert path(1, E=16, platform="cpu") == path(16, E=16, dtype=f32) == "dense"
    assert path(16, E=16, packed=False, platform="cpu") == path(16, E=17, platform="cpu") == "gathered"
    assert select.moe_grouped(_z((300, 2880)), True, platform="gpu") == "kernel"
    interp = select.KernelPolicy(interpret=True)
    assert select.moe_grouped(_z((300, 2880)), True, platform="cpu", policy=interp) == "kernel"
    assert select.moe_grouped(_z((300, 2880)), False, platform="gpu", policy=interp) == "scan"
    assert select.moe_grouped(_z((300, 2880), f32), True, policy=interp) == "scan"
    assert select.moe_grouped(_z((300, 2880)), True, platform="cpu") == "scan"
    assert select.router_top_k(select.RANK_TOP_K_ROWS) == "rank" and select.router_top_k(65) == "sort"


def test_spec_ops():
    interp, ref = select.KernelPolicy(interpret=True), select.KernelPolicy(spec_ops="reference")
    assert select.spec_ops("gpu") == select.spec_ops("cpu", policy=interp) == "kernel"
    assert select.spec_ops("gpu", policy=interp) == "kernel"
    assert select.spec_ops("cpu") == select.spec_ops("gpu", policy=ref) == "reference"


def test_policy_overrides_every_question():
    """Each KernelPolicy field forces its question's answer on any platform and shape (within what the
    op can run at all), and a wrong name is a ValueError naming the field and the choices."""
    x, kc, q = _z((1, 1, 2880)), _z((1, 8, 4096, 64)), _z((1, 4, 64, 64))
    for name in select.CHOICES:
        for choice in select.CHOICES[name]:
            policy = select.KernelPolicy(**{name: choice})
            assert getattr(policy, name) == choice
    P = select.KernelPolicy
    assert select.attention(q, kc, None, "cpu", policy=P(attention="mosaic")) == "mosaic"
    assert select.attention(q, kc, None, "gpu", policy=P(attention="reference")) == "reference"
    assert select.target_attention(x, kc, "cpu", policy=P(target_attention="rope_kernel")) == "rope_kernel"
    assert select.target_attention(x, _z((1, 8, 0, 64)), "cpu", policy=P(target_attention="rope_kernel")) == "plain"
    assert select.norm(x, "gpu", policy=P(norm="reference")) == "reference"
    assert select.norm(x, "cpu", policy=P(norm="kernel")) == "kernel"
    for path in select.MOE_PATHS:
        assert select.moe(_z((1, 2880)), num_experts=128, top_k=4, packed=True, platform="cpu",
                          policy=P(moe=path)) == path
    assert select.moe_grouped(_z((300, 2880)), True, "gpu", policy=P(moe_grouped="scan")) == "scan"
    assert select.router_top_k(1, policy=P(router_top_k="sort")) == "sort"
    assert select.rows_matmul(_z((1, 2880)), _z((512, 2880)), "cpu", policy=P(rows_matmul="kernel")) == "kernel"
    assert select.rows_matmul(_z((64, 2880)), _z((512, 2880)), "cpu", policy=P(rows_matmul="kernel")) == "xla"
    assert select.rows_matmul(_z((1, 2880)), _z((512, 2880)), "gpu", policy=P(rows_matmul="xla")) == "xla"
    # the one-shot all-reduce needs a Mailbox whatever the policy says; "reference" is always possible
    assert select.tp_reduce(x, 1, 2, None, "gpu", policy=P(tp_reduce="kernel")) == "reference"
    assert select.tp_reduce(x, 1, 2, object(), "cpu", policy=P(tp_reduce="kernel")) == "kernel"
    assert select.tp_pick(1, 2, None, "gpu", policy=P(tp_pick="kernel")) == "reference"
    for bad in (dict(attention="cuda"), dict(moe="fast"), dict(spec_ops=True), dict(interpret="yes"),
                dict(moe_config=4)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            select.KernelPolicy(**bad)


def test_compiler_options(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    opts = select.compiler_options("gpu")
    assert opts == select.LOOP_GRAPHS and opts is not select.LOOP_GRAPHS
    assert select.compiler_options("cpu") == {}
    # XLA knows the names and values (a misspelt option is an error at compile time)
    jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile(compiler_options=opts)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")  # the user's choice stands
    assert select.compiler_options("gpu") == {}
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    assert select.compiler_options("gpu") == select.LOOP_GRAPHS
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # several processes: the same options
    assert select.compiler_options("gpu") == select.LOOP_GRAPHS
