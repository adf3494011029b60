"""One speculative step against the sum of its parts, and no recompilation across calls.

  python experiments/bench_step.py --layers 8 --experts 32 --batch 1,4 --context 2048 \
      --out experiments/results/step_midsize_h200.json

Mid-size target: gpt-oss-120b widths (hidden 2880, 64/8 heads, vocab 201088) with fewer layers
and experts; a random draft of the published gpt-oss-120b EAGLE-3 shape. Every timing runs its
work `--iters` times inside one jitted `fori_loop` with the caches carried in place, as decode's
`while_loop` does, so a step and its parts are timed the same way: draft (tree + mask),
verify (target over the N nodes), accept, rewind (trees only) and extend (draft over the
accepted tokens). A step much slower than the sum of its parts would mean a hidden sync or copy.
"""

import json
import os
import time

import numpy as np
from absl import app, flags

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.models import Eagle3Config, GptOssConfig, eagle3, gpt_oss
from eagle3_jax.spec import decode
from eagle3_jax.spec import step as spec_step
from eagle3_jax.spec.tree import draft_tree, pack_bits

import timing

flags.DEFINE_integer("layers", 8, "target layers")
flags.DEFINE_integer("experts", 32, "target experts (top-4)")
flags.DEFINE_list("batch", ["1", "4"], "batch sizes")
flags.DEFINE_integer("context", 2048, "committed tokens per sequence")
flags.DEFINE_list("shapes", ["chain3", "tree3x4n8"], "chainK or treeDxKnN")
flags.DEFINE_integer("iters", 10, "steps per timed loop")
flags.DEFINE_string("preset", None, "use this GptOssConfig preset instead (e.g. tiny, for a smoke run)")
flags.DEFINE_string("out", None, "JSON output path")
FLAGS = flags.FLAGS


def parse_shape(s):
    if s.startswith("chain"):
        k = int(s[5:])
        return dict(depth=k, topk=1, num_nodes=k + 1)
    d, rest = s[4:].split("x")
    k, n = rest.split("n")
    return dict(depth=int(d), topk=int(k), num_nodes=int(n))


def loop_time(graphdef, params, fn, carry, iters):
    """Seconds per iteration of `carry = fn(models, carry)` run `iters` times in one jitted
    fori_loop (parameters passed as arguments, the carry donated so caches update in place)."""
    def run(params, c):
        m = nnx.merge(graphdef, params)
        return jax.lax.fori_loop(0, iters, lambda i, c: fn(m, c), c)

    run = jax.jit(run, donate_argnums=1)
    carry = jax.tree.map(jnp.copy, carry)  # the caller keeps its arrays; the loop owns these
    carry = jax.block_until_ready(run(params, carry))  # compile + warm
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(run(params, carry))
        best = min(best, time.perf_counter() - t0)
    return best / iters


def once(graphdef, params, fn):
    return jax.jit(lambda p: fn(nnx.merge(graphdef, p)))(params)


def models():
    if FLAGS.preset:
        tcfg = GptOssConfig.preset(FLAGS.preset)
    else:
        tcfg = GptOssConfig.preset("gpt-oss-120b").replace(
            num_hidden_layers=FLAGS.layers, layer_types=(), num_local_experts=FLAGS.experts)
    L = tcfg.num_hidden_layers
    dcfg = Eagle3Config(
        hidden_size=tcfg.hidden_size, intermediate_size=6 * tcfg.hidden_size,
        num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=tcfg.head_dim, vocab_size=tcfg.vocab_size, draft_vocab_size=min(32000, tcfg.vocab_size),
        target_hidden_size=tcfg.hidden_size, aux_layer_ids=tcfg.default_aux_layer_ids(), target_num_layers=L)
    target = gpt_oss.random_gpt_oss(tcfg, seed=0)
    draft = eagle3.random_eagle3(dcfg, seed=1)
    return target, draft


