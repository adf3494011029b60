"""decode(..., proposal="sample") and the sampling filters (top_k, top_p, min_p) of generate and decode.

Sampled drafts are drawn from the draft's q at the decoding temperature and verified by recursive
rejection with q. The first two generated tokens must follow the target's exact law (enumerated on
8 ids), for a chain and a tree with siblings, at temperatures 1.0 and 0.7, with a draft whose
distribution differs from the target's and whose vocabulary misses two ids (q is zero there: the
rejection rule must still give the target's law). The tree keeps 3 of its 12 candidates, so a
selection that looked at the drawn tokens (keeping the likelier draws, as top-k scoring would)
biases the law beyond the tolerance.

Filters: under each filter alone and all three together, generate and decode (both proposals, chain
and tree) follow the filtered law of a sort-based float64 reference (transformers' order): no token
outside its support, ever, and the law within the tolerance; top_k = 1 and top_p -> 0 give the
greedy tokens; neutral values give the unfiltered tokens bit for bit (same seed); bad values raise.
The filter itself against a reference with ties: `test_filter_logits_ties_and_edges`. One executable
per proposal and shape serves every filter value (they are arguments); the target has one layer, so
the programs compile quickly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle3_jax import parallel
from eagle3_jax.models import Eagle3Config, GptOssConfig, eagle3, gpt_oss
from eagle3_jax.spec import ArgumentError, decode, generate, sampling

V = 8
DRAFT_IDS = np.array([0, 1, 2, 4, 5, 7])  # the draft's vocabulary: ids 3 and 6 are never drafted
PROMPT, N = [2, 5, 3], 4096
NF = 1024  # rows of the filtered runs: a filtered law has fewer cells, and no draw may leave its support
# 16 cache slots: the prompt, 2 tokens and the scratch slots fit (the default bucket, 256 slots a row,
# made a 4096-row batch's cache a 1 GiB array that each step reads and writes)
RUN = dict(eos_ids=(), prefill_chunk=4, max_cache_len=16)
SHAPES = {"chain": dict(num_spec_tokens=3), "tree": dict(num_spec_tokens=2, branching=3, num_draft_tokens=4)}
# (temperature, filters): each alone (every one drops tokens of both laws here), then all three, each
# of which changes the kept set of some law here (test_filters_are_not_vacuous)
ALONE = {"top_k": (1.0, dict(top_k=3)), "top_p": (1.0, dict(top_p=0.6)), "min_p": (0.7, dict(min_p=0.3))}
COMBINED = (0.8, dict(top_k=5, top_p=0.85, min_p=0.3))
# decode: every (proposal, shape) runs the three together and some alone (each proposal and each shape
# sees every filter alone), and one limit that leaves one token
DECODE = {("deterministic", "chain"): (("top_k", "top_p"), dict(top_k=1)),
          ("deterministic", "tree"): (("min_p",), dict(top_p=1e-9)),
          ("sample", "chain"): (("min_p",), dict(top_p=1e-9)),
          ("sample", "tree"): (("top_k", "top_p"), dict(top_k=1))}
NEUTRAL = dict(top_k=V, top_p=1.0, min_p=0.0)


def draft(head_scale):
    dcfg = Eagle3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=V, draft_vocab_size=len(DRAFT_IDS), target_hidden_size=64,
                        aux_layer_ids=(0, 0, 0), target_num_layers=1)
    d = eagle3.Eagle3(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(4))
    d.d2t[...] = jnp.asarray(DRAFT_IDS - np.arange(len(DRAFT_IDS)), jnp.int32)
    d.lm_head[...] = d.lm_head[...] * head_scale
    return d


@pytest.fixture(scope="module")
def pair():
    """The target, and a peaked draft far from it (its likeliest id takes nearly all of q)."""
    cfg = GptOssConfig.preset("tiny").replace(vocab_size=V, eos_token_ids=(1,), num_hidden_layers=1, layer_types=())
    return gpt_oss.GptOss(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3)), draft(4.0)


@pytest.fixture(scope="module")
def flat_pair(pair):
    """The target, and the draft with a flatter q (its likeliest id about half of it), from which the
    filters drop much mass: drafts drawn under them differ from unfiltered ones."""
    return pair[0], draft(1.0)


forward = nnx.jit(gpt_oss.forward)  # one jitted function for every call: traced once a shape


@pytest.fixture(scope="module")
def logits(pair):
    """float64 target logits after PROMPT [V] and after PROMPT + [x] for each first token x [V, V]."""
    t = pair[0]
    l1 = np.asarray(forward(t, jnp.asarray([PROMPT]))[0][0, -1], np.float64)
    l2 = np.asarray(forward(t, jnp.asarray([PROMPT + [x] for x in range(V)]))[0][:, -1], np.float64)
    return l1, l2


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def filtered(p, top_k=None, top_p=None, min_p=None):
    """A distribution p [V] (float64, no ties) filtered as transformers' warpers do it: sort, keep the
    top_k largest, renormalise, keep the sorted prefix before the cumulative mass reaches top_p (the
    token that reaches it included), keep p >= min_p * max p; renormalised."""
    order = np.argsort(-p)
    keep = np.ones(V, bool)
    if top_k is not None:
        keep[order[top_k:]] = False
    if top_p is not None:
        q = np.where(keep, p, 0)[order] / p[keep].sum()
        keep[order[np.cumsum(q) - q >= top_p]] = False
    if min_p is not None:
        keep &= p >= min_p * p.max()
    return np.where(keep, p, 0) / p[keep].sum()


def exact_law(logits, temperature, **filters):
    """The joint law of the first two tokens [V, V] under the filters at this temperature."""
    l1, l2 = logits
    p1 = filtered(softmax(l1 / temperature), **filters)
    return p1[:, None] * np.stack([filtered(softmax(row / temperature), **filters) for row in l2])


def check_law(tokens, exact, what):
    """The empirical joint law of the rows' two tokens: nothing outside exact's support, and within
    the tolerance of an exact sampler's expected total variation."""
    counts = np.zeros((V, V))
    np.add.at(counts, tuple(np.asarray(tokens).T), 1)
    n = counts.sum()
    outside = counts[exact == 0].sum()
    assert outside == 0, (what, f"{outside:.0f} of {n:.0f} draws outside the filtered support")
    tv = 0.5 * np.abs(counts / n - exact).sum()
    # an exact sampler's TV at this n, simulated: its mean + 4.5 standard deviations (a fixed tolerance
    # over the mean failed an exact sampler in about 2% of runs at n = 1024)
    sims = np.random.default_rng(0).multinomial(int(n), exact.ravel() / exact.sum(), size=400) / n
    null = 0.5 * np.abs(sims - exact.ravel()).sum(-1)
    bound = null.mean() + 4.5 * null.std()
    assert tv < bound, (what, tv, null.mean(), bound)


