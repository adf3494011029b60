"""One iteration of the decode loop: `step(models, state, plan) -> state`.

    propose -> verify -> choose -> accept -> rewind -> extend -> commit

With a draft (plan.depth >= 1) the draft proposes a chain or tree of plan.num_nodes tokens, the
target verifies them in one pass and the accepted prefix plus a bonus token is committed. Without
one (depth 0, `generate`) the root alone is verified and the target's pick is the bonus: the same
step, drafting nothing.

Acceptance, proposal "deterministic" (the draft's best children): on the target's choice y at every
node, its argmax (greedy) or one independent draw from p per node (sampling). Node i is
accepted iff its token equals y at its parent and its parent is accepted; the bonus is y at the
deepest accepted node. With draws this is sequential rejection with the drafts taken as given
(one-hot q): each committed token is exactly a draw from the target, for chains and trees alike
(SGLang's "target only" verification). Proposal "sample" (drafts drawn from the draft's q at the
decoding temperature): recursive rejection with q, `pallas.accept.accept_sample` (accept a child
with min(1, r/q), else r <- norm(max(r - q, 0)) and try the next sibling; the bonus is drawn from
what is left). p is softmax(target logits / T) with the tokens the sampling filters drop (top_k,
top_p, min_p: spec/sampling.py; state.filters, None for none) at zero, and q the draft's under the
same filters, so the committed tokens follow the filtered target law.
depth="auto" (plan.auto): the step first chooses one of the plan's options from earlier steps alone
(spec/adaptive.py), runs it (each option compiled once) and records what it accepted. Option 0, no
drafts: the target verifies the root alone; the draft runs over such steps' tokens later, at once.
Each part is a public function so that benchmarks time the library's own parts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from eagle3_jax import parallel
from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.models import kv_cache as kvc
from eagle3_jax.pallas.accept import accept_greedy, accept_sample, uniforms
from eagle3_jax.pallas.kv_rewind import kv_rewind
from eagle3_jax.pallas.tree_mask import tree_mask
from eagle3_jax.spec import adaptive
from eagle3_jax.spec.sampling import Filters, filter_logits
from eagle3_jax.spec.state import DecodeState, Plan
from eagle3_jax.spec.tree import draft_tree


def sample(logits, key, temperature, greedy: bool, ctx: parallel.RunContext, filters: Filters | None = None):
    """logits f32 [B, ..., V] -> int32 [B, ...]: argmax when greedy, else a draw from softmax(logits / T)
    by the Gumbel-max trick (jax.random.categorical's draw, bit for bit), with the tokens `filters`
    drop (spec/sampling.py; None: none) at -inf. Through `parallel.vocab_argmax`, which exchanges
    only each device's best where ctx's mesh splits V."""
    if greedy:
        return parallel.vocab_argmax(ctx, logits)
    z = logits / temperature
    if filters is not None:
        z = filter_logits(ctx, z, filters)
    return parallel.vocab_argmax(ctx, jax.random.gumbel(key, logits.shape, logits.dtype) + z)


def keys(state: DecodeState):
    """The step's PRNG keys: (the target's draws, the draft's draws)."""
    key = jax.random.fold_in(state.key, state.steps + 1)
    return key, jax.random.fold_in(key, 1)


def propose(draft, state: DecodeState, plan: Plan, ctx: parallel.RunContext):
    """The tokens to verify: (tokens int32 [B, N] with tokens[:, 0] = root, parents int32 [B, N]
    (parents[:, 0] = -1), packed ancestor mask [B, N, ceil(N/32)] or None (the baseline's one token),
    positions int32 [B, N], q float32 [B, N, Vd] the draft distribution each node's children were
    drawn from (proposal "sample", under the state's filters; else None))."""
    L = state.lengths
    if not plan.depth:
        return state.root[:, None], jnp.full_like(state.root[:, None], -1), None, L[:, None], None
    sample = (keys(state)[1], state.temperature, state.filters) if plan.proposal == "sample" else None
    tokens, parents, q = draft_tree(draft, state.draft_cache, L, state.root, state.h_root, depth=plan.depth,
                                    branching=plan.branching, num_nodes=plan.num_nodes, sample=sample, ctx=ctx)
    rows = parallel.BATCH
    mask = functools.partial(tree_mask, policy=ctx.kernels)
    bits, _, positions, _, _ = ctx.local(mask, (rows, rows), (rows,) * 5)(parents, L)
    return tokens, parents, bits, positions, q


def verify(target, state: DecodeState, tokens, positions, mask, plan: Plan, ctx: parallel.RunContext):
    """The target over the N nodes: (logits f32 [B, N, V], features [B, N, 3H] or None, target cache
    with the nodes' K/V at slots lengths .. lengths + N - 1)."""
    return gpt_oss.step(target, state.target_cache, tokens, positions, state.lengths, mask, plan.feature_ids, ctx=ctx)


def choose(logits, key, temperature, plan: Plan, ctx: parallel.RunContext, filters: Filters | None = None):
    """The target's pick at every node, int32 [B, N]: argmax, or one draw per node (under `filters`)."""
    if not plan.depth:  # one draw over [B, V], as the baseline has always drawn
        return sample(logits[:, 0], key, temperature, plan.greedy, ctx, filters)[:, None]
    return sample(logits, key, temperature, plan.greedy, ctx, filters)


def accept(tokens, parents, choice, plan: Plan, ctx: parallel.RunContext):
    """(accepted drafts int32 [B], path int32 [B, depth + 1] of node indices from the root (entries
    past the accepted length point at node 0), bonus int32 [B])."""
    if not plan.depth:
        zero = jnp.zeros_like(choice[:, 0])
        return zero, zero[:, None], choice[:, 0]
    rows = parallel.BATCH
    greedy = functools.partial(accept_greedy, max_depth=plan.depth, policy=ctx.kernels)
    acc, path, bonus = ctx.local(greedy, (rows,) * 3, (rows,) * 3)(tokens, parents, choice)
    return acc, jnp.maximum(path, 0), bonus  # entries past acc only feed scratch slots


def target_ids_q(draft, q):
    """q [B, N, Vd] over the draft vocabulary -> [B, N, V] over the target's (zero outside the draft
    vocabulary, where the rejection rule then accepts nothing and the residual keeps p)."""
    B, N, _ = q.shape
    ids = eagle3.to_target_ids(draft, jnp.arange(q.shape[-1]))
    return jnp.zeros((B, N, draft.config.vocab_size), q.dtype).at[:, :, ids].set(q)


def accept_sampled(draft, logits, tokens, parents, q, key, temperature, plan: Plan, ctx: parallel.RunContext,
                   filters: Filters | None = None):
    """Proposal "sample": recursive rejection of drafts drawn from q with the target's p =
    softmax(logits / T), the tokens `filters` drop at zero (q drawn under the same filters);
    outputs as `accept`."""
    z = logits / temperature
    p = jax.nn.softmax(z if filters is None else filter_logits(ctx, z, filters), axis=-1)
    u = uniforms(key, *tokens.shape)  # the batch's draws; under a mesh each device takes its rows'
    run = functools.partial(accept_sample, max_depth=plan.depth, proposal="sample", policy=ctx.kernels)
    rows = parallel.BATCH
    acc, path, bonus = ctx.local(run, (rows,) * 5, (rows,) * 3)(tokens, parents, p, target_ids_q(draft, q), u)
    return acc, jnp.maximum(path, 0), bonus


def rewind(cache: kvc.KVCache, lengths, path, acc, plan: Plan, ctx: parallel.RunContext) -> kvc.KVCache:
    """Moves the accepted nodes' K/V of the target's cache to slots lengths .. lengths + acc (a
    chain's already are). Under ctx's mesh each device moves its rows and heads."""
    if plan.branching == 1:
        return cache
    heads, rows = parallel.BATCH_HEADS, parallel.BATCH
    move = functools.partial(kv_rewind, rings=cache.rings, policy=ctx.kernels)
    k, v = ctx.local(move, (heads, heads, rows, rows, rows), (heads, heads))(cache.k, cache.v, lengths, path, acc)
    return cache.replace(k=tuple(k), v=tuple(v))


def path_tokens(tokens, path, acc, bonus):
    """Token j of the step's output, int32 [B, depth + 1]: the accepted draft at depth j + 1 for
    j < acc, the bonus at j = acc (entries past acc are scratch)."""
    j = jnp.arange(path.shape[1])[None]
    nxt = jnp.concatenate([jnp.take_along_axis(tokens, path[:, 1:], axis=1), bonus[:, None]], 1)
    return jnp.where(j == acc[:, None], bonus[:, None], nxt)


def extend(draft, state: DecodeState, nxt, feats, path, acc, plan: Plan, ctx: parallel.RunContext):
    """The draft over the accepted tokens with their target features (fixed width depth + 1, entries
    past acc write scratch): (draft cache, h at the new root [B, Hd])."""
    W, L = plan.width, state.lengths
    f = jnp.take_along_axis(feats, path[:, :, None], axis=1)  # [B, W, 3H]
    h, cache = eagle3.layer(draft, nxt, eagle3.project(draft, f), L[:, None] + jnp.arange(W)[None], L, None,
                            state.draft_cache, ctx=ctx)
    return cache, jnp.take_along_axis(h, acc[:, None, None], axis=1)[:, 0]


def commit(state: DecodeState, plan: Plan, *, target_cache, draft_cache, nxt, acc, h_root) -> DecodeState:
    """Writes the step's tokens nxt[:, :acc + 1] to the output, cut at the first eos and at the token
    budget; marks slots done (eos, budget, or no room in the cache for another step); updates the
    counters and the trace (column `steps`: the tokens written, -1 for slots done before the step).
    Slots already done keep their lengths, root, h_root and output."""
    B, W = nxt.shape
    active = ~state.done
    j = jnp.arange(W)[None]
    count = acc + 1
    is_eos = jnp.isin(nxt, state.eos_ids) & (j < count[:, None])
    first_eos = jnp.min(jnp.where(is_eos, j, W), axis=1)
    count = jnp.minimum(jnp.minimum(count, first_eos + 1), state.budget - state.n_out)
    count = jnp.where(active, count, 0)
    cols = jnp.where(j < count[:, None], state.n_out[:, None] + j, plan.out_len)
    out = state.out.at[jnp.arange(B)[:, None], cols].set(nxt, mode="drop")
    n_out = state.n_out + count
    lengths = state.lengths + acc + 1
    full = lengths + plan.slack > plan.cache_len
    done = state.done | (active & ((first_eos < W) | (n_out >= state.budget) | full))
    keep = lambda new, old: None if old is None else jnp.where(  # noqa: E731
        active.reshape((B,) + (1,) * (old.ndim - 1)), new, old)
    trace = state.trace
    if trace is not None:
        trace = trace.at[:, state.steps].set(jnp.where(active, count, -1), mode="drop")
    return state.replace(target_cache=target_cache, draft_cache=draft_cache, lengths=keep(lengths, state.lengths),
                     root=keep(nxt[jnp.arange(B), acc], state.root), h_root=keep(h_root, state.h_root), out=out,
                     n_out=n_out, done=done, steps=state.steps + 1, counters=state.counters.add(active, acc, count),
                     trace=trace)


def step(models, state: DecodeState, plan: Plan, ctx: parallel.RunContext) -> DecodeState:
    """One iteration over all slots of one draft shape; models = (target, draft), draft None for
    `generate`; ctx: the run context (mesh, kernels). depth="auto" (plan.auto) does not step here:
    the decode loop runs `chosen_step` in a loop per option and `release` after the draft-free one's
    (spec/loop.py: as arms of a lax.switch the options' steps cost more than a fixed shape's)."""
    if plan.auto:
        raise ValueError("step: plan.auto is set; depth=\"auto\" runs chosen_step per option (spec/loop.py)")
    return advance(models, state, plan, ctx)[0]


def chosen_step(models, state: DecodeState, option: int, plan: Plan, ctx: parallel.RunContext) -> DecodeState:
    """One iteration of depth="auto" whose decided option (state.auto.choice) is `option` (an index
    into plan.auto, static): that option's step, what it accepted recorded, the next step decided."""
    new, acc = advance(models, state, plan.options[option], ctx)
    with jax.named_scope("choose_depth"):
        auto = adaptive.update(new.auto, plan.auto, ~state.done, acc, ~new.done, new.lengths, state.steps)
    return new.replace(auto=auto)


def release(draft, state: DecodeState, ctx: parallel.RunContext) -> DecodeState:
    """The draft over the inputs held since draft-free steps (state.auto.held of them a row, at the
    positions before the length) in one pass of adaptive.HOLD tokens (the places past a row's count
    write scratch slots): its cache, and h_root where a row held any; nothing held after."""
    auto = state.auto
    held, W = auto.held, adaptive.HOLD
    start = state.lengths - held
    with jax.named_scope("release"):
        h, cache = eagle3.layer(draft, auto.held_tokens, eagle3.project(draft, auto.held_feats),
                                start[:, None] + jnp.arange(W)[None], start, None, state.draft_cache, ctx=ctx)
        last = jnp.take_along_axis(h, jnp.maximum(held - 1, 0)[:, None, None], axis=1)[:, 0]
    return state.replace(draft_cache=cache, h_root=jnp.where((held > 0)[:, None], last, state.h_root),
                         auto=auto.replace(held=jnp.zeros_like(held)))


def advance(models, state: DecodeState, plan: Plan, ctx: parallel.RunContext):
    """One iteration of one shape (plan.auto empty): (the state after it, accepted drafts int32 [B]).
    With a draft and plan.depth 0 (depth="auto"'s draft-free option), the target verifies the root
    alone and the draft's inputs for the committed token wait in state.auto (`release`)."""
    target, draft = models
    key = keys(state)[0]
    with jax.named_scope("draft"):
        tokens, parents, mask, positions, q = propose(draft, state, plan, ctx)
    with jax.named_scope("verify"):
        logits, feats, target_cache = verify(target, state, tokens, positions, mask, plan, ctx)
    with jax.named_scope("accept"):
        if plan.proposal == "sample" and plan.depth:
            acc, path, bonus = accept_sampled(draft, logits, tokens, parents, q, key, state.temperature, plan, ctx,
                                              state.filters)
        else:
            choice = choose(logits, key, state.temperature, plan, ctx, state.filters)
            acc, path, bonus = accept(tokens, parents, choice, plan, ctx)
        nxt = path_tokens(tokens, path, acc, bonus)
    with jax.named_scope("rewind"):
        target_cache = rewind(target_cache, state.lengths, path, acc, plan, ctx)
    draft_cache, h_root = state.draft_cache, state.h_root
    if state.h_root is not None and plan.depth:  # the state has a draft (decode)
        with jax.named_scope("extend"):
            draft_cache, h_root = extend(draft, state, nxt, feats, path, acc, plan, ctx)
    elif state.h_root is not None:  # depth="auto"'s draft-free option: the draft's inputs wait (`release`)
        state = state.replace(auto=adaptive.hold(state.auto, ~state.done, nxt[:, 0], feats[:, 0]))
    with jax.named_scope("commit"):
        return commit(state, plan, target_cache=target_cache, draft_cache=draft_cache, nxt=nxt, acc=acc,
                      h_root=h_root), acc
