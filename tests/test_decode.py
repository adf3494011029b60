"""decode(): lossless against generate, metrics, sampling law, finished slots, bad input."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle3_jax.models import Eagle3Config, GptOssConfig, eagle3, gpt_oss
from eagle3_jax.spec import decode, generate

TREE = dict(num_spec_tokens=3, branching=4, num_draft_tokens=8)
# the tiny preset's layers less one (sliding, full, sliding): a layer of each kind, the draft's 3 feature
# layers, and programs that compile in less time
TINY = GptOssConfig.preset("tiny").replace(num_hidden_layers=3, layer_types=())


def draft_config(vocab=256, **kw):
    return Eagle3Config(**{**dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=64,
                                  aux_layer_ids=(0, 1, 2), target_num_layers=TINY.num_hidden_layers), **kw})


def pair(regime, prompts=None):
    """(target, draft) of the same shapes (so executables are shared) in one of three regimes;
    "sometimes" calibrates the target on `prompts`."""
    t = gpt_oss.GptOss(TINY, dtype=jnp.float32, rngs=nnx.Rngs(0))
    d = eagle3.Eagle3(draft_config(), dtype=jnp.float32, rngs=nnx.Rngs(1))
    if regime == "right":  # both heads zero: both always pick id 0
        t.lm_head[...] = jnp.zeros_like(t.lm_head[...])
        d.lm_head[...] = jnp.zeros_like(d.lm_head[...])
    elif regime == "sometimes":  # the draft always proposes 0; the target picks 0 part of the time
        d.lm_head[...] = jnp.zeros_like(d.lm_head[...])
        head = t.lm_head[...]
        for scale in (2.0, 1.5, 2.5, 3.0, 1.25, 4.0):  # id 0's logits scaled up until it wins some steps
            t.lm_head[...] = head.at[0].multiply(scale)
            picks = np.array(generate(t, prompts, 14, eos_ids=(), prefill_chunk=8).tokens)[:, 1:] == 0
            if picks.any() and not picks.all(axis=1).any():  # 0 somewhere; no prompt's verified steps all 0
                break
        else:
            raise AssertionError("no scale of id 0's head row makes the target pick it only part of the time")
    return t, d


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(3, 256, n).tolist() for n in (5, 13, 20)]


@pytest.mark.slow
@pytest.mark.parametrize("regime", ["random", "right", "sometimes"])
def test_greedy_decode_is_lossless(regime, prompts):
    t, d = pair(regime, prompts)
    for batch in (prompts, prompts[1:2]):
        want = generate(t, batch, 14, eos_ids=(), prefill_chunk=8).tokens
        # one sequence alone: chain3 and the tree (each shape compiles its own decode)
        shapes = [1, 3, 5] if len(batch) > 1 else [3]
        for kw in [dict(num_spec_tokens=k) for k in shapes] + [TREE]:
            out = decode(t, d, batch, 14, eos_ids=(), prefill_chunk=8, **kw)
            assert out.tokens == want, (regime, kw)
            m = out.metrics
            K = kw["num_spec_tokens"]
            assert sum(m["accept_length_histogram"]) == m["slot_steps"] and len(m["accept_rate_per_position"]) == K
            if regime == "random":
                assert m["accept_rate"] < 0.2
            elif regime == "sometimes":
                assert m["accept_rate"] < 1
                assert m["accept_rate"] > 0 or len(batch) == 1  # the single prompt's target never picks 0
            elif kw.get("branching", 1) == 1:  # always right: every step accepts all K drafts
                assert m["accept_rate"] == 1.0 and m["accept_length_histogram"][-1] == m["slot_steps"]
                full = m["slot_steps"] - len(batch)  # each slot's last step is cut by the budget
                assert (m["generated_tokens"] - len(batch) - (K + 1) * full) <= len(batch) * (K + 1)
                assert m["mean_accept_length"] >= (K + 1) * full / m["slot_steps"]
                assert all(len(x) == 14 for x in out.tokens)
            else:  # uniform draft scores: 8 nodes = root + 4 at depth 1 + 3 at depth 2, so 2 drafts a step
                assert m["accept_length_histogram"] == [0, 0, m["slot_steps"], 0]


def test_always_right_tree_reaches_full_depth(prompts):
    t, d = pair("right")
    out = decode(t, d, prompts, 14, num_spec_tokens=3, branching=2, num_draft_tokens=8, eos_ids=(), prefill_chunk=8)
    assert out.tokens == generate(t, prompts, 14, eos_ids=(), prefill_chunk=8).tokens
    assert out.metrics["accept_length_histogram"][-1] == out.metrics["slot_steps"]  # 2 + 4 + 1: depth 3 reached


def test_finished_slot_stays_finished(prompts):
    t, d = pair("sometimes", prompts)
    free = generate(t, prompts, 14, eos_ids=(), prefill_chunk=8).tokens
    # an id of prompt 0's continuation (from its 3rd token) absent from the others' first 4 tokens
    eos = next(tok for tok in free[0][2:] if all(tok not in f[:4] for f in free[1:]))
    want = generate(t, prompts, 14, eos_ids=(eos,), prefill_chunk=8).tokens
    assert want[0][-1] == eos and len(want[0]) < 14 and len(want[0]) < max(len(w) for w in want)
    for kw in (dict(num_spec_tokens=3), TREE):
        assert decode(t, d, prompts, 14, eos_ids=(eos,), prefill_chunk=8, **kw).tokens == want


def test_conventions_and_reduced_vocab_draft(prompts):
    t, _ = pair("random")
    out_conv = eagle3.Eagle3(draft_config(), dtype=jnp.float32, rngs=nnx.Rngs(5))
    in_conv = eagle3.Eagle3(draft_config(aux_layer_ids=(1, 2, 3), aux_convention="input"), dtype=jnp.float32,
                            rngs=nnx.Rngs(5))
    a = decode(t, out_conv, prompts, 10, eos_ids=(), prefill_chunk=8)
    b = decode(t, in_conv, prompts, 10, eos_ids=(), prefill_chunk=8)
    assert a.tokens == b.tokens and a.metrics["accept_length_histogram"] == b.metrics["accept_length_histogram"]
    small = eagle3.Eagle3(draft_config(draft_vocab_size=32), dtype=jnp.float32, rngs=nnx.Rngs(6))
    small.d2t[...] = jnp.asarray(np.sort(np.random.default_rng(0).choice(256, 32, replace=False)) - np.arange(32),
                                 jnp.int32)
    want = generate(t, prompts, 10, eos_ids=(), prefill_chunk=8).tokens
    for kw in (dict(num_spec_tokens=2), TREE):
        assert decode(t, small, prompts, 10, eos_ids=(), prefill_chunk=8, **kw).tokens == want


def test_reuses_the_executable(prompts):
    t, d = pair("random")
    decode(t, d, prompts, 14, eos_ids=(), prefill_chunk=8, num_spec_tokens=3)
    again = decode(t, d, [p[::-1] for p in prompts], 12, eos_ids=(), prefill_chunk=8, num_spec_tokens=3)
    assert again.metrics["compile_seconds"] == 0.0


# the reference of the sampling tests: jitted (compiles in ~1 s a shape on CPU; eager op by op, ~6 s),
# one function for both, so the second traces nothing
forward = nnx.jit(gpt_oss.forward)


@pytest.mark.parametrize("kw", [dict(num_spec_tokens=3), dict(num_spec_tokens=2, branching=3, num_draft_tokens=6)],
                         ids=["chain", "tree"])
def test_sampling_follows_target_two_token_law(kw):
    """Temperature 1: the first two tokens' joint law equals the target's, enumerated on 8 ids."""
    cfg = GptOssConfig.preset("tiny").replace(vocab_size=8, eos_token_ids=(1,))  # as test_sample_proposal.py's
    t = gpt_oss.GptOss(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    d = eagle3.Eagle3(draft_config(vocab=8, target_num_layers=cfg.num_hidden_layers), dtype=jnp.float32,
                      rngs=nnx.Rngs(4))
    prompt = [2, 5, 3]
    lse = lambda x: x - jnp.log(jnp.sum(jnp.exp(x), -1, keepdims=True))  # noqa: E731
    p1 = np.exp(np.asarray(lse(forward(t, jnp.asarray([prompt]))[0][0, -1]), np.float64))
    p2 = np.exp(np.asarray(lse(forward(t, jnp.asarray([prompt + [x] for x in range(8)]))[0][:, -1]), np.float64))
    exact = p1[:, None] * p2
    n = 4096
    # 16 cache slots (the prompt, 2 tokens and the scratch slots fit): the default bucket, 256 slots a
    # row, made this batch's cache a 1 GiB array that each step reads and writes
    out = decode(t, d, [prompt] * n, 2, temperature=1.0, eos_ids=(), prefill_chunk=4, max_cache_len=16,
                 seed=np.random.randint(1 << 30), **kw)
    counts = np.zeros((8, 8))
    for a, b in out.tokens:
        counts[a, b] += 1
    tv = 0.5 * np.abs(counts / n - exact).sum()
    noise = 0.5 * np.sum(np.sqrt(2 * exact * (1 - exact) / (np.pi * n)))
    assert tv < noise + 0.02, (tv, noise)
    assert out.metrics["accept_rate"] > 0  # drafts were accepted: the acceptance path was exercised


@pytest.mark.parametrize("kw,match", [
    (dict(num_spec_tokens=0), "num_spec_tokens"),
    (dict(num_spec_tokens=2, branching=2, num_draft_tokens=9), "num_draft_tokens: 9 outside"),
    (dict(max_cache_len=30), "does not fit max_cache_len=30"),
    (dict(prompts=[[]]), "empty prompt"),
    (dict(prompts=[[1, 999]]), "outside the vocabulary"),
    (dict(num_spec_tokens=2.0), "num_spec_tokens: expected an integer, got 2.0"),
    (dict(branching=2.0), "branching: expected an integer"),
    (dict(num_draft_tokens=4.0), "num_draft_tokens: expected an integer or None"),
    (dict(max_new_tokens=None), "max_new_tokens: expected an integer"),
    (dict(eos_ids=7), "eos_ids: expected a sequence"),
    (dict(temperature=float("nan")), "temperature: must be finite"),
    # scratch slots count against the cache (max_cache_len), not against the model's positions
    (dict(max_cache_len=35), r"20 tokens \+ max_new_tokens=8 \+ 8 speculative scratch slots = 36 does not fit "
                             "max_cache_len=35"),
])
def test_bad_input(kw, match, prompts):
    t, d = pair("random")
    kw = {"prompts": prompts, "max_new_tokens": 8, **kw}
    with pytest.raises(ValueError, match=match):
        decode(t, d, **kw)


def test_swapped_models_raise(prompts):
    t, d = pair("random")
    with pytest.raises(TypeError, match="expected a gpt_oss.GptOss and an eagle3.Eagle3, got Eagle3 and GptOss"):
        decode(d, t, prompts, 4)


def test_limits_and_accept_rate(prompts):
    # a prompt + budget exactly at max_position_embeddings decodes (scratch slots past it are cache
    # only) and matches generate, in a cache capped at need + scratch slots, the scratch slots its last
    # (the default bucket's 1280-slot cache, room to spare past them, is the same case less tight)
    t, d = pair("right")
    P = t.config.max_position_embeddings
    long = [np.random.default_rng().integers(3, 256, P - 6).tolist()]
    want = generate(t, long, 6, eos_ids=()).tokens
    assert decode(t, d, long, 6, eos_ids=(), num_spec_tokens=3, max_cache_len=P + 8).tokens == want
    # accept_rate is over the drafts a step can accept: 2 (a chain of 3 nodes), not num_spec_tokens = 3
    out = decode(t, d, prompts, 9, eos_ids=(), num_spec_tokens=3, branching=1, num_draft_tokens=3, prefill_chunk=8)
    assert out.tokens == generate(t, prompts, 9, eos_ids=(), prefill_chunk=8).tokens
    assert out.metrics["accept_rate"] == 1.0


def test_incompatible_draft():
    t, _ = pair("random")
    d = eagle3.Eagle3(draft_config(vocab=128), dtype=jnp.float32, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="draft incompatible with the target: draft vocab_size 128"):
        decode(t, d, [[1, 2]], 4)
