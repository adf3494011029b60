"""generate(): greedy against the reference, eos, sampling distribution, bad input, no recompiles."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle3_jax.models import GptOssConfig, gpt_oss
from eagle3_jax.spec import generate
from eagle3_jax.spec.decode import plan_lengths


@pytest.fixture(scope="module")
def tiny():
    return gpt_oss.GptOss(GptOssConfig.preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(7))


# the reference computations below: one jitted forward compiles in about 1 s a shape on CPU, the
# eager op-by-op one in about 6 s
forward = nnx.jit(gpt_oss.forward)


def naive_greedy(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        logits, _ = forward(model, jnp.asarray([seq]))
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt):]


def test_eos_stops_one_slot_others_continue(tiny):
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 256, n).tolist() for n in (4, 9)]
    free = generate(tiny, prompts, 8, eos_ids=())
    eos = free.tokens[0][3]
    cut = free.tokens[0].index(eos)
    out = generate(tiny, prompts, 8, eos_ids=(eos,))
    assert out.tokens[0] == free.tokens[0][:cut + 1]  # eos included, nothing after
    other = free.tokens[1]
    want = other[:other.index(eos) + 1] if eos in other else other
    assert out.tokens[1] == want
    assert free.metrics["compile_seconds"] >= 0 and out.metrics["generated_tokens"] == len(out.tokens[0]) + len(want)


def test_budget_one_and_reuse_of_executable(tiny):
    out = generate(tiny, [[5, 6, 7]], 1, eos_ids=())
    assert len(out.tokens[0]) == 1 and out.tokens[0] == naive_greedy(tiny, [5, 6, 7], 1)
    again = generate(tiny, [[9, 9, 9, 9]], 1, eos_ids=())  # same buckets: no new compile
    assert again.metrics["compile_seconds"] == 0.0


def test_sampling_follows_exact_two_token_distribution():
    """Temperature 1: the joint law of the first two tokens, enumerated on an 8-token vocabulary."""
    cfg = GptOssConfig.preset("tiny").replace(vocab_size=8, eos_token_ids=(1,))
    model = gpt_oss.GptOss(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    prompt = [2, 5, 3]
    p1 = np.asarray(jnp.exp(jax_log_softmax(forward(model, jnp.asarray([prompt]))[0][0, -1])))
    seqs = jnp.asarray([prompt + [t] for t in range(8)])
    p2 = np.asarray(jnp.exp(jax_log_softmax(forward(model, seqs)[0][:, -1])))
    exact = p1[:, None] * p2  # [t1, t2]
    n = 4096
    # 8 cache slots, not the default bucket's 256 a row (a 1 GiB cache at this batch)
    out = generate(model, [prompt] * n, 2, temperature=1.0, eos_ids=(), seed=np.random.randint(1 << 30),
                   prefill_chunk=4, max_cache_len=8)
    counts = np.zeros((8, 8))
    for t1, t2 in out.tokens:
        counts[t1, t2] += 1
    tv = 0.5 * np.abs(counts / n - exact).sum()
    noise = 0.5 * np.sum(np.sqrt(2 * exact * (1 - exact) / (np.pi * n)))  # E[TV] of an exact sampler
    assert tv < noise + 0.02, (tv, noise)
    # (temperature 0 is the argmax: test_budget_one_and_reuse_of_executable here, and greedy generate
    # against the float64 reference in tests/test_gpt_oss.py)


def jax_log_softmax(x):
    return x - jnp.log(jnp.sum(jnp.exp(x - x.max(-1, keepdims=True)), -1, keepdims=True)) - x.max(-1, keepdims=True)


@pytest.mark.parametrize("prompts,kw,match", [
    ([[]], {}, r"prompts\[0\]: empty prompt"),
    ([], {}, "non-empty list"),
    ([[1, 2], [3, 256]], {}, r"prompts\[1\]: token id 256 outside the vocabulary \[0, 256\)"),
    ([[1] * 20], {"max_cache_len": 24}, "20 tokens \\+ max_new_tokens=5 = 25 does not fit max_cache_len=24"),
    ([[1] * 1020], {}, "does not fit max_position_embeddings=1024"),
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens"),
    ([[1, 2]], {"temperature": -1.0}, "temperature"),
    ([[1, 2]], {"eos_ids": (300,)}, "eos_ids"),
    # a given max_cache_len caps the cache; the position limit still holds
    ([[1] * 1020], {"max_cache_len": 4096}, "does not fit max_position_embeddings=1024"),
    ([[1, 2]], {"temperature": float("nan")}, "temperature: must be finite"),
    ([[1, 2]], {"temperature": float("inf")}, "temperature: must be finite"),
    # wrong types: an ArgumentError, which is a ValueError and a TypeError
    ([1, 2, 3], {}, "flat list of ids"),
    ([[1, 2.0]], {}, r"prompts\[0\]: token ids must be integers, got 2.0"),
    ([[1, True]], {}, "token ids must be integers, got True"),
    (["ab"], {}, r"prompts\[0\]: expected a list of token ids"),
    ([[1, 2]], {"max_new_tokens": 2.5}, "max_new_tokens: expected an integer, got 2.5"),
    ([[1, 2]], {"max_new_tokens": None}, "max_new_tokens: expected an integer"),
    ([[1, 2]], {"eos_ids": 3}, r"eos_ids: expected a sequence of token ids \(e.g. \[3\]\)"),
    ([[1, 2]], {"eos_ids": (1.0,)}, "eos_ids: token ids must be integers"),
    ([[1, 2]], {"temperature": "hot"}, "temperature: expected a number"),
    ([[1, 2]], {"prefill_chunk": 8.0}, "prefill_chunk: expected an integer or None"),
    ([[1, 2]], {"max_cache_len": 64.0}, "max_cache_len: expected an integer or None"),
    ([[1, 2]], {"seed": 1.5}, "seed: expected an integer"),
])
def test_bad_input_raises(tiny, prompts, kw, match):
    kw = {"max_new_tokens": 5, **kw}
    with pytest.raises(ValueError, match=match):
        generate(tiny, prompts, **kw)


def test_wrong_types_are_type_errors_too(tiny):
    with pytest.raises(TypeError, match="flat list"):
        generate(tiny, [1, 2, 3], 4)
    with pytest.raises(TypeError, match="target: expected a gpt_oss.GptOss"):
        generate(object(), [[1, 2]], 4)


def test_array_prompts(tiny):
    # numpy and jax arrays (a [B, T] array or a list of rows) read as lists of ids; a flat one is refused
    rng = np.random.default_rng()
    ids = rng.integers(3, 256, (2, 6))
    want = generate(tiny, ids.tolist(), 3, eos_ids=()).tokens
    for prompts in (ids, jnp.asarray(ids), list(jnp.asarray(ids)), [ids[0], ids[1].tolist()]):
        assert generate(tiny, prompts, 3, eos_ids=()).tokens == want
    for flat in (ids[0], jnp.asarray(ids[0])):
        with pytest.raises(ValueError, match="flat list of ids"):
            generate(tiny, flat, 3)
    with pytest.raises(ValueError, match="token ids must be integers, got 1.5"):
        generate(tiny, np.array([[1.5, 2.0]]), 3)


@pytest.mark.slow
def test_max_cache_len_caps_the_cache(tiny):
    # the cache is exactly max_cache_len slots where that is below the bucketed length; the automatic
    # chunk shrinks so the padded prompt fits; the tokens are those of the uncapped run
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 256, n).tolist() for n in (270, 31)]
    want = generate(tiny, prompts, 9, eos_ids=()).tokens
    assert plan_lengths(tiny.config, prompts, 9, None, 279) == (270, 279, 256, 270)
    assert generate(tiny, prompts, 9, eos_ids=(), max_cache_len=279).tokens == want
    assert generate(tiny, prompts, 9, eos_ids=(), max_cache_len=300, prefill_chunk=90).tokens == want
    with pytest.raises(ValueError, match="prefill_chunk=256 pads the 270-token prompt to 512 cache slots, more than "
                                         "max_cache_len=300"):
        generate(tiny, prompts, 9, max_cache_len=300, prefill_chunk=256)


def test_eos_count_does_not_recompile(tiny):
    generate(tiny, [[5, 6, 7]], 4, eos_ids=(1,))
    assert generate(tiny, [[5, 6, 7]], 4, eos_ids=(1, 2, 3)).metrics["compile_seconds"] == 0.0


def test_length_plan_buckets():
    cfg = GptOssConfig.preset("tiny")
    assert plan_lengths(cfg, [[1] * 300], 10, 256, None) == (512, 512, 256, 256)
    # the cache holds the padded prompt even where the chunk is longer than prompt + budget
    assert plan_lengths(cfg, [[1] * 530], 6, 512, None) == (1024, 1024, 256, 512)
    # automatic chunks: one row up to 2048 tokens, split evenly above; 2048 tokens over the batch
    assert plan_lengths(cfg, [[1] * 300], 10, None, None) == (512, 512, 256, 512)
    big = GptOssConfig.preset("gpt-oss-120b")
    assert plan_lengths(big, [[1] * 2100], 10, None, None) == (2560, 2560, 256, 1280)
    assert plan_lengths(cfg, [[1] * 700] * 4, 10, None, None)[3] == 256 * 2
    assert plan_lengths(cfg, [[1] * 700] * 16, 10, None, None)[3] == 256
    with pytest.raises(ValueError, match="prefill_chunk"):
        plan_lengths(cfg, [[1] * 30], 10, 0, None)


def test_chunk_longer_than_the_budget_keeps_the_prompt(tiny):
    # a 530-token prompt in 512-token chunks (padded to 1024 > prompt + budget rounded up, 768): the
    # second chunk's padding must not overwrite the prompt's cache slots (it did before the cache held
    # the padded prompt); automatic chunks give the same tokens
    prompt = np.random.default_rng().integers(3, 256, 530).tolist()
    want = generate(tiny, [prompt], 6, eos_ids=(), prefill_chunk=256).tokens
    assert generate(tiny, [prompt], 6, eos_ids=(), prefill_chunk=512).tokens == want
    assert generate(tiny, [prompt], 6, eos_ids=()).tokens == want
