"""Frequency-ranked draft vocabularies (FR-Spec) for EAGLE-3 drafts, for notebooks.

    counts = token_frequencies(corpus_ids, target.config.vocab_size)   # int64 [V]
    ids = select_draft_vocab(counts, 256, draft=draft)                 # sorted target ids [k]
    coverage(counts, ids)                                              # share of tokens inside ids
    small = restrict_head(draft, ids)                                  # k-row head, d2t recomputed
    save_eagle3(small, "out/")                                         # a standard EAGLE-3 checkpoint

With `draft=`, the k ids are the most frequent inside the draft's current vocabulary, so the rows
come from the draft's own trained head (restrict_head's default, source="draft"). Rows from the
target's lm_head (source="target") only make sense for drafts trained against the target's head
(checkpoints without their own lm_head, as NVIDIA's): an EAGLE-3 draft with its own head computes
its hidden state for that head, and the target's rows score it as noise (tau 1.0 on the shipped
pair). The restricted draft scores only its k ids; `eagle3.top_k` / `to_target_ids` map draft
indices back to target ids (draft index i -> target id ids[i] = i + d2t[i]).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.checks import int_arg
from eagle3_jax.models.eagle3 import Eagle3

__all__ = ["token_frequencies", "draft_vocab", "select_draft_vocab", "coverage", "restrict_head"]


def _int_array(a, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.size == 0:
        return a.reshape(-1).astype(np.int64)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{what}: expected integer token ids, got dtype {a.dtype}")
    if a.dtype.kind == "u" and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{what}: token id {a.max()} outside the int64 range")
    return a.reshape(-1).astype(np.int64)


def _counts(counts) -> np.ndarray:
    """counts as a 1-D numeric array of non-negative values, else ValueError."""
    counts = np.asarray(counts)
    if counts.ndim != 1 or counts.dtype.kind not in "iuf":
        raise ValueError(f"counts: expected a numeric array of shape [V], got {counts.dtype} {list(counts.shape)}")
    bad = np.flatnonzero(~(counts >= 0))  # NaN compares false
    if bad.size:
        raise ValueError(f"counts: expected non-negative counts, got {counts[bad[0]]} at id {int(bad[0])}")
    return counts


def token_frequencies(ids, vocab_size: int) -> np.ndarray:
    """Token counts over a corpus.

    ids: integer array of any shape, or a list of (ragged) lists / arrays of token ids.
    Returns int64 [vocab_size]: counts[t] = occurrences of token t. Ids outside [0, vocab_size)
    raise ValueError.
    """
    vocab_size = int_arg("vocab_size", vocab_size, 1)
    if isinstance(ids, (list, tuple)):
        parts = [_int_array(s, "ids") for s in ids]
        flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    else:
        flat = _int_array(ids, "ids")
    bad = np.flatnonzero((flat < 0) | (flat >= vocab_size))
    if bad.size:
        raise ValueError(f"ids: token id {int(flat[bad[0]])} outside the vocabulary [0, {vocab_size})")
    return np.bincount(flat, minlength=vocab_size).astype(np.int64)


def draft_vocab(draft: Eagle3) -> np.ndarray:
    """The target ids the draft's head scores, in draft-index order: int64 [draft_vocab_size]."""
    return np.arange(draft.config.draft_vocab_size) + np.asarray(draft.d2t[...]).astype(np.int64)


def select_draft_vocab(counts, k: int, draft: Eagle3 | None = None) -> np.ndarray:
    """The k most frequent target ids, sorted ascending: int64 [k].

    counts: [V] non-negative token counts (token_frequencies) or frequencies, integer or float (e.g.
    normalized to sum 1). Ranked by count as given, ties broken by the lower id; when fewer than k ids
    were seen, the lowest unseen ids fill the rest. draft: choose only among the ids the draft's head
    already scores (`draft_vocab`), so that `restrict_head(draft, ids)` can keep the draft's own rows;
    k is then at most its draft_vocab_size. Another shape or dtype, a negative or NaN count, or k
    outside [1, V] (or [1, draft_vocab_size]) raises ValueError.
    """
    counts = _counts(counts)
    V = counts.shape[0]
    k = int_arg("k", k, 1)
    if draft is not None:
        if V != draft.config.vocab_size:
            raise ValueError(f"counts: {V} entries, expected the target vocabulary of the draft, "
                             f"{draft.config.vocab_size}")
        allowed = np.sort(draft_vocab(draft))
        if not 1 <= k <= allowed.size:
            raise ValueError(f"k: {k} outside [1, {allowed.size}] (the draft's vocabulary has {allowed.size} ids)")
    else:
        allowed = np.arange(V)
        if not 1 <= k <= V:
            raise ValueError(f"k: {k} outside [1, {V}] (the vocabulary has {V} ids)")
    key = -counts[allowed].astype(np.result_type(counts.dtype, np.int64))  # signed: -uint would wrap
    order = np.lexsort((allowed, key))  # last key first: count desc, then id
    return np.sort(allowed[order[:k]]).astype(np.int64)


