"""decode(..., proposal="sample"): drafts drawn from the draft's q at the decoding temperature and
verified by recursive rejection with q. The first two generated tokens must follow the target's
exact law (enumerated on 8 ids), for a chain and a tree with siblings, at temperatures 1.0 and 0.7,
with a draft whose distribution differs from the target's and whose vocabulary misses two ids (q is
zero there: the rejection rule must still give the target's law). The tree keeps 3 of its 12
candidates, so a selection that looked at the drawn tokens (keeping the likelier draws, as top-k
scoring would) biases the law beyond the tolerance."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle3_jax.models import Eagle3Config, GptOssConfig, eagle3, gpt_oss
from eagle3_jax.spec import ArgumentError, decode

V = 8
DRAFT_IDS = np.array([0, 1, 2, 4, 5, 7])  # the draft's vocabulary: ids 3 and 6 are never drafted


@pytest.fixture(scope="module")
def pair():
    cfg = GptOssConfig.preset("tiny").replace(vocab_size=V, eos_token_ids=(1,))
    t = gpt_oss.GptOss(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    dcfg = Eagle3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=V, draft_vocab_size=len(DRAFT_IDS), target_hidden_size=64,
                        aux_layer_ids=(0, 1, 2), target_num_layers=4)
    d = eagle3.Eagle3(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(4))
    d.d2t[...] = jnp.asarray(DRAFT_IDS - np.arange(len(DRAFT_IDS)), jnp.int32)
    d.lm_head[...] = d.lm_head[...] * 4.0  # a peaked draft, far from the target
    return t, d


forward = nnx.jit(gpt_oss.forward)  # one jitted function for every call: traced once a shape


def exact_law(t, prompt, temperature):
    lsm = lambda x: np.exp(x - np.log(np.sum(np.exp(x), -1, keepdims=True)))  # noqa: E731
    l1 = np.asarray(forward(t, jnp.asarray([prompt]))[0][0, -1], np.float64) / temperature
    l2 = np.asarray(forward(t, jnp.asarray([prompt + [x] for x in range(V)]))[0][:, -1], np.float64) / temperature
    return lsm(l1)[:, None] * lsm(l2)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(num_spec_tokens=3), dict(num_spec_tokens=2, topk=3, num_draft_tokens=4)],
                         ids=["chain", "tree"])
def test_sampled_drafts_follow_target_two_token_law(pair, kw):
    t, d = pair
    prompt, n = [2, 5, 3], 4096
    for temperature in (1.0, 0.7):  # one executable: the temperature is an argument
        exact = exact_law(t, prompt, temperature)
        out = decode(t, d, [prompt] * n, 2, temperature=temperature, eos_ids=(), prefill_chunk=4, max_cache_len=16,
                     seed=np.random.randint(1 << 30), proposal="sample", **kw)
        counts = np.zeros((V, V))
        for a, b in out.tokens:
            counts[a, b] += 1
        tv = 0.5 * np.abs(counts / n - exact).sum()
        noise = 0.5 * np.sum(np.sqrt(2 * exact * (1 - exact) / (np.pi * n)))
        assert tv < noise + 0.02, (temperature, tv, noise)
        m = out.metrics
        assert m["proposal"] == "sample" and m["accept_rate"] > 0  # drafts were accepted, and rejected:
        assert m["accept_length_histogram"][0] > 0  # both branches of the rule ran


def test_proposal_arguments(pair):
    t, d = pair
    with pytest.raises(ArgumentError, match=r"proposal: 'top1', expected one of \['deterministic', 'sample'\]"):
        decode(t, d, [[2, 5]], 2, temperature=1.0, proposal="top1")
    with pytest.raises(ArgumentError, match="proposal: 'sample' .* temperature, which is 0"):
        decode(t, d, [[2, 5]], 2, proposal="sample")
