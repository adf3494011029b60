"""Timing a speculative step and its parts, and a baseline decode step, the way decode runs them.

Every timing runs its work in one jitted `fori_loop` with the caches carried (donated, updated in
place) as decode's `while_loop` does, parameters passed as arguments, and takes off the cost of the
call itself (`loop_time`). Parts:
draft (tree + mask), verify (target over the N nodes), accept, rewind (trees only), extend (draft
over the accepted tokens). Caches hold noise; the context is `ctx` committed tokens. Verify
(the target over the N nodes and the argmax at every node) runs over the step's own sequence of
trees, recorded beforehand, so that its MoE routing is the step's; accept is the accept kernel.
"""

import re
import time

from absl import flags

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

from . import timing


SHAPE_FORMAT = ("chainK or treeDxKnN (a chain of K drafts; a tree of depth D, topk K, N nodes incl. the root), "
                "e.g. chain3, tree3x4n8")


def parse_shape(s):
    """'chain3' or 'tree3x4n8' (depth x topk, n nodes incl. the root) -> dict(depth, topk, num_nodes).
    Anything else raises ValueError naming SHAPE_FORMAT."""
    m = re.fullmatch(r"chain([1-9]\d*)|tree([1-9]\d*)x([1-9]\d*)n([1-9]\d*)", s)
    if m is None:
        raise ValueError(f"draft shape {s!r}: expected {SHAPE_FORMAT}")
    if m[1]:
        return dict(depth=int(m[1]), topk=1, num_nodes=int(m[1]) + 1)
    return dict(depth=int(m[2]), topk=int(m[3]), num_nodes=int(m[4]))


def validate_shape_flags(*names):
    """Parse the shapes of these list flags when flags are parsed: a bad one stops the script there."""
    def check(shapes):
        for s in shapes:
            try:
                parse_shape(s)
            except ValueError as e:
                raise flags.ValidationError(str(e)) from e
        return True
    for name in names:
        flags.register_validator(name, check)


def loop_time(graphdef, params, fn, carry, iters, profile=False, repeats=3):
    """Seconds per iteration of `carry = fn(models, carry)` run in one jitted fori_loop (parameters
    passed as arguments, the carry donated so caches update in place), without the call's own cost:
    (best time of a call of n iterations - best time of a call of none) / n, n = `iters`, raised
    4x at a time (to at most 64 * iters) until the call takes at least twice the empty one. The trip
    count is an argument, so every call shares one executable. The call's own cost is host work that
    does not overlap the device's: handing over the ~550 parameter arrays of gpt-oss-120b takes about
    a millisecond (on CPU: 0.8-1.8 ms, against 13-50 us for a call with one array); divided by 8
    iterations it had added 0.27-0.36 ms to each baseline and step figure of bench.py on the H200, and
    0.21 ms of the accept part's 0.23. With a trip count that is an argument, the loop reads its
    condition on the host each iteration, as decode's while_loop does (about 3 us of device time).
    Callers keep the context fixed across iterations, so any n sees the same work.
    With `profile`, also the device kernel seconds per iteration by kernel family
    (`timing.kernel_group`, plus "launches": kernels per iteration; `iters` iterations); else {}."""
    def run(params, c, n):
        m = nnx.merge(graphdef, params)
        return jax.lax.fori_loop(0, n, lambda i, c: fn(m, c), c)

    run = jax.jit(run, donate_argnums=1)
    box = [jax.tree.map(jnp.copy, carry)]  # the caller keeps its arrays; the loop owns these

    def call(n):
        box[0] = run(params, box[0], jnp.int32(n))
        return box[0]

    def best_of(n):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(call(n))
            best = min(best, time.perf_counter() - t0)
        return best

    jax.block_until_ready(call(iters))  # compile + warm
    empty, n = best_of(0), iters
    full = best_of(n)
    while full < 2 * empty and n < 64 * iters:
        n *= 4
        full = best_of(n)
    groups = {}
    if profile:
        recs = timing.kernel_records(lambda: call(iters), repeats=1)
        for name, _, dur in recs:
            g = timing.kernel_group(name)
            groups[g] = groups.get(g, 0.0) + dur * 1e-9 / iters
        if recs:
            groups["launches"] = len(recs) / iters
    return (full - empty) / n, groups


def once(graphdef, params, fn, *args):
    """fn(models, *args) once, jitted; arrays go in as arguments (a closed-over cache would be
    baked into the program as a constant)."""
    return jax.jit(lambda p, *a: fn(nnx.merge(graphdef, p), *a))(params, *args)


