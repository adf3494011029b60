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
from eagle3_jax.pallas.accept import accept_greedy
from eagle3_jax.pallas.kv_rewind import kv_rewind
from eagle3_jax.pallas.tree_mask import tree_mask
from eagle3_jax.spec.tree import draft_tree


def step(target, draft, s: dict, *, depth: int, topk: int, num_nodes: int, feature_ids, greedy: bool,
         temperature, key):
    """One step over all slots; returns (new per-slot values dict, per-slot accept_len, committed ids
    [B, depth + 1], count of committed ids [B]). Inactive slots are masked by the caller."""
    L = s["lengths"]
    with jax.named_scope("draft"):
        tokens, parents = draft_tree(draft, s["dcache"], L, s["root"], s["h_root"], depth=depth, topk=topk,
                                     num_nodes=num_nodes)
        bits, _, positions, _, _ = tree_mask(parents, L)
    with jax.named_scope("verify"):
        logits, feats, tcache = gpt_oss.step(target, s["tcache"], tokens, positions, L, bits, feature_ids)
    with jax.named_scope("accept"):
        if greedy:
            choice = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            choice = jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)
        acc, path, bonus = accept_greedy(tokens, parents, choice, max_depth=depth)
        path = jnp.maximum(path, 0)  # entries past accept_len (-1) only feed scratch slots below
    with jax.named_scope("rewind"):
        if topk > 1:  # a chain's accepted nodes are already contiguous
            k, v = kv_rewind(tcache.k, tcache.v, L, path, acc)
            tcache = kvc.KVCache(k=tuple(k), v=tuple(v))
    with jax.named_scope("extend"):
        W = depth + 1
        j = jnp.arange(W)[None]
        # input j is the token after path node j: the accepted draft at depth j + 1, the bonus at acc
        nxt = jnp.concatenate([jnp.take_along_axis(tokens, path[:, 1:], axis=1), bonus[:, None]], 1)  # [B, W]
        nxt = jnp.where(j == acc[:, None], bonus[:, None], nxt)
        f = jnp.take_along_axis(feats, path[:, :, None], axis=1)  # [B, W, 3H]
        h, dcache = eagle3.layer(draft, nxt, eagle3.project(draft, f), L[:, None] + j, L, None, s["dcache"])
        h_root = jnp.take_along_axis(h, acc[:, None, None], axis=1)[:, 0]
    committed = jnp.where(j <= acc[:, None], nxt, 0)  # accepted drafts then the bonus
    new = dict(tcache=tcache, dcache=dcache, lengths=L + acc + 1, root=bonus, h_root=h_root)
    return new, acc, committed, acc + 1
