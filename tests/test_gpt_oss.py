"""GPT-OSS against the independent float64 reference (tests/reference_np.py) on HF-format checkpoints."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import dense_from_mxfp4, random_hf_weights, tiny_hf_config, write_hf_checkpoint
from reference_np import reference_forward, reference_greedy

from eagle3_jax.convert import load_gpt_oss
from eagle3_jax.formats.packed_mask import MASK_WORD, mask_words
from eagle3_jax.models import gpt_oss, layers
from eagle3_jax.pallas import select
from eagle3_jax.spec import generate

LAYOUTS = [  # (experts, shards, norm dtype, model dtype)
    ("mxfp4", 1, "float32", jnp.float32),
    ("mxfp4", 3, "bfloat16", jnp.float32),
    ("dense", 2, "float32", jnp.float32),
    ("dense", 1, "bfloat16", jnp.float32),
]


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}-{p[1]}shard-norm_{p[2]}")
def ckpt(request, tmp_path_factory):
    experts, shards, norm_dtype, dtype = request.param
    cfg = tiny_hf_config()
    w = random_hf_weights(cfg, seed=request.param_index, norm_dtype=norm_dtype)
    if experts == "dense":
        w = dense_from_mxfp4(w)
    path = tmp_path_factory.mktemp(experts)
    write_hf_checkpoint(path, cfg, w, num_shards=shards)
    model = load_gpt_oss(path, dtype=dtype)
    assert model.config.experts_format == experts
    return cfg, w, model


# the entry points jitted, as decode and the README run them (eager, each op compiles on its own: 2-4x the time)
FORWARD = nnx.jit(gpt_oss.forward, static_argnames=("aux_layer_ids", "aux_convention"))
PREFILL = nnx.jit(gpt_oss.prefill, static_argnames=("chunk", "feature_ids"))
STEP = nnx.jit(gpt_oss.step, static_argnames=("feature_ids",))


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def test_forward_logits_and_features(ckpt):
    cfg, w, model = ckpt
    rng = np.random.default_rng()
    tokens = rng.integers(0, cfg["vocab_size"], (2, 24))  # 24 > window 8
    ref_logits, hidden = reference_forward(cfg, w, tokens)
    logits, feats = FORWARD(model, tokens, aux_layer_ids=(0, 2, 3))
    assert logits.dtype == jnp.float32 and logits.shape == (2, 24, cfg["vocab_size"])
    assert rel_err(logits, ref_logits) < 1e-3
    np.testing.assert_array_equal(np.argmax(logits, -1), np.argmax(ref_logits, -1))
    want = np.concatenate([hidden[1], hidden[3], hidden[4]], -1)  # outputs of blocks 0, 2, 3
    assert feats.shape == want.shape and rel_err(feats, want) < 1e-3
    _, feats_in = FORWARD(model, tokens, aux_layer_ids=(0, 2, 4), aux_convention="input")
    assert rel_err(feats_in, np.concatenate([hidden[0], hidden[2], hidden[4]], -1)) < 1e-3


def test_generate_ragged_batch_matches_reference(ckpt):
    cfg, w, model = ckpt
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 120, n).tolist() for n in (3, 11, 20)]
    out = generate(model, prompts, max_new_tokens=10, eos_ids=(), prefill_chunk=8)
    for p, got in zip(prompts, out.tokens):
        assert got == reference_greedy(cfg, w, p, 10)
    assert out.metrics["generated_tokens"] == 30 and out.metrics["steps"] == 9


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [..., N, N] -> packed uint32 [..., N, ceil(N/32)]."""
    n = allowed.shape[-1]
    bits = np.zeros(allowed.shape[:-1] + (mask_words(n),), np.uint64)
    for j in range(n):
        bits[..., j // MASK_WORD] |= allowed[..., j].astype(np.uint64) << np.uint64(j % MASK_WORD)
    return bits.astype(np.uint32)


def test_tree_step_matches_reference_paths(ckpt):
    """Verify path: prefill ragged prompts, then one step over a tree with siblings; each node's
    logits equal the reference on prompt + its root path. Cache scratch is poisoned."""
    cfg, w, model = ckpt
    rng = np.random.default_rng()
    parents = [-1, 0, 0, 1, 1, 2, 3]
    N = len(parents)
    anc = np.zeros((N, N), bool)
    depth = np.zeros(N, int)
    for i, p in enumerate(parents):
        anc[i, i] = True
        if p >= 0:
            anc[i] |= anc[p]
            depth[i] = depth[p] + 1
    lens = np.array([13, 6])
    prompts = np.zeros((2, 16), np.int32)
    for b, n in enumerate(lens):
        prompts[b, :n] = rng.integers(0, 120, n)
    cache = gpt_oss.init_cache(model, 2, 32)
    cache = jax.tree.map(lambda a: a + 1e4, cache)  # poison: any read of scratch shows
    cache, _, _ = PREFILL(model, cache, jnp.asarray(prompts), jnp.asarray(lens), chunk=8)
    tree_tokens = rng.integers(0, 120, (2, N))
    positions = lens[:, None] + depth[None]
    mask = pack(np.broadcast_to(anc, (2, N, N)))
    logits, _, _ = STEP(model, cache, jnp.asarray(tree_tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                        jnp.asarray(lens, jnp.int32), jnp.asarray(mask))
    for b in range(2):
        for i in range(N):
            path = [j for j in range(N) if anc[i, j]]
            seq = np.concatenate([prompts[b, :lens[b]], tree_tokens[b, path]])[None]
            ref = reference_forward(cfg, w, seq)[0][0, -1]
            assert rel_err(logits[b, i], ref) < 1e-3, (b, i)
            assert int(np.argmax(logits[b, i])) == int(np.argmax(ref))


@functools.partial(nnx.jit, static_argnames=("path", "method"))
def moe_call(moe, *args, path=None, method="__call__"):
    """moe(*args, path=) or another of its methods, jitted (eager, every op compiles on its own: ~3x the time)."""
    return getattr(moe, method)(*args, **({} if path is None else dict(path=path)))


def test_moe_paths_agree(ckpt):
    # grouped tiles, per-pair gathers and every-expert-on-every-token give one function
    _, _, model = ckpt
    moe = model.layers[1].mlp
    x = jax.random.normal(jax.random.key(np.random.randint(1 << 30)), (37, moe.router_w[...].shape[0]))
    ref = np.asarray(moe_call(moe, x, path="gathered"), np.float64)
    for path in ("grouped", "dense"):
        assert rel_err(moe_call(moe, x, path=path), ref) < 1e-5, path
    # skewed routing: 300 tokens all on experts 0..3 (random order and weights), more pairs an expert
    # than the grouped path's largest tile (256 rows): experts over several tiles
    rng = np.random.default_rng()
    xs = jnp.asarray(rng.normal(size=(300, x.shape[1])), x.dtype)
    ids = jnp.asarray(np.argsort(rng.random((300, 4)), axis=1), jnp.int32)
    ws = jax.nn.softmax(jnp.asarray(rng.normal(size=(300, 4)), jnp.float32), axis=-1)
    assert rel_err(moe_call(moe, xs, ids, ws, method="_grouped"),
                   np.asarray(moe_call(moe, xs, ids, ws, method="_gathered"), np.float64)) < 1e-5
    with pytest.raises(ValueError, match="grouped kernels"):  # float32 activations: the kernels take bf16
        moe._grouped(xs, ids, ws, select.KernelPolicy(moe_grouped="kernel"))
    moe.path = "dense"
    try:
        assert rel_err(moe(x), ref) < 1e-5
        with pytest.raises(ValueError, match="MoE path"):
            moe(x, path="nope")
    finally:
        moe.path = None


@pytest.mark.parametrize("k", [1, 4, 7])
def test_top_k_by_rank_is_lax_top_k(k):
    # coarse values: many ties, which both must order by index; rows of several shapes
    key = jax.random.key(np.random.randint(1 << 30))
    x = jnp.round(jax.random.normal(key, (3, 5, 40)) * 2) / 2
    x = jnp.where(x == 0, 0.0, x)  # no -0.0: lax.top_k ranks +0.0 above it, the rank count calls them equal
    x = x.at[0, 0].set(0.0)  # a row of equal values
    vals, ids = gpt_oss.top_k_by_rank(x, k)
    want_vals, want_ids = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))
    assert ids.dtype == jnp.int32 and vals.dtype == x.dtype


