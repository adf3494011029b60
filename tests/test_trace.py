"""Output.trace: the tokens each row commits at each step, recorded on the device (decode and generate,
trace=True). Two ragged prompts, one of which stops at an eos while the other runs to the budget; a
draft that always proposes id 0 and a target that picks 0 in runs, so steps commit 1 to 4 tokens. Each
row of the trace sums to its output length less the first token, -1 marks the steps after a row is
done, and the tokens are generate's: for a chain of 3, and for depth="auto" over the chains of 0-2
drafts and a 2x3 tree of 5 nodes (its greedy identity, histogram and trace of choices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_decode import TINY, draft_config

from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.spec import ArgumentError, decode, generate

CHAINS = {"chain0": [[1.0]], "chain1": [[1.4]], "chain2": [[1.8]]}
TABLE = {"batches": [1], "contexts": [0], "seconds": {**CHAINS, "tree2x3n5": [[2.2]]}}  # seconds a step
AUTO = dict(num_spec_tokens=2, branching=3, num_draft_tokens=5, depth="auto", cost_table=TABLE)

PROMPTS = [np.random.default_rng(11).integers(3, 256, n).tolist() for n in (5, 13)]
NEW = 14
RUN = dict(eos_ids=(83,), prefill_chunk=8)  # 83: prompt 0's 5th token (`runs`), absent from prompt 1's output


def runs():
    """test_decode.py's pair with one target layer (programs compile faster), id 0's head row doubled in
    the target (prompt 1 then continues with a run of 0s) and a zero head in the draft (it always
    proposes 0)."""
    t = gpt_oss.GptOss(TINY.replace(num_hidden_layers=1, layer_types=()), dtype=jnp.float32, rngs=nnx.Rngs(0))
    d = eagle3.Eagle3(draft_config(aux_layer_ids=(0, 0, 0), target_num_layers=1), dtype=jnp.float32,
                      rngs=nnx.Rngs(1))
    d.lm_head[...] = jnp.zeros_like(d.lm_head[...])
    t.lm_head[...] = t.lm_head[...].at[0].multiply(2.0)
    return t, d


@pytest.fixture(scope="module")
def models():
    return runs()


def check(out, steps_commit_one=False):
    trace = out.trace
    assert isinstance(trace, jax.Array) and trace.dtype == jnp.int32
    trace = np.asarray(trace)
    assert trace.shape == (len(PROMPTS), out.metrics["steps"])
    for row, toks in zip(trace, out.tokens):
        n = int((row >= 0).sum())
        assert (row[:n] >= 1).all() and (row[n:] == -1).all(), row  # committed while active, then done
        assert row[:n].sum() == len(toks) - 1, (row, len(toks))
        if steps_commit_one:
            assert (row[:n] == 1).all()
    assert (trace[:, -1] >= 1).any()  # the last step ran for some row
    return trace


def test_generate_and_decode_traces(models):
    t, d = models
    base = generate(t, PROMPTS, NEW, trace=True, **RUN)
    assert [len(x) for x in base.tokens] == [5, NEW] and base.tokens[0][-1] == 83  # eos in one row
    check(base, steps_commit_one=True)
    assert base.trace_option is None
    for kw in (dict(num_spec_tokens=3), AUTO):
        out = decode(t, d, PROMPTS, NEW, trace=True, **kw, **RUN)
        assert out.tokens == base.tokens, kw
        trace = check(out)
        assert (trace == -1).any() and trace.max() > 2, (kw, trace)  # row 0 ended first; steps of 3+ tokens
        assert trace.shape[1] < base.trace.shape[1]
        m = out.metrics
        assert int((trace >= 1).sum()) == m["slot_steps"]
        assert int(trace[trace > 0].sum()) == m["generated_tokens"] - len(PROMPTS)
    auto = m["auto"]  # the tree configuration's depth="auto"
    assert m["depth"] == "auto" and auto["table"] == "cost_table"
    assert auto["options"] == list(m["depth_histogram"]) == [*CHAINS, "tree2x3n5"]
    assert sum(m["depth_histogram"].values()) == m["steps"] and sum(auto["slot_steps"]) == m["slot_steps"]
    assert sum(1 for s in auto["steps"] if s) >= 2, auto  # the choice changed during the run
    assert 0 <= m["accept_rate"] <= 1 and auto["predicted_seconds"] > 0
    chosen = np.asarray(out.trace_option)
    assert chosen.shape == (m["steps"],)
    assert np.bincount(chosen, minlength=len(auto["options"])).tolist() == auto["steps"]


def test_trace_argument(models):
    t, d = models
    with pytest.raises(ArgumentError, match=r"^trace: expected True or False, got 1$"):
        decode(t, d, PROMPTS, NEW, trace=1)
    with pytest.raises(ArgumentError, match=r"^trace: expected True or False, got 'yes'$"):
        generate(t, PROMPTS, NEW, trace="yes")