def coverage(counts, ids) -> float:
    """Fraction of all counted tokens whose id is in `ids` (duplicates count once). counts: [V] as in
    `select_draft_vocab`; another shape or dtype, a negative or NaN count raises ValueError."""
    counts = _counts(counts)
    total = counts.sum()
    if total <= 0:
        raise ValueError("counts: no tokens counted")
    ids = np.unique(_int_array(ids, "ids"))
    if ids.size and (ids[0] < 0 or ids[-1] >= counts.shape[0]):
        raise ValueError(f"ids: outside the vocabulary [0, {counts.shape[0]})")
    return float(counts[ids].sum() / total)


def restrict_head(draft: Eagle3, ids, source: str = "draft", target=None) -> Eagle3:
    """A new draft whose head scores only the target ids `ids` (k of them, sorted on the way in).

    source "draft" (the default, the FR-Spec recipe): rows gathered from the draft's own head; every
    id must be in its current vocabulary (`select_draft_vocab(counts, k, draft=draft)` picks such
    ids). source "target": rows gathered from the target's lm_head [V, H] (`target`, a GptOss; a
    draft that already uses the target's head may omit it). That is meaningful only for a draft
    trained against the target's head (no lm_head of its own); for a draft with its own head whose
    rows differ from the target's it warns (UserWarning): its hidden state is made for its own rows,
    and the result accepts almost nothing. The result has draft_vocab_size k, its own lm_head [k, H]
    and d2t[i] = ids[i] - i; every other weight is the same array (an embedding shared with the
    target stays shared).
    """
    c = draft.config
    ids = _int_array(ids, "ids")
    if ids.size == 0:
        raise ValueError("ids: empty draft vocabulary")
    ids = np.sort(ids)
    if np.any(ids[1:] == ids[:-1]):
        raise ValueError(f"ids: duplicate target id {int(ids[1:][ids[1:] == ids[:-1]][0])}")
    if ids[0] < 0 or ids[-1] >= c.vocab_size:
        raise ValueError(f"ids: outside the target vocabulary [0, {c.vocab_size})")
    if source == "draft":
        current = draft_vocab(draft)
        where = {int(t): i for i, t in enumerate(current)}
        missing = [int(t) for t in ids if int(t) not in where]
        if missing:
            raise ValueError(f"ids: {len(missing)} ids are not in the draft's vocabulary of {c.draft_vocab_size} "
                             f"(first: {missing[:5]}); choose them with select_draft_vocab(counts, k, draft=draft)")
        head = draft.lm_head[...][np.asarray([where[int(t)] for t in ids])]
    elif source == "target":
        if target is not None:
            full = target.lm_head
        elif not c.own_lm_head:
            full = draft.lm_head  # the draft already uses the target's head
        else:
            raise ValueError("restrict_head: source='target' needs target= (the GptOss whose lm_head to use)")
        if tuple(full.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"target lm_head: shape {list(full.shape)}, expected {[c.vocab_size, c.hidden_size]} "
                             "(the target's vocab x the draft's hidden size)")
        if c.own_lm_head and not _same_rows(draft, full):
            warnings.warn("restrict_head(source='target'): this draft has its own lm_head, trained in its own "
                          "space, whose rows differ from the target's; the target's rows will score its hidden "
                          "state as noise (expect tau near 1). Use source='draft' with "
                          "select_draft_vocab(counts, k, draft=draft).", UserWarning, stacklevel=2)
        head = full[...][ids]
    else:
        raise ValueError(f"source: {source!r}, expected 'draft' or 'target'")

    k = int(ids.size)
    cfg = c.replace(draft_vocab_size=k, own_lm_head=True)
    new = nnx.eval_shape(lambda: Eagle3(cfg.replace(own_embed=True), dtype=draft.dtype, rngs=nnx.Rngs(0)))
    new.config = cfg
    old = dict(nnx.to_flat_state(nnx.state(draft)))
    for path, var in nnx.to_flat_state(nnx.state(new)):
        if path[0] not in ("embed", "lm_head", "d2t"):
            var.set_value(old[path].get_value())
    if c.own_embed:
        new.embed.set_value(draft.embed.get_value())
    else:
        new.embed = draft.embed
    new.lm_head.set_value(head.astype(draft.dtype))
    new.d2t.set_value(jnp.asarray(ids - np.arange(k), jnp.int32))
    return new


def _same_rows(draft: Eagle3, full_head) -> bool:
    """Whether the draft's own head rows are the target head's rows of the same ids (to rounding)."""
    own = np.asarray(draft.lm_head[...], np.float32)
    theirs = np.asarray(full_head[...][draft_vocab(draft)], np.float32)
    return bool(np.allclose(own, theirs, rtol=1e-2, atol=1e-3 * (np.abs(theirs).max() + 1e-30)))
