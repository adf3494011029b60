"""Training: the LM loss learns, MXFP4 packing keeps the model, TTT matches decode's draft steps,
checkpoints resume exactly."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle3_jax.formats import mxfp4
from eagle3_jax.models import eagle3, gpt_oss, kv_cache
from eagle3_jax.train import draft as tdraft
from eagle3_jax.train import loop
from eagle3_jax.train import target as ttarget


def tiny_target(seed=0):
    cfg = ttarget.small_config(64, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, sliding_window=8)
    return ttarget.new_model(cfg, seed)


# jitted where a test runs them to check other code: one program a shape compiles far faster on CPU
# than the eager op-by-op dispatch (a tiny forward: ~1 s against ~6 s)
forward = nnx.jit(gpt_oss.forward, static_argnums=2)
layer = nnx.jit(eagle3.layer)


def target_tx():
    """The optimizer of every target fit here: the schedule's constants are part of the train step's
    program, so one schedule compiles one program (later fits find it in the compilation cache)."""
    return loop.adamw(3e-3, 60, 10)


def repeating_batches(step, B=8, T=24):
    # sequences with a learnable pattern: a random start, then +1 mod 64
    rng = np.random.default_rng(step)
    start = rng.integers(0, 64, (B, 1))
    return {"tokens": ((start + np.arange(T + 1)) % 64).astype(np.int32)}


def test_quantize_roundtrip_and_error():
    rng = np.random.default_rng(np.random.randint(1 << 30))
    w = rng.normal(size=(5, 7, 96)) * rng.uniform(1e-3, 10)
    w[0, 0, 32:64] = 0
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (5, 7, 3, 16) and scales.shape == (5, 7, 3)
    d = np.asarray(mxfp4.dequantize(jnp.asarray(blocks), jnp.asarray(scales), jnp.float32), np.float64)
    assert np.all(d[0, 0, 32:64] == 0)
    # E2M1 has 8 magnitudes: per-block relative RMS error is about 10%, never near 100%
    assert np.sqrt(np.mean((d - w) ** 2)) / w.std() < 0.2
    b2, s2 = mxfp4.quantize(d)  # representable values are a fixed point
    assert np.array_equal(b2, blocks) and np.array_equal(s2, scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(np.ones((2, 40)))


@pytest.fixture(scope="module")
def trained_target():
    """tiny_target() after 60 steps on the repeating pattern, and its logged records: the LM test's
    model and the TTT test's teacher (trained once for both; neither changes it)."""
    model = tiny_target()
    hist = loop.fit(model, ttarget.lm_loss, repeating_batches, steps=60, tx=target_tx(), log_every=20,
                    log=lambda r: None)
    return model, hist


def test_target_learns_and_packs(trained_target):
    model, hist = trained_target
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"] and hist[-1]["accuracy"] > 0.8
    tokens = jnp.asarray(repeating_batches(999)["tokens"])
    dense_logits, _ = forward(model, tokens)
    packed = ttarget.to_mxfp4(model, dtype=jnp.float32)
    assert isinstance(packed.layers[0].mlp.experts, gpt_oss.Mxfp4Experts) and packed.layers[0].mlp.path is None
    packed_logits, _ = forward(packed, tokens)
    agree = jnp.mean(jnp.argmax(dense_logits, -1) == jnp.argmax(packed_logits, -1))
    assert agree > 0.9


def test_fit_resumes_exactly(tmp_path):
    def run(steps, ckpt):
        m = tiny_target(seed=3)
        # 6 steps in the warmup: the learning rate of each step follows the restored step count
        loop.fit(m, ttarget.lm_loss, repeating_batches, steps=steps, tx=target_tx(), ckpt_dir=ckpt, save_every=3,
                 log=lambda r: None)
        return m

    whole = run(6, None)
    run(3, tmp_path / "c")  # interrupted after 3 steps
    resumed = run(6, tmp_path / "c")
    for a, b in zip(jax.tree.leaves(nnx.state(whole)), jax.tree.leaves(nnx.state(resumed))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_fit_checkpoint_at_or_past_steps(tmp_path):
    # a checkpoint past `steps` used to be restored silently: fit returned [] with the model trained
    # longer than asked
    def same(a, b):
        return all(np.array_equal(np.asarray(x), np.asarray(y))
                   for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))))

    ckpt = tmp_path / "c"
    done = tiny_target(seed=4)
    assert len(loop.fit(done, ttarget.lm_loss, repeating_batches, steps=3, tx=target_tx(), ckpt_dir=ckpt,
                        log=lambda r: None)) == 1
    # a finished run called again: restored, nothing to train, no records
    again, logged = tiny_target(seed=4), []
    assert loop.fit(again, ttarget.lm_loss, repeating_batches, steps=3, tx=target_tx(), ckpt_dir=ckpt,
                    log=logged.append) == []
    assert logged == [{"resumed_from_step": 3}] and same(again, done) and not same(again, tiny_target(seed=4))
    short = tiny_target(seed=4)
    msg = f"ckpt_dir {ckpt}: holds a checkpoint at step 3, past the requested steps=2"
    with pytest.raises(ValueError, match=re.escape(msg)):
        loop.fit(short, ttarget.lm_loss, repeating_batches, steps=2, tx=target_tx(), ckpt_dir=ckpt,
                 log=lambda r: None)
    assert same(short, tiny_target(seed=4))  # refused before the checkpoint was restored


