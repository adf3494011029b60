"""spec/loop.py keeps a bounded number of compiled programs: a notebook sweeping shapes does not grow
host memory without bound (the executables, and JAX's own tracing and lowering caches of them, are
released once the LRU drops them)."""

import gc
import weakref

import jax.numpy as jnp
import pytest
from flax import nnx

from eagle3_jax.models import GptOssConfig, gpt_oss
from eagle3_jax.spec import generate, loop

PLANS = 30


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.slow
def test_a_sweep_of_plans_keeps_host_memory_flat():
    cfg = GptOssConfig.preset("tiny").replace(num_hidden_layers=1, layer_types=())
    target = gpt_oss.GptOss(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    loop.COMPILED.clear()
    programs, rss = [], []
    for i in range(1, PLANS + 1):  # each prefill chunk is another plan: another program
        out = generate(target, [[5, 6, 7]], 2, eos_ids=(), prefill_chunk=8 * i)
        assert out.metrics["compile_seconds"] > 0 and len(out.tokens[0]) == 2
        programs.append(weakref.ref(next(reversed(loop.COMPILED.values()))))
        gc.collect()
        rss.append(rss_mib())
    assert len(loop.COMPILED) == loop.COMPILED_MAX
    alive = [p() is not None for p in programs]
    assert alive == [False] * (PLANS - loop.COMPILED_MAX) + [True] * loop.COMPILED_MAX, alive
    # after the cache is full, each new plan replaces one: at most ~1 MiB a plan of allocator and JAX
    # bookkeeping (keeping every program grew ~5 MiB a plan)
    late = rss[-1] - rss[loop.COMPILED_MAX]
    assert late < 1.5 * (PLANS - 1 - loop.COMPILED_MAX), (late, rss)
    # the latest plan is still cached: no compile on reuse
    again = generate(target, [[5, 6, 7]], 2, eos_ids=(), prefill_chunk=8 * PLANS)
    assert again.metrics["compile_seconds"] == 0 and again.tokens == out.tokens
