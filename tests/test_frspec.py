"""FR-Spec draft vocabularies (convert/frspec.py) on synthetic Zipf counts and tiny drafts."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from eagle3_reference_np import random_draft_weights, reference_forward, tiny_draft_config, write_draft_checkpoint
from flax import nnx

from eagle3_jax.convert import coverage, load_eagle3, restrict_head, save_eagle3, select_draft_vocab, token_frequencies
from eagle3_jax.models import eagle3
from eagle3_jax.models.config import PRESETS

TARGET = PRESETS["tiny"]  # vocab 256, hidden 64
V = TARGET.vocab_size


def fresh_seed() -> int:
    return int(np.random.default_rng().integers(1 << 30))


def zipf_corpus(seed, n=20000, a=1.2):
    """Token ids whose frequencies follow Zipf's law over a random permutation of the vocab."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(V)
    ranks = rng.zipf(a, n * 2)
    return perm[ranks[ranks <= V][:n] - 1]


def fake_target(seed):
    rng = np.random.default_rng(seed)
    H = TARGET.hidden_size
    return SimpleNamespace(config=TARGET, embed=nnx.Param(jnp.asarray(rng.standard_normal((V, H)), jnp.float32)),
                           lm_head=nnx.Param(jnp.asarray(rng.standard_normal((V, H)) * 2 * H ** -0.5, jnp.float32)))


def load(tmp_path, seed, **cfg_kw):
    """A tiny draft loaded from a random checkpoint (shares the target's embedding; own head unless
    draft_vocab_size=None)."""
    cfg = tiny_draft_config(hidden_size=64, **cfg_kw)
    w = random_draft_weights(cfg, seed, embed=False, lm_head=cfg["draft_vocab_size"] is not None)
    write_draft_checkpoint(tmp_path / "draft", cfg, w)
    target = fake_target(seed + 1)
    return cfg, w, target, load_eagle3(tmp_path / "draft", target=target, dtype=jnp.float32)


def inputs(seed, B=2, T=12):
    """Draft inputs of the shapes test_eagle3 uses (eager dispatch reuses its compiled ops)."""
    rng = np.random.default_rng(seed + 7)
    return rng.integers(0, V, (B, T)), rng.standard_normal((B, T, 192)).astype(np.float32)


def test_token_frequencies():
    rng = np.random.default_rng(fresh_seed())
    ids = rng.integers(0, V, (3, 50))
    np.testing.assert_array_equal(token_frequencies(ids, V), np.bincount(ids.ravel(), minlength=V))
    ragged = [ids[0, :7].tolist(), [], ids[1].tolist(), np.asarray(ids[2, :3])]
    counts = token_frequencies(ragged, V)
    assert counts.dtype == np.int64 and counts.shape == (V,)
    np.testing.assert_array_equal(counts, np.bincount(np.concatenate([ids[0, :7], ids[1], ids[2, :3]]), minlength=V))
    assert token_frequencies(jnp.asarray(ids), V).sum() == ids.size
    for bad in ([[1, 2], [V]], np.array([-1, 3]), [[0.5]]):
        with pytest.raises(ValueError, match="ids"):
            token_frequencies(bad, V)
    for vs, msg in ((10.5, "expected an integer, got 10.5"), (True, "expected an integer, got True"),
                    (0, "must be an integer >= 1, got 0")):
        with pytest.raises(ValueError, match=f"vocab_size: {msg}"):
            token_frequencies(ids, vs)


def test_select_draft_vocab_ranking_ties_and_padding():
    counts = np.zeros(10, np.int64)
    counts[[7, 2, 5, 9]] = [5, 3, 3, 1]
    np.testing.assert_array_equal(select_draft_vocab(counts, 1), [7])
    np.testing.assert_array_equal(select_draft_vocab(counts, 2), [2, 7])  # tie 2 / 5 at 3: the lower id
    np.testing.assert_array_equal(select_draft_vocab(counts, 3), [2, 5, 7])
    np.testing.assert_array_equal(select_draft_vocab(counts, 6), [0, 1, 2, 5, 7, 9])  # padded: lowest unseen
    np.testing.assert_array_equal(select_draft_vocab(counts, 10), np.arange(10))
    for k in (0, 11):
        with pytest.raises(ValueError, match="k: "):
            select_draft_vocab(counts, k)


