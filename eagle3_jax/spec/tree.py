"""Draft trees in fixed shapes: the EAGLE-2 dynamic tree (SGLang's), with the chain as topk = 1.

Step 0 takes the draft's top-k after the root; each later step runs the draft layer on every node
expanded so far (the frontier blocks, each attending to the committed draft cache plus its own
ancestors by a packed mask; the draft is one layer, so recomputing the few expanded nodes costs
less than keeping per-node caches) and expands the k frontier nodes by their top-k children
(k^2 candidates scored by cumulative draft log-probability), keeping the best k as the next
frontier. Finally the best N - 1 candidates by score form the tree (a parent's score is >= its
children's and candidates are numbered parents-first, so a stable sort keeps the set closed),
sorted by candidate index so parents precede children. Node 0 is the root.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax.formats.packed_mask import pack_mask
from eagle3_jax.models import eagle3


def max_nodes(depth: int, topk: int) -> int:
    """Largest useful tree: the root plus every candidate."""
    return 1 + topk + (depth - 1) * topk * topk


def draft_tree(draft, cache, lengths, root, h_root, *, depth: int, topk: int, num_nodes: int):
    """Builds each sequence's draft tree.

    cache: the draft KV cache with committed prefix [0, lengths); root int32 [B] the last target
    token; h_root [B, H] the draft hidden at position lengths - 1 (its logits propose depth 1).
    Returns (tokens int32 [B, N] target ids with tokens[:, 0] = root, parents int32 [B, N] with
    parents[:, 0] = -1 and parents[:, i] < i).
    """
    B, H = h_root.shape
    k = topk
    P = (depth - 1) * k  # nodes the draft layer runs on (all frontiers but the last)
    logp, tok = eagle3.top_k(draft, eagle3.logits(draft, h_root), k)  # [B, k]
    cand_tok, cand_score, cand_parent = [tok], [logp], [jnp.full((B, k), -1, jnp.int32)]
    f_tok, f_score, f_cand = tok, logp, jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (B, k))
    f_g = jnp.broadcast_to(h_root[:, None], (B, k, H))
    f_slot_parent = jnp.full((B, k), -1, jnp.int32)  # parent's slot in the processed buffer
    p_tok = jnp.zeros((B, max(P, 1)), jnp.int32)
    p_g = jnp.zeros((B, max(P, 1), H), h_root.dtype)
    p_pos = jnp.zeros((B, max(P, 1)), jnp.int32)
    anc = jnp.broadcast_to(jnp.eye(max(P, 1), dtype=bool), (B, max(P, 1), max(P, 1)))
    n_cand = k
    for s in range(1, depth):
        lo = (s - 1) * k
        slots = lo + jnp.arange(k)
        p_tok = p_tok.at[:, slots].set(f_tok)
        p_g = p_g.at[:, slots].set(f_g)
        p_pos = p_pos.at[:, slots].set(jnp.broadcast_to(lengths[:, None] + s - 1, (B, k)))
        parent_rows = jnp.take_along_axis(anc, jnp.maximum(f_slot_parent, 0)[:, :, None], axis=1)
        rows = jnp.where((f_slot_parent >= 0)[:, :, None], parent_rows, False) | jax.nn.one_hot(slots, anc.shape[-1],
                                                                                                dtype=bool)
        anc = anc.at[:, slots].set(rows)
        h, _ = eagle3.layer(draft, p_tok, p_g, p_pos, lengths, pack_mask(anc), cache)
        h_f = h[:, lo:lo + k]  # [B, k, H]
        logp, tok = eagle3.top_k(draft, eagle3.logits(draft, h_f), k)  # [B, k(frontier), k(child)]
        score = (f_score[:, :, None] + logp).reshape(B, k * k)
        tok = tok.reshape(B, k * k)
        parent_cand = jnp.repeat(f_cand, k, axis=1)
        cand_tok.append(tok), cand_score.append(score), cand_parent.append(parent_cand)
        best_score, best = jax.lax.top_k(score, k)
        f_tok = jnp.take_along_axis(tok, best, axis=1)
        f_score = best_score
        f_cand = n_cand + best.astype(jnp.int32)
        f_g = jnp.take_along_axis(h_f, (best // k)[:, :, None], axis=1)
        f_slot_parent = (lo + best // k).astype(jnp.int32)
        n_cand += k * k
    cand_tok = jnp.concatenate(cand_tok, 1)
    cand_score = jnp.concatenate(cand_score, 1)
    cand_parent = jnp.concatenate(cand_parent, 1)
    # best N - 1 candidates (stable: ties keep the lower index, i.e. parents first), parents first
    order = jnp.argsort(-cand_score, axis=1, stable=True)[:, :num_nodes - 1]
    chosen = jnp.sort(order, axis=1)
    node_of = jnp.full((B, n_cand), -1, jnp.int32).at[jnp.arange(B)[:, None], chosen].set(
        jnp.arange(1, num_nodes, dtype=jnp.int32))
    par_cand = jnp.take_along_axis(cand_parent, chosen, axis=1)
    par_node = jnp.where(par_cand < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(par_cand, 0), axis=1))
    tokens = jnp.concatenate([root[:, None], jnp.take_along_axis(cand_tok, chosen, axis=1)], 1)
    parents = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), par_node], 1)
    return tokens.astype(jnp.int32), parents