def bench_one(target, draft, B, shape, ctx):
    depth, topk, N = shape["depth"], shape["topk"], shape["num_nodes"]
    cap = ctx + 2 * N + depth + 8
    fids = draft.config.feature_layers
    graphdef, params = nnx.split((target, draft))
    key = jax.random.key(0)
    noise = lambda c: jax.tree.map(lambda a: (jax.random.normal(key, a.shape, jnp.float32) * 0.5).astype(a.dtype), c)  # noqa: E731
    s = dict(tcache=noise(gpt_oss.init_cache(target, B, cap)), dcache=noise(eagle3.init_cache(draft, B, cap)),
             lengths=jnp.full((B,), ctx, jnp.int32), root=jnp.arange(B, dtype=jnp.int32) + 7,
             h_root=jax.random.normal(key, (B, draft.config.hidden_size), draft.dtype))
    L = s["lengths"]
    kw = dict(depth=depth, topk=topk, num_nodes=N, feature_ids=fids, greedy=True, temperature=1.0, key=key)
    times = {}

    def full(m, st):  # lengths stay put so every iteration sees the same context
        new, *_ = spec_step.step(*m, st, **kw)
        return dict(st, tcache=new["tcache"], dcache=new["dcache"], root=new["root"], h_root=new["h_root"])

    times["step"] = loop_time(graphdef, params, full, s, FLAGS.iters)

    def make_tree(m, c):
        return draft_tree(m[1], c["dcache"], L, c["root"], c["h_root"], depth=depth, topk=topk, num_nodes=N)

    def part_draft(m, c):
        tokens, parents = make_tree(m, c)
        anc, dep = spec_step.tree_structure(parents)
        return dict(c, root=tokens[:, -1] + dep[:, -1] + anc[:, -1, 0].astype(jnp.int32))

    times["draft"] = loop_time(graphdef, params, part_draft,
                               dict(dcache=s["dcache"], root=s["root"], h_root=s["h_root"]), FLAGS.iters)
    tokens, parents = once(graphdef, params, lambda m: make_tree(m, s))
    anc, dep = spec_step.tree_structure(parents)
    mask = pack_bits(anc)

    def verify(m, tcache, toks):
        return gpt_oss.step(m[0], tcache, toks, L[:, None] + dep, L, mask, fids)

    def part_verify(m, c):
        logits, feats, tc = verify(m, c["tcache"], c["tokens"])
        return dict(tcache=tc, tokens=c["tokens"] + (jnp.argmax(logits[:, :1], -1) * 0).astype(jnp.int32))

    logits, feats, _ = once(graphdef, params, lambda m: verify(m, s["tcache"], tokens))
    times["verify"] = loop_time(graphdef, params, part_verify, dict(tcache=s["tcache"], tokens=tokens), FLAGS.iters)

    def part_accept(m, c):
        choice = jnp.argmax(c["logits"], axis=-1).astype(jnp.int32)
        acc, path, bonus = spec_step.accept(tokens, parents, dep, choice, depth)
        return dict(logits=c["logits"], acc=c["acc"] + acc + path[:, 0] + bonus * 0)

    times["accept"] = loop_time(graphdef, params, part_accept, dict(logits=logits, acc=jnp.zeros((B,), jnp.int32)),
                                FLAGS.iters)
    acc, path, bonus = spec_step.accept(tokens, parents, dep, jnp.argmax(logits, -1).astype(jnp.int32), depth)
    if topk > 1:
        times["rewind"] = loop_time(graphdef, params, lambda m, c: dict(tcache=spec_step.rewind(c["tcache"], L, path)),
                                    dict(tcache=s["tcache"]), FLAGS.iters)
    W = depth + 1
    f = jnp.take_along_axis(feats, path[:, :, None], axis=1)
    nxt = jnp.take_along_axis(tokens, jnp.minimum(path, N - 1), axis=1)[:, :W]

    def part_extend(m, c):
        d = m[1]
        h, dc = eagle3.layer(d, nxt, eagle3.project(d, f), L[:, None] + jnp.arange(W)[None], L, None, c["dcache"])
        return dict(dcache=dc, h=c["h"] + h[:, 0])

    times["extend"] = loop_time(graphdef, params, part_extend, dict(dcache=s["dcache"], h=s["h_root"]), FLAGS.iters)
    parts = sum(v for k, v in times.items() if k != "step")
    return dict(batch=B, context=ctx, **shape, seconds=times, sum_of_parts=parts, step_over_parts=times["step"] / parts)


def main(argv):
    del argv
    target, draft = models()
    rows = []
    for B in map(int, FLAGS.batch):
        for name in FLAGS.shapes:
            r = bench_one(target, draft, B, parse_shape(name), FLAGS.context)
            rows.append(r)
            print(f"B={B} {name}: step {r['seconds']['step'] * 1e3:.3f} ms, parts {r['sum_of_parts'] * 1e3:.3f} ms, "
                  f"ratio {r['step_over_parts']:.3f}  " +
                  " ".join(f"{k}={v * 1e3:.3f}" for k, v in r["seconds"].items() if k != "step"), flush=True)
    rng = np.random.default_rng(0)
    V = target.config.vocab_size
    prompts = [rng.integers(0, V, 40).tolist(), rng.integers(0, V, 25).tolist()]
    a = decode(target, draft, prompts, 16, num_spec_tokens=3, eos_ids=(), prefill_chunk=64)
    b = decode(target, draft, [p[::-1] for p in prompts], 12, num_spec_tokens=3, eos_ids=(), prefill_chunk=64)
    result = dict(timing.device_info(), target=dict(layers=target.config.num_hidden_layers,
                                                    experts=target.config.num_local_experts,
                                                    hidden=target.config.hidden_size, vocab=V),
                  draft=dict(hidden=draft.config.hidden_size, mlp=draft.config.intermediate_size,
                             draft_vocab=draft.config.draft_vocab_size),
                  iters=FLAGS.iters, rows=rows, recompile_check=dict(
                      first_compile_seconds=a.metrics["compile_seconds"],
                      second_call_compile_seconds=b.metrics["compile_seconds"]))
    print(json.dumps(result["recompile_check"]))
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    app.run(main)