def test_select_draft_vocab_float_frequencies_and_bad_counts():
    np.testing.assert_array_equal(select_draft_vocab([0.1, 0.3, 0.05, 0.3, 0.25], 2), [1, 3])  # not int-truncated
    np.testing.assert_array_equal(select_draft_vocab(np.float32([0.2, 0.4, 0.4]), 1), [1])  # tie: the lower id
    counts = token_frequencies(zipf_corpus(fresh_seed()), V)
    for k in (1, 5, 40, 200):  # normalized frequencies, any dtype, rank as the counts do
        ids = select_draft_vocab(counts, k)
        for c in (counts / counts.sum(), (counts / counts.sum()).astype(np.float32), counts.astype(np.uint32)):
            np.testing.assert_array_equal(select_draft_vocab(c, k), ids)
    for bad, msg in (([0.5, -0.1, 0.2], "non-negative counts, got -0.1 at id 1"),
                     ([0.5, np.nan], "non-negative counts, got nan at id 1"),
                     (np.ones((2, 3)), r"a numeric array of shape \[V\], got float64 \[2, 3\]"),
                     (["a", "b"], r"a numeric array of shape \[V\], got <U1 \[2\]")):
        with pytest.raises(ValueError, match=f"counts: expected {msg}"):
            select_draft_vocab(bad, 1)


def test_zipf_coverage_grows_with_k():
    counts = token_frequencies(zipf_corpus(fresh_seed()), V)
    ks = [1, 4, 16, 64, 128, V]
    cov = [coverage(counts, select_draft_vocab(counts, k)) for k in ks]
    assert all(a < b for a, b in zip(cov, cov[1:-1])), cov  # strictly while there are seen ids left
    assert cov[-1] == 1.0 and cov[2] > 0.5  # Zipf: a few ids carry most tokens
    for k in ks[:-1]:
        ids = select_draft_vocab(counts, k)
        out = np.setdiff1d(np.arange(V), ids)
        assert counts[ids].min() >= counts[out].max()  # the k most frequent
        # no other k-set covers more
        assert coverage(counts, ids) >= coverage(counts, np.random.default_rng(k).choice(V, k, replace=False))
    assert coverage(counts, [0, 0, 0]) == coverage(counts, [0])
    with pytest.raises(ValueError, match="no tokens"):
        coverage(np.zeros(V, np.int64), [1])


def test_restrict_from_target_head_maps_argmax(tmp_path):
    seed = fresh_seed()
    cfg, w, target, draft = load(tmp_path, seed, draft_vocab_size=None)  # nvidia style: the target's head
    counts = token_frequencies(zipf_corpus(seed), V)
    ids = select_draft_vocab(counts, 32)
    small = restrict_head(draft, ids, source="target", target=target)
    assert small.config.draft_vocab_size == 32 and small.config.own_lm_head and not small.config.own_embed
    assert small.embed is target.embed and draft.lm_head is target.lm_head  # shared stays shared
    np.testing.assert_array_equal(np.asarray(small.lm_head[...]), np.asarray(target.lm_head[...])[ids])
    np.testing.assert_array_equal(np.asarray(small.fc[...]), np.asarray(draft.fc[...]))

    tokens, feats = inputs(seed)
    logits = np.asarray(eagle3.forward(small, tokens, feats))
    full, _ = reference_forward(cfg, w, tokens, feats, embed=np.asarray(target.embed[...]),
                                lm_head=np.asarray(target.lm_head[...]))
    _, mapped = eagle3.top_k(small, jnp.asarray(logits), 1)
    # the draft-space argmax maps to the best target id among the k
    np.testing.assert_array_equal(np.asarray(mapped)[..., 0], ids[full[..., ids].argmax(-1)])
    # a draft without a head of its own may omit target=
    np.testing.assert_array_equal(np.asarray(restrict_head(draft, ids, source="target").lm_head[...]),
                                  np.asarray(small.lm_head[...]))


def test_rerank_own_head_to_smaller_k(tmp_path):
    seed = fresh_seed()
    cfg, w, target, draft = load(tmp_path, seed)  # own head over 40 random target ids
    own_ids = np.arange(40) + w["d2t"]
    rng = np.random.default_rng(seed)
    counts = np.zeros(V, np.int64)
    counts[own_ids] = rng.zipf(1.3, 40)
    ids = select_draft_vocab(counts, 16)
    assert np.isin(ids, own_ids).all()
    small = restrict_head(draft, ids[::-1])  # any order in; sorted inside
    np.testing.assert_array_equal(np.asarray(eagle3.to_target_ids(small, jnp.arange(16))), ids)
    tokens, feats = inputs(seed)
    big = np.asarray(eagle3.forward(draft, tokens, feats))
    got = np.asarray(eagle3.forward(small, tokens, feats))
    cols = np.searchsorted(own_ids, ids)  # own_ids are sorted: the draft's index of each kept id
    np.testing.assert_allclose(got, big[..., cols], rtol=1e-5, atol=1e-5 * np.abs(big).max())
    # again, down to 4
    tiny = restrict_head(small, ids[:4])
    np.testing.assert_array_equal(np.asarray(tiny.lm_head[...]), np.asarray(small.lm_head[...])[:4])
    # ids outside the current vocabulary cannot come from the draft's own head
    outside = np.setdiff1d(np.arange(V), own_ids)[:3]
    with pytest.raises(ValueError, match="not in the draft's vocabulary"):
        restrict_head(draft, outside)
    with pytest.raises(ValueError, match="needs target="):
        restrict_head(draft, outside, source="target")
    assert restrict_head(draft, outside, source="target", target=target).config.draft_vocab_size == 3
    for bad, msg in (([3, 3], "duplicate"), ([V], "outside"), ([], "empty")):
        with pytest.raises(ValueError, match=msg):
            restrict_head(draft, bad, source="target", target=target)
    with pytest.raises(ValueError, match="source"):
        restrict_head(draft, ids, source="corpus")