def test_route_one_token_and_many_agree(ckpt):
    # one token takes the padded two-row router dot and the rank top-k; many tokens lax.top_k
    _, _, model = ckpt
    moe = model.layers[0].mlp
    n = select.RANK_TOP_K_ROWS + 3
    x = jax.random.normal(jax.random.key(np.random.randint(1 << 30)), (n, moe.router_w[...].shape[0]))
    ids, w = moe.route(x)
    for i in (0, n - 1):
        ids1, w1 = moe.route(x[i:i + 1])
        np.testing.assert_array_equal(np.asarray(ids1[0]), np.asarray(ids[i]))
        np.testing.assert_allclose(np.asarray(w1[0]), np.asarray(w[i]), rtol=1e-6)


def _dot_rows(fn, *shapes):
    """The lhs row counts of the dots in fn's jaxpr for arguments of these shapes (f32)."""
    jaxpr = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
    return [e.invars[0].aval.shape[0] for e in jaxpr.eqns if e.primitive.name == "dot_general"]


def test_rows_dot_pads_one_row_where_a_device_holds_a_small_matrix():
    rng = np.random.default_rng(np.random.randint(1 << 30))
    w = jnp.asarray(rng.integers(-3, 4, (40, 24)), jnp.float32)  # integers: every order gives the same sums
    for shape in [(1, 40), (1, 1, 40), (3, 40), (2, 3, 40)]:
        x = jnp.asarray(rng.integers(-3, 4, shape), jnp.float32)
        got = layers.rows_dot(x, w, preferred_element_type=jnp.float32)
        assert got.shape == shape[:-1] + (24,)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(x @ w))
    small, big = (2880, 512), (2880, 3600)  # 1.5M and 10.4M elements
    assert _dot_rows(layers.rows_dot, (1, 1, 2880), small) == [2]
    assert _dot_rows(layers.rows_dot, (1, 1, 2880), big) == [1]  # one device holds it whole: a GEMM
    assert _dot_rows(layers.rows_dot, (3, 2880), small) == [3]
    split = functools.partial(layers.rows_dot, devices=2)  # w split over 2 devices: 5.2M a device
    assert _dot_rows(split, (1, 1, 2880), big) == [2]