def greedy_pair(logits):
    l1, l2 = logits
    a = int(np.argmax(l1))
    return [a, int(np.argmax(l2[a]))]


@pytest.mark.slow
@pytest.mark.parametrize("kw", list(SHAPES.values()), ids=list(SHAPES))
def test_sampled_drafts_follow_target_two_token_law(pair, logits, kw):
    t, d = pair
    for temperature in (1.0, 0.7):  # one executable: the temperature is an argument
        out = decode(t, d, [PROMPT] * N, 2, temperature=temperature, seed=np.random.randint(1 << 30),
                     proposal="sample", **RUN, **kw)
        check_law(out.tokens, exact_law(logits, temperature), temperature)
        m = out.metrics
        assert m["proposal"] == "sample" and m["accept_rate"] > 0  # drafts were accepted, and rejected:
        assert m["accept_length_histogram"][0] > 0  # both branches of the rule ran


def test_filters_are_not_vacuous(logits):
    """Each filter alone drops tokens after the prompt and after every first token it keeps; of the
    three together each one changes the kept set of some law."""
    for temperature, filters in ALONE.values():
        law = exact_law(logits, temperature, **filters)
        first = law.sum(1) > 0
        assert not first.all() and (law[first] == 0).any(1).all(), filters
    temperature, filters = COMBINED
    law = exact_law(logits, temperature, **filters)
    for name in filters:
        others = {k: v for k, v in filters.items() if k != name}
        assert ((exact_law(logits, temperature, **others) > 0) != (law > 0)).any(), name


@pytest.mark.parametrize("proposal,shape", list(DECODE), ids=["-".join(k) for k in DECODE])
def test_decode_follows_the_filtered_law(flat_pair, logits, proposal, shape):
    t, d = flat_pair
    alone, edge = DECODE[proposal, shape]

    def run(temperature=1.0, seed=None, **filters):
        seed = np.random.randint(1 << 30) if seed is None else seed
        return decode(t, d, [PROMPT] * NF, 2, temperature=temperature, seed=seed, proposal=proposal, **RUN,
                      **SHAPES[shape], **filters).tokens

    for temperature, filters in [ALONE[name] for name in alone] + [COMBINED]:  # one executable: values are arguments
        check_law(run(temperature, **filters), exact_law(logits, temperature, **filters), (temperature, filters))
    assert run(**edge) == [greedy_pair(logits)] * NF, edge  # one token left: the greedy tokens
    if (proposal, shape) == ("sample", "chain"):  # neutral values: the unfiltered program's tokens
        assert run(seed=5, **NEUTRAL) == run(seed=5)


def test_generate_filters(pair, logits):
    t = pair[0]

    def run(seed=None, temperature=1.0, **filters):
        seed = np.random.randint(1 << 30) if seed is None else seed
        return generate(t, [PROMPT] * NF, 2, temperature=temperature, seed=seed, **RUN, **filters).tokens

    for temperature, filters in [*ALONE.values(), COMBINED]:
        check_law(run(temperature=temperature, **filters), exact_law(logits, temperature, **filters), filters)
    for edge in (dict(top_k=1), dict(top_p=1e-9)):
        assert run(**edge) == [greedy_pair(logits)] * NF, edge
    assert run(seed=7, **NEUTRAL) == run(seed=7)
    # temperature 0 ignores them (checked, not compiled: the greedy program, reused)
    greedy = generate(t, [PROMPT], 2, **RUN)
    again = generate(t, [PROMPT], 2, top_k=3, top_p=0.5, min_p=0.5, **RUN)
    assert again.tokens == greedy.tokens == [greedy_pair(logits)] and again.metrics["compile_seconds"] == 0