def _draft_pair(seed, vocab_k=48, target=None):
    target = tiny_target(seed) if target is None else target
    cfg = tdraft.draft_config(target.config, vocab_k, aux_layer_ids=(0, 1, 3))
    ids = np.sort(np.random.default_rng(seed).choice(64, vocab_k, replace=False))
    return target, tdraft.new_draft(cfg, target, ids, seed=seed + 1), ids


def test_ttt_steps_equal_decode_draft_steps():
    # TTT step i at position t == the draft layer run as decode runs it: a cache holding step 0's
    # K/V of positions 0..t, then the chain of i nodes at positions t+1..t+i fed the earlier h's
    seed = np.random.randint(1 << 30)
    target, draft, _ = _draft_pair(seed % 1000)
    N, L = 12, 4
    tokens = jax.random.randint(jax.random.key(seed), (2, N), 0, 64)
    _, feats = forward(target, tokens, draft.config.aux_layer_ids)
    hs = nnx.jit(tdraft.ttt_hidden, static_argnums=3)(draft, tokens, feats, L)
    for t in (2, N - 1 - L):
        cache = kv_cache.init((draft.config.sliding_window,), 2, 32, draft.config.num_key_value_heads,
                              draft.config.head_dim, jnp.float32)
        zero = jnp.zeros((2,), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(t + 1, dtype=jnp.int32), (2, t + 1))
        h0, cache = layer(draft, tokens[:, 1:t + 2], eagle3.project(draft, feats[:, :t + 1]), pos, zero, None, cache)
        np.testing.assert_allclose(h0[:, t], hs[0][:, t], rtol=2e-4, atol=2e-4)
        for i in range(1, L):
            g = jnp.stack([hs[j][:, t] for j in range(i)], 1)  # node j+1 is fed h_j
            pos = jnp.broadcast_to(t + 1 + jnp.arange(i, dtype=jnp.int32), (2, i))
            h, _ = layer(draft, tokens[:, t + 2:t + 2 + i], g, pos, jnp.full((2,), t + 1, jnp.int32), None, cache)
            np.testing.assert_allclose(h[:, -1], hs[i][:, t], rtol=2e-4, atol=2e-4, err_msg=f"t={t} i={i}")


def test_ttt_loss_masks_and_learns(trained_target):
    # the target has learned the pattern (the fixture); the draft learns the target
    target, draft, ids = _draft_pair(5, target=trained_target[0])
    batch = repeating_batches(0, B=4, T=15)
    loss, m = nnx.jit(tdraft.ttt_loss, static_argnames="ttt_length")(draft, jax.tree.map(jnp.asarray, batch), target,
                                                                      ttt_length=3)
    assert np.isfinite(float(loss)) and set(m) == {"loss_0", "loss_1", "loss_2", "acc_0", "acc_1", "acc_2"}
    hist = loop.fit(draft, lambda d, b, t: tdraft.ttt_loss(d, b, t, ttt_length=3), repeating_batches, steps=60,
                    tx=loop.adamw(3e-3, 60, 10), extra=(target,), log_every=20, log=lambda r: None)
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]
    assert hist[-1]["acc_2"] > 0.6
    out = tdraft.export(draft, target)
    assert out.embed is target.embed and out.lm_head.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.arange(len(ids)) + np.asarray(out.d2t[...]), ids)