def time_step(target, draft, B, shape, ctx, iters=10, parts=True, profile=False):
    """Seconds of one speculative step over B sequences at context `ctx` (caches filled with noise),
    and with `parts` each part alone: draft, verify, accept, rewind (trees), extend. With `profile`,
    the result's "kernels" holds each one's device kernel seconds per iteration by kernel family."""
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
    times, kernels = {}, {}

    def timed(name, fn, carry):
        times[name], kernels[name] = loop_time(graphdef, params, fn, carry, iters, profile)

    def full(m, st):  # lengths stay put so every iteration sees the same context
        new, *_ = spec_step.step(*m, st, **kw)
        return dict(st, tcache=new["tcache"], dcache=new["dcache"], root=new["root"], h_root=new["h_root"])

    timed("step", full, s)
    if not parts:
        return dict(batch=B, context=ctx, **shape, seconds=times, **({"kernels": kernels} if profile else {}))

    def make_tree(m, c):
        return draft_tree(m[1], c["dcache"], L, c["root"], c["h_root"], depth=depth, topk=topk, num_nodes=N)

    def part_draft(m, c):
        tokens, parents = make_tree(m, c)
        bits, _, positions, _, _ = tree_mask(parents, L)
        return dict(c, root=tokens[:, -1] + positions[:, -1] + bits[:, -1, 0].astype(jnp.int32))

    timed("draft", part_draft, dict(dcache=s["dcache"], root=s["root"], h_root=s["h_root"]))
    # verify sees the step's own sequence of trees (the MoE kernel's time depends on the routing)
    def step_trees(m, st):
        def body(c, _):
            return full(m, c), make_tree(m, c)
        return jax.lax.scan(body, st, None, length=iters)[1]

    all_tokens, all_parents = once(graphdef, params, step_trees, s)  # [iters, B, N]
    masks = [tree_mask(all_parents[i], L) for i in range(iters)]
    all_mask = jnp.stack([t[0] for t in masks])
    all_pos = jnp.stack([t[2] for t in masks])

    def part_verify(m, c):  # the target over the N nodes and its greedy choice at every node
        i = c["i"] % iters
        logits, feats, tc = gpt_oss.step(m[0], c["tcache"], all_tokens[i], all_pos[i], L, all_mask[i], fids)
        choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        used = jnp.sum(choice, -1) + (feats[:, 0, 0] > 1e30)  # so that no output is dead code
        return dict(tcache=tc, i=c["i"] + 1, used=c["used"] + used)

    timed("verify", part_verify, dict(tcache=s["tcache"], i=jnp.int32(0), used=jnp.zeros((B,), jnp.int32)))
    tokens, parents, mask, positions = all_tokens[0], all_parents[0], all_mask[0], all_pos[0]
    logits, feats, _ = once(graphdef, params, lambda m, tc: gpt_oss.step(m[0], tc, tokens, positions, L, mask, fids),
                            s["tcache"])
    choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def part_accept(m, c):
        acc, path, bonus = accept_greedy(tokens, parents, c["choice"], max_depth=depth)
        return dict(choice=c["choice"], acc=c["acc"] + acc + path[:, 0] + bonus)

    timed("accept", part_accept, dict(choice=choice, acc=jnp.zeros((B,), jnp.int32)))
    acc, path, bonus = accept_greedy(tokens, parents, choice, max_depth=depth)
    path = jnp.maximum(path, 0)
    if topk > 1:
        def part_rewind(m, c):
            k, v = kv_rewind(c["tcache"].k, c["tcache"].v, L, path, acc)
            return dict(tcache=kvc.KVCache(k=tuple(k), v=tuple(v)))

        timed("rewind", part_rewind, dict(tcache=s["tcache"]))
    W = depth + 1
    f = jnp.take_along_axis(feats, path[:, :, None], axis=1)
    nxt = jnp.take_along_axis(tokens, jnp.minimum(path, N - 1), axis=1)[:, :W]

    def part_extend(m, c):
        d = m[1]
        h, dc = eagle3.layer(d, nxt, eagle3.project(d, f), L[:, None] + jnp.arange(W)[None], L, None, c["dcache"])
        return dict(dcache=dc, h=c["h"] + h[:, 0])

    timed("extend", part_extend, dict(dcache=s["dcache"], h=s["h_root"]))
    parts = sum(v for k, v in times.items() if k != "step")
    out = dict(batch=B, context=ctx, **shape, seconds=times, sum_of_parts=parts, step_over_parts=times["step"] / parts)
    if profile:
        out["kernels"] = kernels
    return out


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

    return loop_time(graphdef, params, one, dict(cache=cache, tok=jnp.zeros((B,), jnp.int32)), iters)[0]


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
