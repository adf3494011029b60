"""decode(depth="auto"): the draft shape chosen at each step from the running acceptance and a table of
step times (spec/adaptive.py, spec/cost_table.py).

Exactness: greedy output equals generate's (test_trace.py: a tree configuration, whose options are
the chains and the tree, the choice varying between steps), and with sampled drafts the first three
tokens follow the target's joint law while the choice changes from the first step (the prior) to the
second (what the first accepted). The chooser as a pure
function on hand-made tables (break-even, exploration, the estimates' averaging), the histogram of
choices against the steps run, the tables shipped and their interpolation, the arguments."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_memory_check import added_row_bytes
from test_sample_proposal import DRAFT_IDS, PROMPT, V, draft, softmax

from eagle3_jax.assets import DRAFT_DIR, TARGET_DIR
from eagle3_jax.convert.hf_eagle3 import config_from_hf
from eagle3_jax.models import GptOssConfig, gpt_oss
from eagle3_jax.spec import ArgumentError, adaptive, cost_table, decode, memory
from eagle3_jax.spec.state import Plan

CHAINS = {"chain0": [[1.0]], "chain1": [[1.4]], "chain2": [[1.8]], "chain3": [[2.2]]}
TABLE = {"batches": [1], "contexts": [0], "seconds": {**CHAINS, "tree3x4n8": [[2.6]]}}  # seconds a step


@pytest.fixture(scope="module")
def law_pair():
    """test_sample_proposal.py's target (8 ids, one layer) and its flatter draft."""
    cfg = GptOssConfig.preset("tiny").replace(vocab_size=V, eos_token_ids=(1,), num_hidden_layers=1, layer_types=())
    return gpt_oss.GptOss(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3)), draft(1.0)


def test_sampled_auto_follows_the_three_token_law(law_pair):
    """Chains of 0-2 drafts at 1, 1.1 and 1.5 seconds a step: the first step (every estimate at its
    prior) drafts 2, the second 1 (the rows still running accepted at most one draft, so the second
    position's estimate is at most a half, which the third draft's cost does not repay)."""
    t, d = law_pair
    table = {"batches": [1], "contexts": [0], "seconds": {"chain0": [[1.0]], "chain1": [[1.1]], "chain2": [[1.5]]}}
    n = 4096
    out = decode(t, d, [PROMPT] * n, 3, num_spec_tokens=2, temperature=1.0, proposal="sample",
                 seed=np.random.randint(1 << 30), depth="auto", cost_table=table, eos_ids=(), prefill_chunk=4,
                 max_cache_len=16)
    assert out.metrics["depth_histogram"] == {"chain0": 0, "chain1": 1, "chain2": 1}
    forward = nnx.jit(gpt_oss.forward)
    rows = [PROMPT + [a, b] for a in range(V) for b in range(V)]
    last = np.asarray(forward(t, jnp.asarray(rows))[0], np.float64)  # [V * V, 5, V]
    p1 = softmax(last[0, len(PROMPT) - 1])
    p2 = softmax(last[::V, len(PROMPT)])  # after a, for each a
    p3 = softmax(last[:, len(PROMPT) + 1]).reshape(V, V, V)
    exact = p1[:, None, None] * p2[:, :, None] * p3
    counts = np.zeros((V,) * 3)
    np.add.at(counts, tuple(np.asarray(out.tokens).T), 1)
    tv = 0.5 * np.abs(counts / n - exact).sum()
    # an exact sampler's TV at this n, simulated: its mean + 4.5 standard deviations (test_sample_proposal.py)
    sims = np.random.default_rng(0).multinomial(n, exact.ravel() / exact.sum(), size=400) / n
    null = 0.5 * np.abs(sims - exact.ravel()).sum(-1)
    assert tv < null.mean() + 4.5 * null.std(), (tv, null.mean(), null.std())
    assert out.metrics["accept_rate"] > 0 and len(DRAFT_IDS) < V  # drafts accepted; a draft missing two ids