@pytest.mark.parametrize("B", [1, 3])
def test_kv_cache_write_puts_tokens_at_each_start(B):
    from eagle3_jax.models import kv_cache as kvc

    rng = np.random.default_rng(np.random.randint(1 << 30))
    H, S, D, N = 2, 11, 4, 3
    buf = rng.standard_normal((B, H, S, D)).astype(np.float32)
    new = rng.standard_normal((B, N, H, D)).astype(np.float32)
    start = rng.integers(0, S - N + 1, B).astype(np.int32)
    want = buf.copy()
    for b in range(B):
        want[b, :, start[b]:start[b] + N] = new[b].transpose(1, 0, 2)
    got = jax.jit(kvc.write)(jnp.asarray(buf), jnp.asarray(new), jnp.asarray(start))
    np.testing.assert_array_equal(np.asarray(got), want)



@pytest.fixture(scope="module")
def tiny_model():
    from eagle3_jax.models.config import PRESETS

    cfg = PRESETS["tiny-dense"]
    cfg = cfg.replace(num_hidden_layers=1, layer_types=cfg.layer_types[:1])
    return gpt_oss.GptOss(cfg, dtype=jnp.float32, rngs=nnx.Rngs(np.random.randint(1 << 30)))


def test_prefill_rejects_padding_past_the_cache(tiny_model):
    # a 20-token prompt fits a 24-slot cache, but chunk 16 pads it to 32: the last chunk's write used to
    # be clamped onto the prompt's own slots (silently wrong K/V and logits)
    model = tiny_model
    rng = np.random.default_rng()
    tokens = np.zeros((2, 32), np.int32)
    tokens[:, :20] = rng.integers(0, model.config.vocab_size, (2, 20))
    lens = jnp.asarray([20, 7])
    with pytest.raises(ValueError, match="padded prompt length 32 is longer than the cache"):
        gpt_oss.prefill(model, gpt_oss.init_cache(model, 2, 24), tokens, lens, chunk=16)
    for kw, msg in ((dict(prompt_lengths=jnp.asarray([33, 7])), r"prompt_lengths \[33, 7\] outside \[1, 32\]"),
                    (dict(prompt_lengths=jnp.asarray([0, 7])), "outside"),
                    (dict(prompt_lengths=jnp.asarray([20, 7, 1])), r"prompt_lengths shape \[3\], expected \[B\]"),
                    (dict(chunk=0), "prefill: chunk: must be an integer >= 1, got 0"),
                    (dict(tokens=tokens[:1]), "cache batch 2, tokens batch 1"),
                    (dict(tokens=tokens[0]), r"tokens: expected token ids of shape \[B, T\]")):
        args = dict(tokens=tokens, prompt_lengths=lens, chunk=16)
        args.update(kw)
        with pytest.raises(ValueError, match=msg):
            gpt_oss.prefill(model, gpt_oss.init_cache(model, 2, 32), args.pop("tokens"), args.pop("prompt_lengths"),
                            **args)


