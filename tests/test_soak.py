"""A long-running process (a notebook sweeping shapes, depths and temperatures): 300 generate /
decode calls over 30 shapes keep the compiled programs, the device buffers and host memory (RSS)
bounded, the memory checks included. The shapes vary what the library buckets (prompt lengths
within a prefill chunk, budgets within LENGTH_BUCKET, temperatures above 0, eos ids, seeds) and what
it compiles for (generate or decode, greedy or sampled, the batch): a few programs, each compiled
once, then reused. Dropping programs past COMPILED_MAX is tests/test_compile_cache.py's sweep."""

import gc
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_compile_cache import rss_mib

from eagle3_jax.models import Eagle3Config, GptOssConfig, eagle3, gpt_oss
from eagle3_jax.spec import decode, generate, loop

CONFIG = GptOssConfig.preset("tiny").replace(num_hidden_layers=1, layer_types=())
DRAFT = Eagle3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=256, draft_vocab_size=256, target_hidden_size=64, aux_layer_ids=(0, 0, 0),
                     target_num_layers=1)
CALLS = 300
# (decode?, temperature, batch): the programs; prompt lengths, budgets, eos ids and seeds vary within them
PROGRAMS = [(False, 0.0, 1), (False, 0.8, 2), (True, 0.0, 1), (True, 0.9, 2)]
SHAPES = 30


def shapes():
    rng = np.random.default_rng(0)
    for i in range(SHAPES):
        spec, temperature, batch = PROGRAMS[i % len(PROGRAMS)]
        yield dict(spec=spec, temperature=temperature + 0.1 * (i % 3) * (temperature > 0), batch=batch,
                   lengths=rng.integers(1, 9, batch).tolist(), new=int(rng.integers(1, 12)), seed=i,
                   eos=rng.integers(0, 256, i % 4).tolist())


def call(t, d, s):
    prompts = [list(range(3, 3 + n)) for n in s["lengths"]]
    # a memory limit: the checks a GPU makes every call run here too (spec/memory.py)
    kw = dict(temperature=s["temperature"], eos_ids=s["eos"], seed=s["seed"], prefill_chunk=8,
              memory_limit=1 << 40)
    if s["spec"]:
        out = decode(t, d, prompts, s["new"], num_spec_tokens=2, **kw)
    else:
        out = generate(t, prompts, s["new"], **kw)
    assert len(out.tokens) == s["batch"] and all(1 <= len(x) <= s["new"] for x in out.tokens)
    return out.metrics["compile_seconds"]


def test_300_calls_over_30_shapes_stay_bounded():
    t = gpt_oss.GptOss(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0))
    d = eagle3.Eagle3(DRAFT, dtype=jnp.float32, rngs=nnx.Rngs(1))
    loop.COMPILED.clear()
    sweep = list(shapes())
    compiles = [call(t, d, s) for s in sweep]  # the first pass compiles each program once
    assert sum(c > 0 for c in compiles) == len(PROGRAMS) == len(loop.COMPILED), compiles
    gc.collect()
    arrays, rss = len(jax.live_arrays()), [rss_mib()]
    for i, s in enumerate(itertools.islice(itertools.cycle(sweep), CALLS - SHAPES)):
        assert call(t, d, s) == 0, (i, s)  # no call compiles again
        if i % SHAPES == SHAPES - 1:
            gc.collect()
            rss.append(rss_mib())
    assert len(loop.COMPILED) == len(PROGRAMS)
    assert len(jax.live_arrays()) == arrays  # no device buffer outlives its call
    print(f"RSS over the last {CALLS - SHAPES} calls (MiB): {np.round(rss, 1).tolist()}")
    assert rss[-1] - rss[0] < 10, rss  # host memory flat once every program is compiled
