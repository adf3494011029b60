"""Timing the library's own speculative step and its named parts (eagle3_jax/spec/step.py), and the
baseline step (the same `step` drafting nothing).

Every timing runs its work in one jitted `fori_loop` over a `DecodeState` carried (donated, updated
in place) as decode's `while_loop` does, parameters passed as arguments, and takes off the cost of
the call itself (`loop_time`). Parts: draft (`propose`: tree + mask), verify (`verify` + `choose`:
the target over the N nodes and its pick at every node), accept (`accept` + `path_tokens`), rewind
(trees only), extend (the draft over the accepted tokens). Caches hold noise; the context stays at
`ctx` committed tokens. Verify runs over the step's own sequence of trees, recorded beforehand, so
that its MoE routing is the step's.
"""

import re
import statistics
import time

from absl import flags

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.models import Eagle3Config, eagle3, gpt_oss
from eagle3_jax.spec import step as spec_step
from eagle3_jax.spec.metrics import Counters
from eagle3_jax.spec.state import DecodeState, Plan

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


def decode_kwargs(s):
    """A draft shape string -> decode's keyword arguments (num_spec_tokens, topk, num_draft_tokens)."""
    p = parse_shape(s)
    return dict(num_spec_tokens=p["depth"], topk=p["topk"], num_draft_tokens=p["num_nodes"])


def median_seconds(run, repeats):
    """The median of `metrics["seconds"]` (the call's run time, compile excluded) over `repeats` calls
    of run() (a generate or decode call)."""
    return statistics.median(run().metrics["seconds"] for _ in range(repeats))


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


def noisy_state(target, draft, B, ctx, plan):
    """A `DecodeState` at context `ctx` (caches of plan.cache_len slots filled with noise), no slot done,
    no budget or eos that could end it."""
    key = jax.random.key(0)
    noise = lambda c: jax.tree.map(lambda a: (jax.random.normal(key, a.shape, jnp.float32) * 0.5).astype(a.dtype), c)  # noqa: E731
    return DecodeState(
        target_cache=noise(gpt_oss.init_cache(target, B, plan.cache_len)),
        draft_cache=noise(eagle3.init_cache(draft, B, plan.cache_len)) if plan.depth else None,
        lengths=jnp.full((B,), ctx, jnp.int32), root=jnp.arange(B, dtype=jnp.int32) + 7,
        h_root=jax.random.normal(key, (B, draft.config.hidden_size), draft.dtype) if plan.depth else None,
        out=jnp.zeros((B, plan.out_len), jnp.int32), n_out=jnp.zeros((B,), jnp.int32), done=jnp.zeros((B,), bool),
        budget=jnp.int32(2 ** 30), eos_ids=jnp.full((8,), -1, jnp.int32), temperature=jnp.float32(1.0), key=key,
        steps=jnp.zeros((), jnp.int32), counters=Counters.zeros(plan.depth))


def same_context(new, old):
    """The state after a step with the context, output count and done mask put back, so that every
    iteration of a timing loop sees the same work."""
    return new.replace(lengths=old.lengths, n_out=old.n_out, done=old.done)


