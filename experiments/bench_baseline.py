"""Baseline generate() on a preset with random packed weights: memory, prefill time, time per token.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python experiments/bench_baseline.py --preset gpt-oss-120b \
      --prompt_len 2048 --new_tokens 32 --out experiments/results/baseline_gpt-oss-120b_h200.json

Prefill time is a `generate` call with max_new_tokens=1 (prefill + first token); time per token is
(T(1 + new_tokens) - T(1)) / new_tokens from calls of the same compiled executable. The two calls
alternate --repeats times after a compile (so a change in the machine's load hits both) and each
keeps its best; a difference that noise makes <= 0 raises rather than being reported.
"""

import json
import time

import jax
import numpy as np
from absl import flags
from lib import cli, step_timing, timing

from eagle3_jax.models import gpt_oss
from eagle3_jax.pallas import select
from eagle3_jax.spec import generate

step_timing.target_flags()
flags.DEFINE_integer("batch", 1, "sequences", lower_bound=1)
flags.DEFINE_integer("prompt_len", 2048, "prompt tokens per sequence", lower_bound=1)
flags.DEFINE_integer("new_tokens", 32, "generated tokens timed", lower_bound=1)
flags.DEFINE_integer("prefill_chunk", 2048, "prefill chunk (tokens)", lower_bound=1)
flags.DEFINE_integer("repeats", 2, "timed runs per measurement (best kept)", lower_bound=1)
flags.DEFINE_string("out", None, "JSON output path")
FLAGS = flags.FLAGS


def _memory():
    s = jax.devices()[0].memory_stats() or {}
    return {k: s[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in s}


def _best(fns, repeats):
    """(best seconds of each fn over `repeats` alternating rounds, the outputs of the first, compiling calls)."""
    firsts = [fn() for fn in fns]
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best, firsts


def main(argv):
    del argv
    cfg = step_timing.target_config()
    t0 = time.perf_counter()
    model = gpt_oss.random_gpt_oss(cfg, seed=0)
    jax.block_until_ready(jax.tree.leaves(model))
    build_s = time.perf_counter() - t0
    mem_model = _memory()
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (FLAGS.batch, FLAGS.prompt_len)).tolist()
    kw = dict(eos_ids=(), prefill_chunk=FLAGS.prefill_chunk)
    print(f"model built in {build_s:.1f} s; compiling ...", flush=True)
    (t_prefill, t_total), (first, out) = _best([lambda: generate(model, prompts, 1, **kw),
                                                lambda: generate(model, prompts, 1 + FLAGS.new_tokens, **kw)],
                                               FLAGS.repeats)
    assert all(len(t) == 1 + FLAGS.new_tokens for t in out.tokens)
    per_token = (t_total - t_prefill) / FLAGS.new_tokens
    if per_token <= 0:
        raise RuntimeError(f"timing noise: {1 + FLAGS.new_tokens} tokens took {t_total:.6f} s, 1 token "
                           f"{t_prefill:.6f} s; raise --new_tokens or --repeats")
    result = dict(
        **timing.device_info(), preset=FLAGS.preset, layers=cfg.num_hidden_layers,
        batch=FLAGS.batch, prompt_len=FLAGS.prompt_len, new_tokens=FLAGS.new_tokens,
        prefill_chunk=FLAGS.prefill_chunk, param_bytes=gpt_oss.param_bytes(model), build_seconds=build_s,
        compile_seconds=first.metrics["compile_seconds"], memory_after_build=mem_model, memory_after_run=_memory(),
        prefill_seconds=t_prefill, prefill_tokens_per_second=FLAGS.batch * FLAGS.prompt_len / t_prefill,
        seconds_per_generated_token=per_token, generated_tokens_per_second=FLAGS.batch / per_token,
        paths=(f"GPU: Pallas attention kernel (rope_attention); Pallas norm, routing and MXFP4 expert kernels for "
               f"<= {select.MOE_KERNEL_MAX_TOKENS} tokens per call (decode); in prefill, tokens grouped into expert "
               "tiles through the Pallas grouped MXFP4 kernels" if jax.default_backend() == "gpu"
               else "CPU: jnp reference attention and jnp MoE"),
    )
    print(json.dumps(result, indent=1))
    timing.write_json(FLAGS.out, result)


if __name__ == "__main__":
    cli.run(main)
