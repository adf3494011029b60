"""Timing a speculative step and its parts, and a baseline decode step, the way decode runs them.

Every timing runs its work `iters` times inside one jitted `fori_loop` with the caches carried
(donated, updated in place) as decode's `while_loop` does, parameters passed as arguments. Parts:
draft (tree + mask), verify (target over the N nodes), accept, rewind (trees only), extend (draft
over the accepted tokens). Caches hold noise; the context is `ctx` committed tokens.
"""

import time

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.models import Eagle3Config, eagle3, gpt_oss
from eagle3_jax.models import kv_cache as kvc
from eagle3_jax.pallas.accept import accept_greedy
from eagle3_jax.pallas.kv_rewind import kv_rewind
from eagle3_jax.pallas.tree_mask import tree_mask
from eagle3_jax.spec import step as spec_step
from eagle3_jax.spec.tree import draft_tree


def parse_shape(s):
    """'chain3' or 'tree3x4n8' (depth x topk, n nodes incl. the root) -> dict(depth, topk, num_nodes)."""
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


def once(graphdef, params, fn, *args):
    """fn(models, *args) once, jitted; arrays go in as arguments (a closed-over cache would be
    baked into the program as a constant)."""
    return jax.jit(lambda p, *a: fn(nnx.merge(graphdef, p), *a))(params, *args)


def time_step(target, draft, B, shape, ctx, iters=10, parts=True):
    """Seconds of one speculative step over B sequences at context `ctx` (caches filled with noise),
    and with `parts` each part alone: draft, verify, accept, rewind (trees), extend."""
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

    times["step"] = loop_time(graphdef, params, full, s, iters)
    if not parts:
        return dict(batch=B, context=ctx, **shape, seconds=times)

    def make_tree(m, c):
        return draft_tree(m[1], c["dcache"], L, c["root"], c["h_root"], depth=depth, topk=topk, num_nodes=N)

    def part_draft(m, c):
        tokens, parents = make_tree(m, c)
        bits, _, positions, _, _ = tree_mask(parents, L)
        return dict(c, root=tokens[:, -1] + positions[:, -1] + bits[:, -1, 0].astype(jnp.int32))

    times["draft"] = loop_time(graphdef, params, part_draft,
                               dict(dcache=s["dcache"], root=s["root"], h_root=s["h_root"]), iters)
    tokens, parents = once(graphdef, params, make_tree, s)
    mask, _, positions, _, _ = tree_mask(parents, L)

    def verify(m, tcache, toks):
        return gpt_oss.step(m[0], tcache, toks, positions, L, mask, fids)

    def part_verify(m, c):
        logits, feats, tc = verify(m, c["tcache"], c["tokens"])
        return dict(tcache=tc, tokens=c["tokens"] + (jnp.argmax(logits[:, :1], -1) * 0).astype(jnp.int32))

    logits, feats, _ = once(graphdef, params, lambda m, tc: verify(m, tc, tokens), s["tcache"])
    times["verify"] = loop_time(graphdef, params, part_verify, dict(tcache=s["tcache"], tokens=tokens), iters)

    def part_accept(m, c):
        choice = jnp.argmax(c["logits"], axis=-1).astype(jnp.int32)
        acc, path, bonus = accept_greedy(tokens, parents, choice, max_depth=depth)
        return dict(logits=c["logits"], acc=c["acc"] + acc + path[:, 0] + bonus * 0)

    times["accept"] = loop_time(graphdef, params, part_accept, dict(logits=logits, acc=jnp.zeros((B,), jnp.int32)),
                                iters)
    acc, path, bonus = accept_greedy(tokens, parents, jnp.argmax(logits, -1).astype(jnp.int32), max_depth=depth)
    path = jnp.maximum(path, 0)
    if topk > 1:
        def part_rewind(m, c):
            k, v = kv_rewind(c["tcache"].k, c["tcache"].v, L, path, acc)
            return dict(tcache=kvc.KVCache(k=tuple(k), v=tuple(v)))

        times["rewind"] = loop_time(graphdef, params, part_rewind, dict(tcache=s["tcache"]), iters)
    W = depth + 1
    f = jnp.take_along_axis(feats, path[:, :, None], axis=1)
    nxt = jnp.take_along_axis(tokens, jnp.minimum(path, N - 1), axis=1)[:, :W]

    def part_extend(m, c):
        d = m[1]
        h, dc = eagle3.layer(d, nxt, eagle3.project(d, f), L[:, None] + jnp.arange(W)[None], L, None, c["dcache"])
        return dict(dcache=dc, h=c["h"] + h[:, 0])

    times["extend"] = loop_time(graphdef, params, part_extend, dict(dcache=s["dcache"], h=s["h_root"]), iters)
    parts = sum(v for k, v in times.items() if k != "step")
    return dict(batch=B, context=ctx, **shape, seconds=times, sum_of_parts=parts, step_over_parts=times["step"] / parts)


def time_baseline(target, B, ctx, iters=10):
    """Seconds of one baseline decode step (one token per sequence) at context `ctx`."""
    graphdef, params = nnx.split(target)
    key = jax.random.key(0)
    cache = jax.tree.map(lambda a: (jax.random.normal(key, a.shape, jnp.float32) * 0.5).astype(a.dtype),
                         gpt_oss.init_cache(target, B, ctx + 8))
    L = jnp.full((B,), ctx, jnp.int32)

    def one(m, c):
        logits, _, tc = gpt_oss.step(m, c["cache"], c["tok"][:, None], L[:, None], L)
        return dict(cache=tc, tok=jnp.argmax(logits[:, 0], -1).astype(jnp.int32))

    return loop_time(graphdef, params, one, dict(cache=cache, tok=jnp.zeros((B,), jnp.int32)), iters)


def random_pair(tcfg):
    """Random packed target of `tcfg` and a random draft of the published gpt-oss-120b EAGLE-3 shape
    scaled to it (hidden = target hidden, MLP 6x, draft vocab 32000 or the whole vocab if smaller)."""
    dcfg = Eagle3Config(
        hidden_size=tcfg.hidden_size, intermediate_size=6 * tcfg.hidden_size,
        num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=tcfg.head_dim, vocab_size=tcfg.vocab_size, draft_vocab_size=min(32000, tcfg.vocab_size),
        target_hidden_size=tcfg.hidden_size, aux_layer_ids=tcfg.default_aux_layer_ids(),
        target_num_layers=tcfg.num_hidden_layers, max_position_embeddings=tcfg.max_position_embeddings)
    return gpt_oss.random_gpt_oss(tcfg, seed=0), eagle3.random_eagle3(dcfg, seed=1)
