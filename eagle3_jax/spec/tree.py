"""Draft trees in fixed shapes: the EAGLE-2 dynamic tree (SGLang's), with the chain as branching = 1.

Step 0 expands the root; each later step runs the draft layer on every node expanded so far (the
frontier blocks, each attending to the committed draft cache plus its own ancestors by a packed
mask; the draft is one layer, so recomputing the few expanded nodes costs less than keeping
per-node caches) and expands the k frontier nodes by k children each (k^2 candidates), keeping the
best k by score as the next frontier. Finally the best N - 1 candidates by score form the tree (a
parent's score is >= its children's and candidates are numbered parents-first, so a stable sort
keeps the set closed), sorted by candidate index so parents precede children. Node 0 is the root.

Proposals (how a node's k = branching children are chosen, and how candidates are scored):
  "deterministic": the draft's top k, scored by cumulative draft log-probability (EAGLE-2).
  "sample": k i.i.d. draws from q = softmax(draft logits / T) under the sampling filters
      (spec/sampling.py; the tokens they drop have q = 0). For the rejection rule to stay exact,
      the children a node keeps must not be chosen by their own values, so a candidate's score does
      not look at its token: the j-th draw (j = 0, 1, ...) at node c scores score(c) + log s_c +
      j log(1 - s_c), s_c = sum(q_c^2) (the chance that a draw from q_c is matched by an independent
      one, the acceptance rate of a draft equal to the target). A node's kept children are then
      always its first draws, however many the tree keeps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax import parallel
from eagle3_jax.formats.packed_mask import pack_mask
from eagle3_jax.models import eagle3
from eagle3_jax.spec.sampling import filter_logits

PROPOSALS = ("deterministic", "sample")


def max_nodes(depth: int, branching: int) -> int:
    """Largest useful tree: the root plus every candidate."""
    return 1 + branching + (depth - 1) * branching * branching


def _children(draft, h, k: int, sample, ctx: parallel.RunContext):
    """k children of each node with draft hidden state h [..., H]: (their scores relative to the
    node's [..., k], target ids int32 [..., k], q [..., Vd] the draft distribution drawn from, or None)."""
    logits = eagle3.logits(draft, h, ctx)
    if sample is None:
        logp, tok = eagle3.top_k(draft, logits, k)
        return logp, tok, None
    key, temperature, filters = sample
    z = logits / temperature
    if filters is not None:  # the draft's own head leaves its logits whole; a borrowed one split as the target's
        z = filter_logits(parallel.ONE_DEVICE if draft.config.own_lm_head else ctx, z, filters)
    logq = jax.nn.log_softmax(z, axis=-1)
    idx = jax.random.categorical(key, logq[..., None, :], axis=-1, shape=logq.shape[:-1] + (k,))
    q = jnp.exp(logq)
    s = jnp.clip(jnp.sum(q * q, axis=-1, keepdims=True), 1e-30, 1 - 1e-7)
    score = jnp.log(s) + jnp.arange(k, dtype=jnp.float32) * jnp.log1p(-s)
    return score, eagle3.to_target_ids(draft, idx).astype(jnp.int32), q


def draft_tree(draft, cache, lengths, root, h_root, *, depth: int, branching: int, num_nodes: int, sample=None,
               ctx: parallel.RunContext = parallel.ONE_DEVICE):
    """Builds each sequence's draft tree.

    cache: the draft KV cache with committed prefix [0, lengths); root int32 [B] the last target
    token; h_root [B, H] the draft hidden at position lengths - 1 (its logits propose depth 1).
    branching: children per expanded node (1: a chain). sample: None (proposal "deterministic": the
    draft's best children) or (key, temperature, filters) (proposal "sample": i.i.d. draws from the
    draft at that temperature under those `sampling.Filters`, None for none). ctx: the run context (default one device).
    Returns (tokens int32 [B, N] target ids with tokens[:, 0] = root, parents int32 [B, N] with
    parents[:, 0] = -1 and parents[:, i] < i, q float32 [B, N, Vd] the draft distribution node i's
    children were drawn from, zero for nodes without children; None for "deterministic").
    """
    B, H = h_root.shape
    k = branching
    P = (depth - 1) * k  # nodes the draft layer runs on (all frontiers but the last)
    step_sample = (lambda s: None) if sample is None else (lambda s: (jax.random.fold_in(sample[0], s), *sample[1:]))
    score, tok, q = _children(draft, h_root, k, step_sample(0), ctx)  # [B, k]
    qs = None if q is None else [q[:, None]]  # q of each expanded node: the root, then each frontier
    cand_tok, cand_score, cand_parent = [tok], [score], [jnp.full((B, k), -1, jnp.int32)]
    f_tok, f_score, f_cand = tok, score, jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (B, k))
    f_g = jnp.broadcast_to(h_root[:, None], (B, k, H))
    f_slot_parent = jnp.full((B, k), -1, jnp.int32)  # parent's slot in the processed buffer
    p_tok = jnp.zeros((B, max(P, 1)), jnp.int32)
    p_g = jnp.zeros((B, max(P, 1), H), h_root.dtype)
    p_pos = jnp.zeros((B, max(P, 1)), jnp.int32)
    anc = jnp.broadcast_to(jnp.eye(max(P, 1), dtype=bool), (B, max(P, 1), max(P, 1)))
    n_cand = k
    expanded = [jnp.full((B, 1), -1, jnp.int32)]  # candidate index of each expanded node (the root: -1)
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
        h, _ = eagle3.layer(draft, p_tok, p_g, p_pos, lengths, pack_mask(anc), cache, ctx=ctx)
        h_f = h[:, lo:lo + k]  # [B, k, H]
        rel, tok, q = _children(draft, h_f, k, step_sample(s), ctx)  # [B, k(frontier), k(child)]
        if qs is not None:
            qs.append(q)
            expanded.append(f_cand)
        score = (f_score[:, :, None] + rel).reshape(B, k * k)
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
    if qs is None:
        return tokens.astype(jnp.int32), parents, None
    # node i's q: that of the expanded node it is (the root is node 0; unexpanded nodes get zeros)
    qs = jnp.concatenate(qs, 1)  # [B, 1 + P, Vd]
    exp_cand = jnp.concatenate(expanded, 1)  # [B, 1 + P]
    exp_node = jnp.where(exp_cand < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(exp_cand, 0), axis=1))
    q_nodes = jnp.zeros((B, num_nodes, qs.shape[-1]), qs.dtype).at[jnp.arange(B)[:, None], jnp.where(
        exp_node >= 0, exp_node, num_nodes)].set(qs, mode="drop")
    return tokens.astype(jnp.int32), parents, q_nodes