def test_restricted_greedy_proposals_stay_in_vocab(tmp_path):
    seed = fresh_seed()
    cfg, w, target, draft = load(tmp_path, seed, draft_vocab_size=None)
    counts = token_frequencies(zipf_corpus(seed), V)
    ids = select_draft_vocab(counts, 8)
    small = restrict_head(draft, ids, source="target", target=target)
    B, T, steps = 2, 12, 4
    tokens, feats = inputs(seed)
    # chain drafting: prefill, then feed each greedy proposal back with the draft's own hidden state
    cache = eagle3.init_cache(small, B, 16)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    layer = nnx.jit(eagle3.layer)
    h, cache = layer(small, jnp.asarray(tokens, jnp.int32), eagle3.project(small, jnp.asarray(feats)), pos,
                            jnp.zeros((B,), jnp.int32), None, cache)
    h = h[:, -1:]
    proposals = []
    for s in range(steps):
        _, tok = eagle3.top_k(small, eagle3.logits(small, h), 2)
        proposals.append(np.asarray(tok))
        L = jnp.full((B,), T + s, jnp.int32)
        h, cache = layer(small, tok[..., 0], h, L[:, None], L, None, cache)
    proposals = np.stack(proposals)
    assert np.isin(proposals, ids).all()
    # the unrestricted draft (target head) would have proposed other ids somewhere
    full = np.asarray(eagle3.forward(draft, tokens, feats))
    assert not np.isin(full.argmax(-1), ids).all()


def test_restricted_draft_saves_as_standard_checkpoint(tmp_path):
    seed = fresh_seed()
    cfg, w, target, draft = load(tmp_path, seed, draft_vocab_size=None)
    ids = select_draft_vocab(token_frequencies(zipf_corpus(seed), V), 24)
    small = restrict_head(draft, ids, source="target", target=target)
    save_eagle3(small, tmp_path / "small")
    back = load_eagle3(tmp_path / "small", target=target, dtype=jnp.float32)
    assert back.config == small.config and back.embed is target.embed
    np.testing.assert_array_equal(np.asarray(back.d2t[...]), ids - np.arange(24))
    np.testing.assert_array_equal(np.asarray(back.lm_head[...]), np.asarray(small.lm_head[...]))
    tokens, feats = inputs(seed)
    np.testing.assert_array_equal(np.asarray(eagle3.forward(back, tokens, feats)),
                                  np.asarray(eagle3.forward(small, tokens, feats)))


def test_coverage_rejects_bad_counts():
    # used to return 0.5 for a 2-D table, > 1 with a negative count and nan with a NaN
    counts = token_frequencies(zipf_corpus(fresh_seed()), V)
    ids = select_draft_vocab(counts, 8)
    assert coverage(counts / counts.sum(), ids) == pytest.approx(coverage(counts, ids))
    for bad, msg in ((np.ones((2, 3)), r"a numeric array of shape \[V\], got float64 \[2, 3\]"),
                     (np.array([5, -3, 1]), "non-negative counts, got -3 at id 1"),
                     (np.array([1.0, np.nan]), "non-negative counts, got nan at id 1"),
                     (np.array(["a", "b"]), r"a numeric array of shape \[V\], got <U1")):
        with pytest.raises(ValueError, match=f"counts: expected {msg}"):
            coverage(bad, [0])
    for k in (5.0, "3", True):  # used to fail in slicing / comparison with a TypeError, or take k = 1
        with pytest.raises(ValueError, match="k: expected an integer, got"):
            select_draft_vocab(counts, k)
    np.testing.assert_array_equal(select_draft_vocab(counts, np.int64(8)), ids)
    with pytest.raises(ValueError, match="ids: token id 9223372036854775813 outside the int64 range"):
        token_frequencies(np.array([2 ** 63 + 5], np.uint64), V)
