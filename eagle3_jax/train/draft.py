"""EAGLE-3 draft training with training-time test (TTT), as SpecForge and the EAGLE repository do it.

For a window w [B, N] the frozen target gives logits and the draft's three features f at every
position. Step 0 runs the draft layer at every position t on (token w[t+1], g = fc(f_t)) with
RoPE position t, causally: exactly the draft's prefill. Step i > 0 feeds each position its own
previous output (g = h_{i-1}[t], token w[t+1+i], position t + i), as decode does at tree depth i;
its query sees the step-0 keys of positions <= t (the committed draft cache) and the keys of
steps 1..i at the same t (its ancestors and itself): the "diagonal" mask of EAGLE-3's TTT. With a
draft `sliding_window` W, both sets keep only the keys whose position is > t + i - W, as decode does.

Step i at t predicts w[t+2+i]; its loss is the soft cross-entropy against the target's
distribution at t+1+i restricted to the draft vocabulary, weighted 0.8^i; positions whose target
argmax lies outside the draft vocabulary, or past the window's end, are masked out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.models.config import Eagle3Config, GptOssConfig, RopeConfig

F32 = jnp.float32
NEG = -1e30


def draft_config(target: GptOssConfig, draft_vocab_size: int, aux_layer_ids=None, **overrides) -> Eagle3Config:
    """A draft for `target`: the target's width, heads and head size, an MLP 4x as wide, plain RoPE
    (theta 10000) and the target's embedding (shared, frozen: `own_embed=False`)."""
    L = target.num_hidden_layers
    ids = tuple(aux_layer_ids) if aux_layer_ids is not None else target.default_aux_layer_ids()
    cfg = dict(hidden_size=target.hidden_size, intermediate_size=4 * target.hidden_size,
               num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
               head_dim=target.head_dim, vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size,
               target_hidden_size=target.hidden_size, aux_layer_ids=ids, aux_convention="output",
               target_num_layers=L, rms_norm_eps=target.rms_norm_eps,
               rope=RopeConfig(theta=10000.0, rope_type="default"),
               max_position_embeddings=target.max_position_embeddings, own_embed=False)
    cfg.update(overrides)
    return Eagle3Config(**cfg)


def new_draft(config: Eagle3Config, target: gpt_oss.GptOss, vocab_ids, seed: int = 0) -> eagle3.Eagle3:
    """A float32 draft to train. vocab_ids: the sorted target ids of its vocabulary (d2t follows).
    The target's embedding is copied in as a frozen `eagle3.Buffer` (the optimizer only sees
    `nnx.Param`s); `export` turns the trained draft back into one that shares the target's."""
    vocab_ids = np.asarray(vocab_ids)
    if vocab_ids.ndim != 1 or (vocab_ids.size and vocab_ids.dtype.kind not in "iu"):
        raise ValueError(f"vocab_ids: expected integer target ids of shape [k], got {vocab_ids.dtype} "
                         f"{list(vocab_ids.shape)}")
    vocab_ids = np.sort(vocab_ids.astype(np.int64))
    if vocab_ids.size != config.draft_vocab_size:
        raise ValueError(f"vocab_ids: {vocab_ids.size} ids, expected draft_vocab_size={config.draft_vocab_size}")
    if vocab_ids[0] < 0 or vocab_ids[-1] >= config.vocab_size:
        raise ValueError(f"vocab_ids: outside the target vocabulary [0, {config.vocab_size})")
    if np.any(vocab_ids[1:] == vocab_ids[:-1]):
        raise ValueError(f"vocab_ids: duplicate target id {int(vocab_ids[1:][vocab_ids[1:] == vocab_ids[:-1]][0])}")
    embed = None if config.own_embed else eagle3.Buffer(jnp.asarray(target.embed[...], F32))
    draft = eagle3.Eagle3(config, dtype=F32, rngs=nnx.Rngs(seed), embed=embed)
    draft.d2t.set_value(jnp.asarray(vocab_ids - np.arange(vocab_ids.size), jnp.int32))
    return draft


def export(draft: eagle3.Eagle3, target: gpt_oss.GptOss, dtype=jnp.bfloat16) -> eagle3.Eagle3:
    """The trained draft in `dtype`, sharing `target`'s embedding when it has none of its own."""
    c = draft.config
    out = nnx.eval_shape(lambda: eagle3.Eagle3(c.replace(own_embed=True), dtype=dtype, rngs=nnx.Rngs(0)))
    out.config = c
    trained = dict(nnx.to_flat_state(nnx.state(draft)))
    for path, var in nnx.to_flat_state(nnx.state(out)):
        if path[0] != "embed" or c.own_embed:
            var.set_value(jnp.asarray(trained[path].get_value(), var.get_value().dtype))
    if not c.own_embed:
        out.embed = target.embed
    return out


