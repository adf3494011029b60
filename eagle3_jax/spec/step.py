"""One speculative step: draft -> tree mask -> verify -> accept -> rewind -> draft extend.

Acceptance works on the target's choice y at every node: its argmax (greedy) or one independent
draw from softmax(logits / T) per node (sampling). Node i is accepted iff its token equals y at
its parent and its parent is accepted; the bonus token is y at the deepest accepted node. With
draws, this is sequential rejection with the drafts taken as given (one-hot q): at each node the
next committed token is exactly a draw from the target, so sampling is lossless for chains and
trees alike (SGLang's "target only" verification with thresholds at 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.models import kv_cache as kvc
from eagle3_jax.spec.tree import draft_tree, pack_bits


def tree_structure(parents):
    """parents int32 [B, N] (parents[:, 0] = -1, parent < child) -> (ancestor-or-self bool [B, N, N],
    depth int32 [B, N])."""
    B, N = parents.shape
    anc = jnp.broadcast_to(jnp.eye(N, dtype=bool), (B, N, N))
    depth = jnp.zeros((B, N), jnp.int32)
    for i in range(1, N):  # parents precede children: one pass in node order
        p = parents[:, i]
        anc = anc.at[:, i].set(anc[:, i] | jnp.take_along_axis(anc, p[:, None, None], axis=1)[:, 0])
        depth = depth.at[:, i].set(jnp.take_along_axis(depth, p[:, None], axis=1)[:, 0] + 1)
    return anc, depth


def accept(tokens, parents, depth, choice, max_depth: int):
    """Greedy-form acceptance on the target's choices.

    tokens, parents, depth, choice: int32 [B, N] (choice[:, i] = the target's token after node i).
    Returns (accept_len [B] accepted drafts, path [B, max_depth + 1] node indices from the root
    (entries past accept_len repeat the deepest node), bonus [B])."""
    B, N = tokens.shape
    ok = jnp.zeros((B, N), bool).at[:, 0].set(True)
    safe_par = jnp.maximum(parents, 0)
    match = tokens == jnp.take_along_axis(choice, safe_par, axis=1)
    for _ in range(max_depth):
        ok = ok.at[:, 1:].set((match & jnp.take_along_axis(ok, safe_par, axis=1))[:, 1:])
    deepest = jnp.argmax(jnp.where(ok, depth, -1), axis=1).astype(jnp.int32)
    acc = jnp.take_along_axis(depth, deepest[:, None], axis=1)[:, 0]
    path = [deepest]
    for _ in range(max_depth):
        path.append(jnp.maximum(jnp.take_along_axis(parents, path[-1][:, None], axis=1)[:, 0], 0))
    path = jnp.stack(path[::-1], axis=1)  # [B, max_depth + 1]: root ... deepest, root-padded in front
    shift = max_depth - acc  # move so that path[:, 0] is the root and path[:, acc] the deepest node
    idx = jnp.minimum(jnp.arange(max_depth + 1)[None] + shift[:, None], max_depth)
    path = jnp.take_along_axis(path, idx, axis=1)
    bonus = jnp.take_along_axis(choice, deepest[:, None], axis=1)[:, 0]
    return acc, path, bonus


def rewind(cache: kvc.KVCache, lengths, path) -> kvc.KVCache:
    """Moves the K/V of the accepted path nodes (tree node i sits at slot lengths + i) to slots
    lengths + 0 .. lengths + max_depth, in every layer. Slots past the accepted length get the
    deepest node again (scratch)."""
    src = lengths[:, None] + path  # [B, D + 1]

    def move(buf):
        rows = jnp.take_along_axis(buf, src[:, None, :, None], axis=2)  # [B, Hkv, D + 1, hd]
        return kvc.write(buf, jnp.swapaxes(rows, 1, 2), lengths)

    return kvc.KVCache(k=tuple(move(b) for b in cache.k), v=tuple(move(b) for b in cache.v))


def step(target, draft, s: dict, *, depth: int, topk: int, num_nodes: int, feature_ids, greedy: bool,
         temperature, key):
    """One step over all slots; returns (new per-slot values dict, per-slot accept_len, committed ids
    [B, depth + 1], count of committed ids [B]). Inactive slots are masked by the caller."""
    L = s["lengths"]
    with jax.named_scope("draft"):
        tokens, parents = draft_tree(draft, s["dcache"], L, s["root"], s["h_root"], depth=depth, topk=topk,
                                     num_nodes=num_nodes)
        anc, dep = tree_structure(parents)
    with jax.named_scope("verify"):
        logits, feats, tcache = gpt_oss.step(target, s["tcache"], tokens, L[:, None] + dep, L, pack_bits(anc),
                                             feature_ids)
    with jax.named_scope("accept"):
        if greedy:
            choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            choice = jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)
        acc, path, bonus = accept(tokens, parents, dep, choice, depth)
    with jax.named_scope("rewind"):
        if topk > 1:  # a chain's accepted nodes are already contiguous
            tcache = rewind(tcache, L, path)
    with jax.named_scope("extend"):
        W = depth + 1
        j = jnp.arange(W)[None]
        nxt = jnp.take_along_axis(tokens, jnp.minimum(path[:, 1:], tokens.shape[1] - 1), axis=1)
        nxt = jnp.concatenate([nxt, bonus[:, None]], 1)  # [B, W + 1]; entry acc is the bonus
        nxt = jnp.where(j == acc[:, None], bonus[:, None], nxt[:, :W])
        f = jnp.take_along_axis(feats, path[:, :, None], axis=1)  # [B, W, 3H]
        h, dcache = eagle3.layer(draft, nxt, eagle3.project(draft, f), L[:, None] + j, L, None, s["dcache"])
        h_root = jnp.take_along_axis(h, acc[:, None, None], axis=1)[:, 0]
    committed = jnp.where(j <= acc[:, None], nxt, 0)  # accepted drafts then the bonus
    new = dict(tcache=tcache, dcache=dcache, lengths=L + acc + 1, root=bonus, h_root=h_root)
    return new, acc, committed, acc + 1