def test_forward_and_step_reject_bad_inputs(tiny_model):
    # ids outside the vocabulary used to be clamped by the embedding gather, float ids truncated
    model = tiny_model
    V = model.config.vocab_size
    for bad, msg in (([[1, V]], f"token id {V} outside the vocabulary"), ([[-1, 2]], "token id -1 outside"),
                     (np.array([[1.5, 2.0]]), "integer token ids, got dtype float64"),
                     (np.arange(4), r"shape \[B, T\] with B, T >= 1, got shape \[4\]"),
                     (np.zeros((1, 0), np.int32), r"got shape \[1, 0\]")):
        with pytest.raises(ValueError, match=f"tokens: .*{msg}"):
            gpt_oss.forward(model, bad)
    cache = gpt_oss.init_cache(model, 2, 8)
    L = jnp.asarray([3, 5], jnp.int32)
    tok = jnp.zeros((2, 2), jnp.int32)
    pos = L[:, None] + jnp.arange(2)
    for args, msg in (((tok, L, L), r"positions shape \[2\], expected \[B, T\] = \[2, 2\]"),
                      ((tok, pos, L[:1]), r"lengths shape \[1\], expected \[B\] = \[2\]"),
                      ((tok, pos, L, jnp.zeros((2, 2, 2), jnp.uint32)), r"mask shape \[2, 2, 2\], expected packed"),
                      ((tok[:1], pos[:1], L[:1]), "cache batch 2, tokens batch 1"),
                      ((jnp.zeros((2, 9), jnp.int32), jnp.zeros((2, 9), jnp.int32), L * 0), "9 tokens do not fit"),
                      ((tok, pos, L + 2), r"lengths \[5, 7\] \+ 2 tokens run past the cache's 8 slots"),
                      ((tok + V, pos, L), "outside the vocabulary")):
        with pytest.raises(ValueError, match=msg):
            gpt_oss.step(model, cache, *args)
    with pytest.raises(ValueError, match="init_cache: max_len: must be an integer >= 1, got 0"):
        gpt_oss.init_cache(model, 2, 0)
    for ids in ((0, 1.5, 2), (0, True, 2)):  # float ids used to be truncated, True read as layer 1
        with pytest.raises(ValueError, match="aux_layer_ids: expected an integer, got"):
            gpt_oss.forward(model, tok, aux_layer_ids=ids)
    # concrete arrays closed over by a traced function are still checked, and good ones trace
    out = jax.eval_shape(lambda t: gpt_oss.step(model, cache, t, pos, L)[0], tok)
    assert out.shape == (2, 2, V)
    far = L + 2
    with pytest.raises(ValueError, match="run past the cache"):
        jax.eval_shape(lambda t: gpt_oss.step(model, cache, t, pos, far)[0], tok)
