"""One iteration of the decode loop: `step(models, state, plan) -> state`.

    propose -> verify -> choose -> accept -> rewind -> extend -> commit

With a draft (plan.depth >= 1) the draft proposes a chain or tree of plan.num_nodes tokens, the
target verifies them in one pass and the accepted prefix plus a bonus token is committed. Without
one (depth 0, `generate`) the root alone is verified and the target's pick is the bonus: the same
step, drafting nothing.

Acceptance, proposal "deterministic" (top-k drafts): on the target's choice y at every node, its
argmax (greedy) or one independent draw from softmax(logits / T) per node (sampling). Node i is
accepted iff its token equals y at its parent and its parent is accepted; the bonus is y at the
deepest accepted node. With draws this is sequential rejection with the drafts taken as given
(one-hot q): each committed token is exactly a draw from the target, for chains and trees alike
(SGLang's "target only" verification). Proposal "sample" (drafts drawn from the draft's q at the
decoding temperature): recursive rejection with q, `pallas.accept.accept_sample` (accept a child
with min(1, r/q), else r <- norm(max(r - q, 0)) and try the next sibling; the bonus is drawn from
what is left), with p = softmax(target logits / T).
Each part is a public function so that benchmarks time the library's own parts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.models import kv_cache as kvc
from eagle3_jax.models import shards
from eagle3_jax.pallas.accept import accept_greedy, accept_sample, uniforms
from eagle3_jax.pallas.kv_rewind import kv_rewind
from eagle3_jax.pallas.tree_mask import tree_mask
from eagle3_jax.spec.state import DecodeState, Plan
from eagle3_jax.spec.tree import draft_tree


def sample(logits, key, temperature, greedy: bool):
    """logits f32 [B, ..., V] -> int32 [B, ...]: argmax when greedy, else a draw from softmax(logits / T)
    by the Gumbel-max trick (jax.random.categorical's draw, bit for bit). Both through
    `shards.vocab_argmax`, which exchanges only each device's best where a mesh splits V."""
    if greedy:
        return shards.vocab_argmax(logits)
    return shards.vocab_argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits / temperature)


def keys(s: DecodeState):
    """The step's PRNG keys: (the target's draws, the draft's draws)."""
    key = jax.random.fold_in(s.key, s.steps + 1)
    return key, jax.random.fold_in(key, 1)


def propose(draft, s: DecodeState, plan: Plan):
    """The tokens to verify: (tokens int32 [B, N] with tokens[:, 0] = root, parents int32 [B, N]
    (parents[:, 0] = -1), packed ancestor mask [B, N, ceil(N/32)] or None (the baseline's one token),
    positions int32 [B, N], q float32 [B, N, Vd] the draft distribution each node's children were
    drawn from (proposal "sample"; else None))."""
    L = s.lengths
    if not plan.depth:
        return s.root[:, None], jnp.full_like(s.root[:, None], -1), None, L[:, None], None
    sample = (keys(s)[1], s.temperature) if plan.proposal == "sample" else None
    tokens, parents, q = draft_tree(draft, s.draft_cache, L, s.root, s.h_root, depth=plan.depth, topk=plan.topk,
                                    num_nodes=plan.num_nodes, sample=sample)
    rows = shards.ROWS
    bits, _, positions, _, _ = shards.local(tree_mask, (rows, rows), (rows,) * 5)(parents, L)
    return tokens, parents, bits, positions, q


def verify(target, s: DecodeState, tokens, positions, mask, plan: Plan):
    """The target over the N nodes: (logits f32 [B, N, V], features [B, N, 3H] or None, target cache
    with the nodes' K/V at slots lengths .. lengths + N - 1)."""
    return gpt_oss.step(target, s.target_cache, tokens, positions, s.lengths, mask, plan.feature_ids)


def choose(logits, key, temperature, plan: Plan):
    """The target's pick at every node, int32 [B, N]: argmax, or one draw per node."""
    if not plan.depth:  # one draw over [B, V], as the baseline has always drawn
        return sample(logits[:, 0], key, temperature, plan.greedy)[:, None]
    return sample(logits, key, temperature, plan.greedy)


def accept(tokens, parents, choice, plan: Plan):
    """(accepted drafts int32 [B], path int32 [B, depth + 1] of node indices from the root (entries
    past the accepted length point at node 0), bonus int32 [B])."""
    if not plan.depth:
        zero = jnp.zeros_like(choice[:, 0])
        return zero, zero[:, None], choice[:, 0]
    rows = shards.ROWS
    greedy = functools.partial(accept_greedy, max_depth=plan.depth)
    acc, path, bonus = shards.local(greedy, (rows,) * 3, (rows,) * 3)(tokens, parents, choice)
    return acc, jnp.maximum(path, 0), bonus  # entries past acc only feed scratch slots


def target_ids_q(draft, q):
    """q [B, N, Vd] over the draft vocabulary -> [B, N, V] over the target's (zero outside the draft
    vocabulary, where the rejection rule then accepts nothing and the residual keeps p)."""
    B, N, _ = q.shape
    ids = eagle3.to_target_ids(draft, jnp.arange(q.shape[-1]))
    return jnp.zeros((B, N, draft.config.vocab_size), q.dtype).at[:, :, ids].set(q)