def test_ttt_sliding_window_matches_decode():
    # with a draft window W <= ttt_length - 2, TTT step i used to attend to its diagonal keys of steps
    # j <= i - W (positions outside the window), which the decode-time draft layer masks
    from types import SimpleNamespace

    seed = np.random.randint(1 << 30)
    W, N, L = 2, 10, 4
    tcfg = ttarget.small_config(64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    cfg = tdraft.draft_config(tcfg, 48, aux_layer_ids=(0, 1, 3), sliding_window=W)
    rng = np.random.default_rng(seed)
    target = SimpleNamespace(embed=nnx.Param(jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)))
    draft = tdraft.new_draft(cfg, target, np.arange(48), seed=seed % 997)
    tokens = jnp.asarray(rng.integers(0, 64, (2, N)), jnp.int32)
    feats = jnp.asarray(rng.standard_normal((2, N, 3 * 64)), jnp.float32)
    hs = nnx.jit(tdraft.ttt_hidden, static_argnums=3)(draft, tokens, feats, L)
    t = N - 1 - L
    cache = kv_cache.init((cfg.sliding_window,), 2, 16, cfg.num_key_value_heads, cfg.head_dim, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t + 1, dtype=jnp.int32), (2, t + 1))
    _, cache = layer(draft, tokens[:, 1:t + 2], eagle3.project(draft, feats[:, :t + 1]), pos,
                     jnp.zeros((2,), jnp.int32), None, cache)
    i = L - 1  # the deepest step: its key of step 1 lies outside the window
    g = jnp.stack([hs[j][:, t] for j in range(i)], 1)
    pos = jnp.broadcast_to(t + 1 + jnp.arange(i, dtype=jnp.int32), (2, i))
    h, _ = layer(draft, tokens[:, t + 2:t + 2 + i], g, pos, jnp.full((2,), t + 1, jnp.int32), None, cache)
    np.testing.assert_allclose(h[:, -1], hs[i][:, t], rtol=2e-4, atol=2e-4)


def test_train_misuse_raises():
    target = tiny_target(1)
    cfg = tdraft.draft_config(target.config, 8, aux_layer_ids=(0, 1, 3))
    # bad vocab ids used to give a d2t pointing at wrong or nonexistent target ids
    for ids, msg in ((np.r_[np.arange(7), 0], "duplicate target id 0"), (np.arange(8) + 60, "outside the target vocab"),
                     (np.arange(8) + 0.5, "expected integer target ids")):
        with pytest.raises(ValueError, match=f"vocab_ids: {msg}"):
            tdraft.new_draft(cfg, target, ids)
    draft = tdraft.new_draft(cfg, target, np.arange(8))
    tokens = jnp.zeros((2, 6), jnp.int32)
    with pytest.raises(ValueError, match=r"ttt_length: 6 outside \[1, N - 1 = 5\]"):
        tdraft.ttt_loss(draft, {"tokens": tokens}, target, ttt_length=6)
    with pytest.raises(ValueError, match=r"ttt_length: 0 outside"):
        tdraft.ttt_loss(draft, {"tokens": tokens}, target, ttt_length=0)
    with pytest.raises(ValueError, match=r'batch\["tokens"\]: expected \[B, N\] with N >= 2'):
        tdraft.ttt_loss(draft, {"tokens": tokens[:, :1]}, target, ttt_length=1)
    with pytest.raises(ValueError, match=r'batch\["tokens"\]: expected \[B, T \+ 1\]'):
        ttarget.lm_loss(target, {"tokens": tokens[0]})
    # adamw(lr, 1, 0) raised inside optax; warmup 0 now starts at the peak instead of spending a step at lr 0
    for steps, warmup, msg in ((0, 0, "steps: must be an integer >= 1, got 0"),
                               (5, -1, "warmup: must be an integer >= 0")):
        with pytest.raises(ValueError, match=msg):
            loop.adamw(1e-3, steps, warmup)
    for log_every, save_every, name in ((0, 1, "log_every"), (1, 0, "save_every")):
        with pytest.raises(ValueError, match=f"{name}: must be an integer >= 1, got 0"):
            loop.fit(draft, ttarget.lm_loss, repeating_batches, steps=1, tx=loop.adamw(1e-3, 1, 0),
                     log_every=log_every, save_every=save_every)


def test_adamw_warmup_zero_starts_at_peak():
    import optax

    params = {"w": jnp.ones((2, 2))}
    for steps in (1, 3):
        tx = loop.adamw(0.5, steps, 0, weight_decay=0.0)
        state = tx.init(params)
        upd, state = tx.update({"w": jnp.ones((2, 2))}, state, params)
        # Adam's first step moves every weight by the learning rate: the peak, not 0
        np.testing.assert_allclose(np.asarray(optax.apply_updates(params, upd)["w"]), 0.5, rtol=1e-5)