def reference_keep(z, top_k, top_p, min_p):
    """The filters' kept set on one row z [V] (float32 values), as spec/sampling.py defines it (ties
    kept together), in float64."""
    z = z.astype(np.float64)
    w = np.exp(z - z.max())
    keep_k = z >= np.sort(z)[::-1][min(top_k, len(z)) - 1]
    wk = np.where(keep_k, w, 0)
    above = np.array([wk[z > x].sum() for x in z])
    keep_p = above < top_p * wk.sum() if top_p < 1 else np.ones(len(z), bool)
    return keep_k & keep_p & (w >= min_p)


def test_filter_logits_ties_and_edges():
    """spec/sampling.py's cuts on rows with ties (within the k-th value, at the nucleus' edge), -0.0
    and +0.0, -inf entries and one-token rows: the kept set of the definition, kept values unchanged
    bit for bit, neutral values keep every finite entry."""
    rng = np.random.default_rng(0)
    R, W = 64, 12
    z = rng.normal(size=(R, W)) * rng.choice([0.3, 3.0, 20.0], (R, 1))
    z[::2] = np.round(z[::2])  # ties
    z[1::4, :3] = -0.0
    z[3::8, 3:5] = 0.0
    z[5::8, -1] = -np.inf
    z = z.astype(np.float32)
    f = jax.jit(lambda z, k, p, m: sampling.filter_logits(parallel.ONE_DEVICE, z, sampling.Filters(k, p, m)))
    cases = [(1, 1.0, 0.0), (3, 1.0, 0.0), (W, 1.0, 0.0), (100, 0.5, 0.0), (100, 1e-9, 0.0), (5, 0.7, 0.0),
             (100, 1.0, 0.3), (4, 0.9, 0.05), (2, 0.3, 1.0), (W, 1.0, 0.0)]
    for k, p, m in cases:
        got = np.asarray(f(z, np.int32(k), np.float32(p), np.float32(m)))
        kept = got > -np.inf
        np.testing.assert_array_equal(got[kept], z[kept])
        for r in range(R):
            want = reference_keep(z[r], k, np.float32(p), np.float32(m)) & (z[r] > -np.inf)
            assert (kept[r] == want).all(), (k, p, m, z[r], kept[r], want)
    neutral = np.asarray(f(z, np.int32(sampling.TOP_K_OFF), np.float32(1), np.float32(0)))
    np.testing.assert_array_equal(neutral, z)


@pytest.mark.parametrize("kw,match", [
    (dict(top_k=0), r"top_k: expected an integer >= 1 or None, got 0"),
    (dict(top_k=2.0), r"top_k: expected an integer >= 1 or None, got 2.0"),
    (dict(top_k=True), r"top_k: expected an integer >= 1 or None, got True"),
    (dict(top_p=0.0), r"top_p: expected a number in \(0, 1\] or None, got 0.0"),
    (dict(top_p=1.5), r"top_p: expected a number in \(0, 1\] or None, got 1.5"),
    (dict(top_p=float("nan")), r"top_p: expected a number in \(0, 1\] or None, got nan"),
    (dict(min_p=-0.1), r"min_p: expected a number in \[0, 1\] or None, got -0.1"),
    (dict(min_p="0.1"), r"min_p: expected a number in \[0, 1\] or None, got '0.1'"),
    (dict(min_p=0.1, temperature=0.0, top_p=2), r"top_p: .* got 2"),  # checked at temperature 0 too
])
def test_bad_filter_values(pair, kw, match):
    t, d = pair
    kw = {"temperature": 1.0, **kw}
    with pytest.raises(ArgumentError, match=match):
        generate(t, [PROMPT], 2, **kw)
    with pytest.raises(ArgumentError, match=match):
        decode(t, d, [PROMPT], 2, **kw)


def test_proposal_and_branching_arguments(pair):
    t, d = pair
    with pytest.raises(ArgumentError, match=r"proposal: 'top1', expected one of \['deterministic', 'sample'\]"):
        decode(t, d, [[2, 5]], 2, temperature=1.0, proposal="top1")
    with pytest.raises(ArgumentError, match="proposal: 'sample' .* temperature, which is 0"):
        decode(t, d, [[2, 5]], 2, proposal="sample")
    with pytest.raises(ArgumentError, match="branching=2 and topk=2: topk is the deprecated name of branching"):
        decode(t, d, [[2, 5]], 2, branching=2, topk=2)
    with pytest.warns(DeprecationWarning, match=r"decode\(topk=...\) is deprecated: pass branching="):
        with pytest.raises(ValueError, match="num_draft_tokens: 50 outside .* branching 2"):
            decode(t, d, [[2, 5]], 2, topk=2, num_draft_tokens=50)