def accept_sampled(draft, logits, tokens, parents, q, key, temperature, plan: Plan):
    """Proposal "sample": recursive rejection of drafts drawn from q with the target's p =
    softmax(logits / T); outputs as `accept`."""
    p = jax.nn.softmax(logits / temperature, axis=-1)
    u = uniforms(key, *tokens.shape)  # the batch's draws; under a mesh each device takes its rows'
    run = functools.partial(accept_sample, max_depth=plan.depth, proposal="sample")
    rows = shards.ROWS
    acc, path, bonus = shards.local(run, (rows,) * 5, (rows,) * 3)(tokens, parents, p, target_ids_q(draft, q), u)
    return acc, jnp.maximum(path, 0), bonus


def rewind(cache: kvc.KVCache, lengths, path, acc, plan: Plan) -> kvc.KVCache:
    """Moves the accepted nodes' K/V of the target's cache to slots lengths .. lengths + acc (a
    chain's already are). Under a mesh (models/shards.py) each device moves its rows and heads."""
    if plan.topk == 1:
        return cache
    heads, rows = shards.HEADS, shards.ROWS
    k, v = shards.local(functools.partial(kv_rewind, rings=cache.rings), (heads, heads, rows, rows, rows),
                        (heads, heads))(cache.k, cache.v, lengths, path, acc)
    return cache.replace(k=tuple(k), v=tuple(v))


def path_tokens(tokens, path, acc, bonus):
    """Token j of the step's output, int32 [B, depth + 1]: the accepted draft at depth j + 1 for
    j < acc, the bonus at j = acc (entries past acc are scratch)."""
    j = jnp.arange(path.shape[1])[None]
    nxt = jnp.concatenate([jnp.take_along_axis(tokens, path[:, 1:], axis=1), bonus[:, None]], 1)
    return jnp.where(j == acc[:, None], bonus[:, None], nxt)


def extend(draft, s: DecodeState, nxt, feats, path, acc, plan: Plan):
    """The draft over the accepted tokens with their target features (fixed width depth + 1, entries
    past acc write scratch): (draft cache, h at the new root [B, Hd])."""
    W, L = plan.width, s.lengths
    f = jnp.take_along_axis(feats, path[:, :, None], axis=1)  # [B, W, 3H]
    h, cache = eagle3.layer(draft, nxt, eagle3.project(draft, f), L[:, None] + jnp.arange(W)[None], L, None,
                            s.draft_cache)
    return cache, jnp.take_along_axis(h, acc[:, None, None], axis=1)[:, 0]


def commit(s: DecodeState, plan: Plan, *, target_cache, draft_cache, nxt, acc, h_root) -> DecodeState:
    """Writes the step's tokens nxt[:, :acc + 1] to the output, cut at the first eos and at the token
    budget; marks slots done (eos, budget, or no room in the cache for another step); updates the
    counters. Slots already done keep their lengths, root, h_root and output."""
    B, W = nxt.shape
    active = ~s.done
    j = jnp.arange(W)[None]
    count = acc + 1
    is_eos = jnp.isin(nxt, s.eos_ids) & (j < count[:, None])
    first_eos = jnp.min(jnp.where(is_eos, j, W), axis=1)
    count = jnp.minimum(jnp.minimum(count, first_eos + 1), s.budget - s.n_out)
    count = jnp.where(active, count, 0)
    cols = jnp.where(j < count[:, None], s.n_out[:, None] + j, plan.out_len)
    out = s.out.at[jnp.arange(B)[:, None], cols].set(nxt, mode="drop")
    n_out = s.n_out + count
    lengths = s.lengths + acc + 1
    full = lengths + plan.slack > plan.cache_len
    done = s.done | (active & ((first_eos < W) | (n_out >= s.budget) | full))
    keep = lambda new, old: None if old is None else jnp.where(  # noqa: E731
        active.reshape((B,) + (1,) * (old.ndim - 1)), new, old)
    return s.replace(target_cache=target_cache, draft_cache=draft_cache, lengths=keep(lengths, s.lengths),
                     root=keep(nxt[jnp.arange(B), acc], s.root), h_root=keep(h_root, s.h_root), out=out,
                     n_out=n_out, done=done, steps=s.steps + 1, counters=s.counters.add(active, acc, count))


def step(models, s: DecodeState, plan: Plan) -> DecodeState:
    """One iteration over all slots; models = (target, draft), draft None when plan.depth is 0."""
    target, draft = models
    key = keys(s)[0]
    with jax.named_scope("draft"):
        tokens, parents, mask, positions, q = propose(draft, s, plan)
    with jax.named_scope("verify"):
        logits, feats, target_cache = verify(target, s, tokens, positions, mask, plan)
    with jax.named_scope("accept"):
        if plan.proposal == "sample":
            acc, path, bonus = accept_sampled(draft, logits, tokens, parents, q, key, s.temperature, plan)
        else:
            acc, path, bonus = accept(tokens, parents, choose(logits, key, s.temperature, plan), plan)
        nxt = path_tokens(tokens, path, acc, bonus)
    with jax.named_scope("rewind"):
        target_cache = rewind(target_cache, s.lengths, path, acc, plan)
    draft_cache, h_root = s.draft_cache, s.h_root
    if plan.depth:
        with jax.named_scope("extend"):
            draft_cache, h_root = extend(draft, s, nxt, feats, path, acc, plan)
    with jax.named_scope("commit"):
        return commit(s, plan, target_cache=target_cache, draft_cache=draft_cache, nxt=nxt, acc=acc, h_root=h_root)