def _ttt_attention(q, k0, v0, ks, vs, window):
    """q [B, T, Hq, D] of step i; k0/v0 [B, T, Hkv, D] step 0's keys (causal, by position);
    ks/vs: steps 1..i's keys at the same position (diagonal). Returns [B, T, Hq, D] float32."""
    B, T, Hq, D = q.shape
    Hkv = k0.shape[2]
    G = Hq // Hkv
    i = len(ks)
    if window is not None:  # step j's key (position t + j) is inside the window of t + i iff j > i - window
        ks, vs = ks[max(0, i - window):], vs[max(0, i - window):]
    qf = q.astype(F32).reshape(B, T, Hkv, G, D) * D ** -0.5
    s0 = jnp.einsum("bthgd,bshd->bhgts", qf, k0.astype(F32))
    t, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    see = s <= t
    if window is not None:  # query position t + i, key position s
        see &= s > t + i - window
    s0 = jnp.where(see, s0, NEG)
    diag = [jnp.einsum("bthgd,bthd->bhgt", qf, kj.astype(F32)) for kj in ks]
    m = s0.max(-1)
    for d in diag:
        m = jnp.maximum(m, d)
    p0 = jnp.exp(s0 - m[..., None])
    pd = [jnp.exp(d - m) for d in diag]
    denom = p0.sum(-1) + sum(pd)
    out = jnp.einsum("bhgts,bshd->bthgd", p0, v0.astype(F32))
    for p, vj in zip(pd, vs):
        out = out + jnp.einsum("bhgt,bthd->bthgd", p, vj.astype(F32))
    out = out / jnp.moveaxis(denom, 3, 1)[..., None]
    return out.reshape(B, T, Hq, D)


def _shifted(a, i: int, T: int):
    """a[:, 1 + i : 1 + i + T], zero-padded past the end of a [B, N, ...]."""
    a = a[:, 1 + i:]
    return jnp.pad(a, [(0, 0), (0, T - a.shape[1])] + [(0, 0)] * (a.ndim - 2))


def ttt_hidden(draft: eagle3.Eagle3, tokens, feats, ttt_length: int):
    """tokens int32 [B, N], feats [B, N, 3 Ht] -> [h_0, ..., h_{L-1}], each [B, N - 1, H]: the
    un-normed draft output of TTT step i at every position t (valid for t < N - 1 - i)."""
    c = draft.config
    B, N = tokens.shape
    T = N - 1
    g = eagle3.project(draft, feats[:, :T])
    k0 = v0 = None
    ks, vs, hs = [], [], []
    for i in range(ttt_length):
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + i, (B, T))
        q, k, v, residual = eagle3.layer_inputs(draft, _shifted(tokens, i, T), g, pos)
        if i == 0:
            k0, v0 = k, v
        else:
            ks.append(k), vs.append(v)
        o = _ttt_attention(q, k0, v0, ks, vs, c.sliding_window).astype(residual.dtype)
        g = eagle3.layer_outputs(draft, residual, o)
        hs.append(g)
    return hs


def ttt_loss(draft: eagle3.Eagle3, batch: dict, target: gpt_oss.GptOss, *, ttt_length: int = 7,
             decay: float = 0.8):
    """batch["tokens"] int32 [B, N] -> (sum_i decay^i * loss_i, metrics): loss_i the masked soft
    cross-entropy of TTT step i (nats); acc_i how often the draft's argmax equals the target's
    (restricted) argmax at step i over the unmasked positions, a per-depth acceptance proxy."""
    c = draft.config
    tokens = batch["tokens"]
    if np.ndim(tokens) != 2 or np.shape(tokens)[1] < 2:
        raise ValueError(f'batch["tokens"]: expected [B, N] with N >= 2, got shape {list(np.shape(tokens))}')
    if not 1 <= ttt_length <= np.shape(tokens)[1] - 1:
        raise ValueError(f"ttt_length: {ttt_length} outside [1, N - 1 = {np.shape(tokens)[1] - 1}] (step i trains "
                         f"positions t < N - 1 - i; later steps would have none)")
    T = tokens.shape[1] - 1
    t_logits, feats = gpt_oss.forward(target, tokens, c.aux_layer_ids, aux_convention=c.aux_convention)
    t_logits, feats = jax.lax.stop_gradient(t_logits), jax.lax.stop_gradient(feats)
    vocab = jnp.arange(c.draft_vocab_size) + draft.d2t[...]
    p_target = jax.nn.softmax(t_logits[..., vocab], axis=-1)  # [B, N, Vd]
    in_vocab = jnp.zeros((c.vocab_size,), bool).at[vocab].set(True)[jnp.argmax(t_logits, -1)]  # [B, N]
    t_arg = jnp.argmax(t_logits[..., vocab], -1)
    total, metrics = 0.0, {}
    for i, h in enumerate(ttt_hidden(draft, tokens, feats, ttt_length)):
        logp = jax.nn.log_softmax(eagle3.logits(draft, h), axis=-1)
        w = ((jnp.arange(T) < T - i)[None, :] & _shifted(in_vocab, i, T)).astype(F32)
        n = jnp.maximum(w.sum(), 1.0)
        loss_i = -jnp.sum(jnp.sum(_shifted(p_target, i, T) * logp, -1) * w) / n
        total = total + decay ** i * loss_i
        metrics[f"loss_{i}"] = loss_i
        metrics[f"acc_{i}"] = jnp.sum((jnp.argmax(logp, -1) == _shifted(t_arg, i, T)) * w) / n
    return total, metrics