def test_chooser_break_even_and_exploration():
    options = ((0, 1, 1), (1, 1, 2), (2, 1, 3), (3, 1, 4))
    cost = jnp.array([1.0, 1.5, 2.0, 2.5])  # a chain of d costs 1 + d / 2: d = 1 pays when est > 0.5
    on = jnp.ones(4, bool)
    active = jnp.array([True, True, False])

    def pick(rates, credit=0.0, available=on):
        est = jnp.broadcast_to(jnp.array(rates, jnp.float32), (3, 1, 3)).at[2].set(1.0)  # slot 2 is done: ignored
        return adaptive.choose(adaptive.expected_tokens(est, options), active, cost, available, jnp.float32(credit))

    # below break-even at the first position nothing pays; rates of (1 + sum) / cost: 1, 1.07, 0.9, 0.76 for
    # (0.6, 0.2, 0.1); 1, 1.27, 1.4, 1.48 for (0.9, 0.9, 0.9)
    for rates, want in (((0, 0, 0), 0), ((0.3, 0.3, 0.3), 0), ((0.45, 0.9, 0.9), 0), ((0.6, 0.2, 0.1), 1),
                        ((0.9, 0.9, 0.9), 3), ((0.9, 0.8, 0.1), 2)):
        assert int(pick(rates)[0]) == want, rates
    # exploring chain1 at (0.3, ...) loses 1.5 - 2.6 / 2 = 0.2 s (2 slots: 2.6 tokens; chain0's 2 a second)
    choice, credit = pick((0.3,) * 3, credit=0.01)
    assert int(choice) == 0 and float(credit) == pytest.approx(0.01 + adaptive.EXPLORE_SHARE * 1.0)
    choice, credit = pick((0.3,) * 3, credit=0.25)  # the credit covers that loss: chain1 runs once
    assert int(choice) == 1 and float(credit) == pytest.approx(0.05)
    assert int(pick((0.9,) * 3, available=jnp.array([True, True, False, False]))[0]) == 1  # what the table has
    # E = 1 + the running minimum over positions
    est = jnp.array([[[0.9, 0.5, 0.7]]], jnp.float32)
    assert adaptive.expected_tokens(est, options).tolist()[0] == pytest.approx([1.0, 1.9, 2.4, 2.9])


def test_estimates_prior_then_exponential():
    options = ((0, 1, 1), (1, 1, 2), (2, 1, 3), (2, 3, 4))
    active = jnp.array([True, False])
    auto = adaptive.init(adaptive.Table.uniform(4), options, ~active, jnp.array([5, 9]), 8, True, (6, jnp.float32))
    assert auto.est.shape == (2, 2, 2) and (auto.est == adaptive.PRIOR).all()
    # 3 expected tokens a second: chain2 best (the first), the tree as good: explored at no predicted loss
    assert int(auto.choice) == 3 and float(auto.credit) == 0
    seen = []
    for step in range(12):  # chain2 runs, slot 0 accepts 1 draft each time; slot 1 is done
        auto = adaptive.update(auto.replace(choice=jnp.int32(2)), options, active, jnp.array([1, 2]), active,
                               jnp.array([5, 9]), step)
        seen.append(float(auto.est[0, 0, 1]))
    assert (auto.est[0, 0, 0] == 1).all() and (auto.est[1] == 1).all() and (auto.est[0, 1] == 1).all()
    want, n = 1.0, adaptive.PRIOR_WEIGHT  # the prior's weight, then means, then weight EMA_WEIGHT
    for got in seen:
        want += max(adaptive.EMA_WEIGHT, 1 / (n + 1)) * (0 - want)
        n += 1
        assert got == pytest.approx(want)
    assert seen[0] == pytest.approx(adaptive.PRIOR_WEIGHT / (adaptive.PRIOR_WEIGHT + 1))  # (w * 1 + 0) / (w + 1)
    assert seen[5] == pytest.approx(adaptive.PRIOR_WEIGHT / (adaptive.PRIOR_WEIGHT + 6)) and seen[-1] < seen[-2]
    assert auto.steps.tolist() == [0, 0, 12, 0]
    assert auto.slot_steps.tolist() == [0, 0, 12, 0] and auto.realised.tolist() == [0, 0, 24, 0]
    assert auto.chosen.tolist() == [2] * 8  # the trace's 8 columns (the later steps dropped)
    # each step's prediction, chain2 in slot 0: 2 + the second position's estimate before the step
    assert float(auto.predicted[2]) == pytest.approx(12 * 2 + 1 + sum(seen[:-1]), rel=1e-5)