def time_step(target, draft, B, shape, ctx, iters=10, parts=True, profile=False, proposal="deterministic"):
    """Seconds of one speculative step (`eagle3_jax.spec.step.step`) over B sequences at context `ctx`
    (caches filled with noise), and with `parts` each of its parts alone: draft (`propose`), verify
    (`verify` + `choose`), accept (`accept` + `path_tokens`), rewind (trees), extend. With `profile`,
    the result's "kernels" holds each one's device kernel seconds per iteration by kernel family.
    proposal "deterministic" runs greedy (argmax choices); "sample" draws the drafts at temperature 1
    and its accept part is `accept_sampled` (the target's softmax + `accept_sample`)."""
    depth, topk, N = shape["depth"], shape["topk"], shape["num_nodes"]
    sample = proposal == "sample"
    plan = Plan(cache_len=ctx + 2 * N + depth + 8, out_len=8, chunk=1, greedy=not sample, depth=depth, topk=topk,
                num_nodes=N, feature_ids=tuple(draft.config.feature_layers), proposal=proposal)
    graphdef, params = nnx.split((target, draft))
    s = noisy_state(target, draft, B, ctx, plan)
    times, kernels = {}, {}

    def timed(name, fn, carry):
        times[name], kernels[name] = loop_time(graphdef, params, fn, carry, iters, profile)

    def full(m, st):
        return same_context(spec_step.step(m, st, plan), st)

    timed("step", full, s)
    if not parts:
        return dict(batch=B, context=ctx, **shape, proposal=proposal, seconds=times,
                    **({"kernels": kernels} if profile else {}))

    def part_draft(m, st):
        tokens, parents, bits, positions, q = spec_step.propose(m[1], st, plan)
        used = tokens[:, -1] + positions[:, -1] + parents[:, -1] + bits[:, -1, 0].astype(jnp.int32)
        return st.replace(root=used + (0 if q is None else (q[:, 0, 0] > 2).astype(jnp.int32)))

    timed("draft", part_draft, s)
    # verify sees the step's own sequence of trees (the MoE kernel's time depends on the routing)
    def step_trees(m, st):
        def body(c, _):
            return full(m, c), spec_step.propose(m[1], c, plan)
        return jax.lax.scan(body, st, None, length=iters)[1]

    all_tokens, all_parents, all_mask, all_pos, all_q = once(graphdef, params, step_trees, s)  # [iters, B, N, ...]

    def part_verify(m, c):  # the target over the N nodes (and, deterministic, its choice at every node)
        i = c["i"] % iters
        logits, feats, tc = spec_step.verify(m[0], c["s"], all_tokens[i], all_pos[i], all_mask[i], plan)
        if sample:
            used = (logits[:, :, 0] > 1e30).sum(-1)
        else:
            used = jnp.sum(spec_step.choose(logits, c["s"].key, c["s"].temperature, plan), -1)
        used = used + (feats[:, 0, 0] > 1e30)  # so that no output is dead code
        return dict(s=c["s"].replace(target_cache=tc), i=c["i"] + 1, used=c["used"] + used)

    timed("verify", part_verify, dict(s=s, i=jnp.int32(0), used=jnp.zeros((B,), jnp.int32)))
    tokens, parents, mask, positions = all_tokens[0], all_parents[0], all_mask[0], all_pos[0]
    q = None if all_q is None else all_q[0]
    logits, feats, _ = once(graphdef, params, lambda m, st: spec_step.verify(m[0], st, tokens, positions, mask, plan),
                            s)

    def accept_once(m, key, logits, q):  # arrays as arguments: a closed-over one is baked in as a constant
        if sample:
            return spec_step.accept_sampled(m[1], logits, tokens, parents, q, key, s.temperature, plan)
        return spec_step.accept(tokens, parents, spec_step.choose(logits, key, s.temperature, plan), plan)

    def part_accept(m, c):
        acc, path, bonus = accept_once(m, jax.random.fold_in(s.key, c["acc"][0]), c["logits"], c["q"])
        nxt = spec_step.path_tokens(tokens, path, acc, bonus)
        return dict(c, acc=c["acc"] + acc + path[:, 0] + nxt[:, 0])

    timed("accept", part_accept, dict(acc=jnp.zeros((B,), jnp.int32), logits=logits, q=q))
    acc, path, bonus = once(graphdef, params, accept_once, s.key, logits, q)
    nxt = spec_step.path_tokens(tokens, path, acc, bonus)
    if topk > 1:
        def part_rewind(m, st):
            return st.replace(target_cache=spec_step.rewind(st.target_cache, st.lengths, path, acc, plan))

        timed("rewind", part_rewind, s)

    def part_extend(m, st):
        dc, h = spec_step.extend(m[1], st, nxt, feats, path, acc, plan)
        return st.replace(draft_cache=dc, h_root=st.h_root + h)

    timed("extend", part_extend, s)
    parts = sum(v for k, v in times.items() if k != "step")
    out = dict(batch=B, context=ctx, **shape, proposal=proposal, seconds=times, sum_of_parts=parts,
               step_over_parts=times["step"] / parts)
    if profile:
        out["kernels"] = kernels
    return out


def time_baseline(target, B, ctx, iters=10):
    """Seconds of one baseline decode step (`step` with no draft: one token per sequence, the target's
    argmax, the commit) at context `ctx`."""
    plan = Plan(cache_len=ctx + 8, out_len=8, chunk=1, greedy=True)
    graphdef, params = nnx.split((target, None))
    s = noisy_state(target, None, B, ctx, plan)
    return loop_time(graphdef, params, lambda m, st: same_context(spec_step.step(m, st, plan), st), s, iters)[0]


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