def test_cost_tables(tmp_path):
    pair = (GptOssConfig.from_hf(os.path.join(TARGET_DIR, "config.json")), None, jnp.float32)
    with open(os.path.join(DRAFT_DIR, "config.json")) as f:
        pair = (pair[0], config_from_hf(json.load(f), pair[0]), jnp.float32)
    options = cost_table.auto_options(3, 4, 8)
    assert [cost_table.option_name(o) for o in options] == ["chain0", "chain1", "chain2", "chain3", "tree3x4n8"]
    for kind in ("cpu", "h100", "h200"):  # every shipped file parses; each has a table for the embedded pair
        path = os.path.join(cost_table.DIR, kind + cost_table.SUFFIX)
        with open(path) as f:
            data = json.load(f)
        for table in data["tables"]:
            for option in table["seconds"]:
                cost_table.parse_option(option)
            assert "source" in table, (kind, table["model"])
        dtype = jnp.float32 if kind == "cpu" else jnp.bfloat16
        got, where = cost_table.resolve(path, None, pair[0], pair[1], dtype, "deterministic", True, options, 4)
        assert got.available[0] and got.available[3], kind  # the baseline and the 3-chain at least
    # interpolation: contexts linear then constant, batches linear then extended, missing options unavailable
    table = {"batches": [1, 4], "contexts": [100, 300],
             "seconds": {"chain0": [[1.0, 2.0], [2.0, None]], "chain3": [[None, None], [4.0, 6.0]]}}
    got, _ = cost_table.resolve(table, None, *pair, "deterministic", True, options, 8)
    assert got.available.tolist() == [True, False, False, True, False]
    assert got.contexts[:2].tolist() == [100, 300] and (np.diff(got.contexts) > 0).all()
    np.testing.assert_allclose(got.cost[0, :2], [2.0 + 4 / 3, 2.0])  # row 4 filled [2, 2]; slope [1/3, 0] beyond
    np.testing.assert_allclose(got.cost[3, :2], [4.0, 6.0])  # one row: taken as it is
    half, _ = cost_table.resolve(table, None, *pair, "deterministic", True, options, 2)
    np.testing.assert_allclose(half.cost[0, :2], [1 + 1 / 3, 2.0])
    bad = [({**table, "model": {"target": {"hidden_size": 1}}}, "no table for this pair"),
           ({**table, "contexts": [300, 100]}, "'contexts' must increase"),
           ({**table, "seconds": {"chain0": [[1.0], [2.0]]}}, r"seconds\['chain0'\] must be 2 lists"),
           ({**table, "seconds": {"chain9": [[1.0, 1.0], [1.0, 1.0]]}}, "no figures for any of"),
           ({**table, "seconds": {"chain": [[1.0, 1.0], [1.0, 1.0]]}}, "expected chain<d>"),
           (str(tmp_path / "missing"), "cannot read it")]
    for source, match in bad:
        with pytest.raises(ValueError, match=match):
            cost_table.resolve(source, None, *pair, "deterministic", True, options, 1)


def test_depth_arguments(law_pair):
    t, d = law_pair
    kw = dict(eos_ids=(), prefill_chunk=4, max_cache_len=16)
    fixed = decode(t, d, [PROMPT], 2, num_spec_tokens=2, **kw)
    again = decode(t, d, [PROMPT], 2, depth=2, **kw)
    assert again.tokens == fixed.tokens and again.metrics["compile_seconds"] == 0  # one program
    for args, err, match in [(dict(depth="deep"), ArgumentError, r"depth: expected an integer >= 1, 'auto' or None"),
                             (dict(depth=2, num_spec_tokens=3), ArgumentError, "depth=2 and num_spec_tokens=3"),
                             (dict(depth=0), ValueError, "depth: must be an integer >= 1"),
                             (dict(cost_table=TABLE), ArgumentError, "cost_table: only depth='auto'"),
                             (dict(depth="auto", cost_table=3), ValueError, "cost_table: expected None, a path")]:
        with pytest.raises(err, match=match):
            decode(t, d, [PROMPT], 2, **args, **kw)


def test_row_bytes_count_the_trace_and_estimates(law_pair):
    """`memory.row_bytes` equals what one more row adds to the state of an auto tree plan with a trace."""
    t, d = law_pair
    plan = Plan(cache_len=16, out_len=8, chunk=4, greedy=True, depth=2, branching=3, num_nodes=4,
                feature_ids=tuple(d.config.feature_layers), auto=cost_table.auto_options(2, 3, 4), trace=True)

    assert memory.row_bytes((t, d), plan) == added_row_bytes((t, d), plan, prompt_len=4)
