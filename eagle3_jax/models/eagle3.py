"""The EAGLE-3 draft in Flax NNX (docs/reference.md 5).

Per position t the draft reads the token embedding e = embed(x_{t+1}) and the target features
f_t (3 target hidden states concatenated): g = fc(f_t) (after `input_norm` over the concat with
`norm_before_fc`, or one norm per chunk with `fc_norm`); one Llama decoder layer over
concat(input_layernorm(e), hidden_norm(g)) with residual g (hidden_norm(g) with
`norm_before_residual`); logits = lm_head(norm(h)) (no norm without `norm_output`) over the draft
vocabulary, mapped to target ids by `d2t` offsets. The un-normed h is the next draft step's g.

Entry points (traceable under jit):
  forward(draft, next_tokens, features)        one parallel causal pass -> draft logits [B, T, Vd]
  project / layer / logits                     the pieces decode composes (cached, tree masks)
  layer_inputs / layer_outputs                 the layer around its attention (training-time test)
  prefill(draft, cache, next_tokens, features, lengths, chunk)   chunked prompt prefill into the cache
  init_cache, to_target_ids, top_k
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from eagle3_jax import parallel
from eagle3_jax.checks import int_arg
from eagle3_jax.models import kv_cache as kvc
from eagle3_jax.models import rope
from eagle3_jax.models.config import Eagle3Config
from eagle3_jax.models.gpt_oss import RMSNorm, check_step_inputs, check_step_tokens, check_tokens, qkv_rope
from eagle3_jax.models.layers import F32, keep_position, normal, over_chunks, shape_of

NO_SINK = -1e30  # the draft has no attention sinks: a sink logit that never gets weight


class Buffer(nnx.Variable):
    """Non-trainable state (the d2t offsets)."""


class Eagle3(nnx.Module):
    """Weights in [in, out] layout (the target's projections are [out, in]: a one-row share streams
    faster so, and the draft is never split), q, k and v fused (wqkv [2H, (Hq + 2 Hkv) * D]);
    lm_head [Vd, H] and embed [V, H] as rows. `embed` / `lm_head` may be the target's own Params
    (shared, not copied) when the draft has none of its own."""

    def __init__(self, config: Eagle3Config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs, embed=None, lm_head=None):
        c = config
        H, Ht, D, Hq, Hkv = (c.hidden_size, c.target_hidden_size, c.head_dim, c.num_attention_heads,
                             c.num_key_value_heads)
        self.config, self.dtype = c, dtype
        if c.own_embed:
            self.embed = nnx.Param(normal(rngs, (c.vocab_size, H), 1.0, dtype))
        elif embed is None:
            raise ValueError("Eagle3: config.own_embed is False: pass the target's embedding (embed=target.embed)")
        else:
            self.embed = embed
        if c.own_lm_head:
            self.lm_head = nnx.Param(normal(rngs, (c.draft_vocab_size, H), H ** -0.5, dtype))
        elif lm_head is None:
            raise ValueError("Eagle3: config.own_lm_head is False: pass the target's head (lm_head=target.lm_head)")
        else:
            self.lm_head = lm_head
        self.input_norm = RMSNorm(3 * Ht, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc_norm = nnx.List([RMSNorm(Ht, c.rms_norm_eps) for _ in range(3)]) if c.fc_norm else None
        self.fc = nnx.Param(normal(rngs, (3 * Ht, H), (3 * Ht) ** -0.5, dtype))
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.wqkv = nnx.Param(normal(rngs, (2 * H, (Hq + 2 * Hkv) * D), (2 * H) ** -0.5, dtype))
        self.wo = nnx.Param(normal(rngs, (Hq * D, H), (Hq * D) ** -0.5, dtype))
        self.gate = nnx.Param(normal(rngs, (H, c.intermediate_size), H ** -0.5, dtype))
        self.up = nnx.Param(normal(rngs, (H, c.intermediate_size), H ** -0.5, dtype))
        self.down = nnx.Param(normal(rngs, (c.intermediate_size, H), c.intermediate_size ** -0.5, dtype))
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.d2t = Buffer(jnp.zeros((c.draft_vocab_size,), jnp.int32))


def project(draft: Eagle3, features):
    """Target features [..., 3 * Ht] -> g [..., H]."""
    want = 3 * draft.config.target_hidden_size
    if np.ndim(features) == 0 or np.shape(features)[-1] != want:
        raise ValueError(f"features: shape {shape_of(features)}, expected [..., 3 * target_hidden_size = {want}]")
    x = jnp.asarray(features).astype(draft.dtype)
    if draft.input_norm is not None:
        x = draft.input_norm(x)
    if draft.fc_norm is not None:
        x = jnp.concatenate([n(p) for n, p in zip(draft.fc_norm, jnp.split(x, 3, axis=-1))], axis=-1)
    return x @ draft.fc[...]


def layer_inputs(draft: Eagle3, tokens, g, positions, ctx: parallel.RunContext = parallel.ONE_DEVICE):
    """The layer up to attention: tokens int32 [B, T], g [B, T, H], positions [B, T] ->
    (q [B, T, Hq, D], k, v [B, T, Hkv, D] with RoPE applied, residual [B, T, H]). ctx: the run
    context (the target's embedding, when borrowed, is split over its mesh)."""
    c = draft.config
    B, T = tokens.shape
    Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    g = g.astype(draft.dtype)
    gn = draft.hidden_norm(g)
    residual = gn if c.norm_before_residual else g
    table = draft.embed[...]  # the target's (split over "model" on a mesh) unless own_embed
    e = table[tokens] if draft.config.own_embed else parallel.vocab_rows(ctx, table, tokens)
    x = jnp.concatenate([draft.input_layernorm(e), gn], axis=-1)
    inv_freq, scale = rope.inv_freq_and_scale(c.rope, D, c.max_position_embeddings)
    cos, sin = rope.cos_sin(positions, inv_freq, scale)
    q, k, v = qkv_rope(x @ draft.wqkv[...], None, cos, sin, Hq, Hkv, D)
    return q, k, v, residual


def layer_outputs(draft: Eagle3, residual, o):
    """The layer after attention: residual [B, T, H], attention output o [B, T, Hq, D] -> h [B, T, H] un-normed."""
    B, T = o.shape[:2]
    h = residual + o.reshape(B, T, -1) @ draft.wo[...]
    y = draft.post_attention_layernorm(h)
    return h + (jax.nn.silu(y @ draft.gate[...]) * (y @ draft.up[...])) @ draft.down[...]


def layer(draft: Eagle3, tokens, g, positions, lengths, mask, cache: kvc.KVCache | None, *, n_write=None,
          ctx: parallel.RunContext = parallel.ONE_DEVICE):
    """The decoder layer. tokens int32 [B, T] (x_{t+1}), g [B, T, H] (fc(f_t) or the previous step's
    h), positions [B, T], lengths [B] committed draft-cache prefix (new K/V written at positions
    lengths .. lengths + T - 1), mask packed [B, T, ceil(T/32)] or None (causal). n_write int32 [B]
    (prefill chunks) or None: with a windowed draft's ring cache, only the first n_write[b] tokens are
    written, after attention has read the ring; without it T <= cache.max_step_tokens. ctx: the run
    context (mesh, kernels; default one device). Returns (h [B, T, H] un-normed, cache)."""
    c = draft.config
    tokens = check_tokens(tokens, c.vocab_size)
    B, T = tokens.shape
    if shape_of(g) != [B, T, c.hidden_size]:
        raise ValueError(f"layer: g shape {shape_of(g)}, expected [B, T, hidden_size] = {[B, T, c.hidden_size]}")
    check_step_inputs(tokens, positions, lengths, mask, None if cache is None else cache.batch,
                      None if cache is None else cache.max_len, "layer")
    ring = cache is not None and cache.rings[0]
    if ring and n_write is None:
        check_step_tokens(T, cache, "layer")
    positions, lengths = jnp.asarray(positions, jnp.int32), jnp.asarray(lengths, jnp.int32)
    Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q, k, v, residual = layer_inputs(draft, tokens, g, positions, ctx)
    if cache is None:
        kc = vc = jnp.zeros((B, Hkv, 0, D), k.dtype)
    else:
        kc, vc = cache.k[0], cache.v[0]
    sinks = jnp.full((Hq,), NO_SINK, F32)
    attend = functools.partial(kvc.attend, ring=ring, window=c.sliding_window, scale=D ** -0.5, policy=ctx.kernels)
    # under ctx's mesh each device attends with its rows; the draft's heads are not split
    rows = parallel.BATCH
    o, kc, vc = ctx.local(attend, (rows,) * 8 + (P(), rows), (rows, rows, rows))(
        q, k, v, kc, vc, lengths, positions, mask, sinks, n_write)
    if cache is not None:
        cache = cache.replace(k=(kc,), v=(vc,))
    return layer_outputs(draft, residual, o), cache


def logits(draft: Eagle3, h, ctx: parallel.RunContext = parallel.ONE_DEVICE):
    """h [..., H] -> float32 draft-vocab logits [..., Vd] (a borrowed target head: split over ctx's mesh)."""
    x = draft.norm(h) if draft.config.norm_output else h
    if not draft.config.own_lm_head:  # the target's head, split over "model" on a mesh
        return parallel.vocab_logits(ctx, x, draft.lm_head[...])
    return jnp.einsum("...h,vh->...v", x, draft.lm_head[...], preferred_element_type=F32)


def to_target_ids(draft: Eagle3, draft_ids):
    """Draft-vocab indices -> target token ids (i + d2t[i])."""
    return draft_ids + draft.d2t[...][draft_ids]


def top_k(draft: Eagle3, draft_logits, k: int):
    """Top-k in draft space, then mapped: (log-probs f32 [..., k], target ids int32 [..., k]);
    k in [1, draft vocabulary size]."""
    if int_arg("top_k: k", k, 1) > draft_logits.shape[-1]:
        raise ValueError(f"top_k: k={k} > {draft_logits.shape[-1]}, the draft vocabulary")
    logp = jax.nn.log_softmax(draft_logits, axis=-1)
    vals, idx = jax.lax.top_k(logp, k)
    return vals, to_target_ids(draft, idx).astype(jnp.int32)


def forward(draft: Eagle3, next_tokens, features):
    """One parallel causal pass from position 0: next_tokens int32 [B, T] (x_{t+1}), features
    [B, T, 3 * Ht] (f_t) -> draft logits float32 [B, T, Vd]."""
    next_tokens = check_tokens(next_tokens, draft.config.vocab_size, "next_tokens")
    B, T = next_tokens.shape
    want = [B, T, 3 * draft.config.target_hidden_size]
    if shape_of(features) != want:
        raise ValueError(f"features: shape {shape_of(features)}, expected [B, T, 3 * target_hidden_size] = {want}")
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h, _ = layer(draft, next_tokens, project(draft, features), positions, jnp.zeros((B,), jnp.int32), None, None)
    return logits(draft, h)


def prefill(draft: Eagle3, cache: kvc.KVCache, next_tokens, features, prompt_lengths, *, chunk: int,
            ctx: parallel.RunContext = parallel.ONE_DEVICE):
    """Chunked draft prefill over (x_{t+1}, f_t) for t below each prompt's length: next_tokens int32
    [B, P] (the prompt shifted left, the first generated token at position length - 1), features
    [B, P, 3 * Ht] (the target's, from its prefill), P a multiple of `chunk`.
    ctx: the run context (default one device). Returns (cache, un-normed h at each prompt's last
    position [B, H]: the first draft root's state)."""
    B, P = next_tokens.shape
    last = prompt_lengths - 1

    def body(start, carry):
        cache, h_last = carry
        toks = jax.lax.dynamic_slice_in_dim(next_tokens, start, chunk, axis=1)
        f = jax.lax.dynamic_slice_in_dim(features, start, chunk, axis=1)
        pos = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
        h, cache = layer(draft, toks, project(draft, f), pos, jnp.full((B,), start, jnp.int32), None, cache,
                         n_write=jnp.clip(prompt_lengths - start, 0, chunk), ctx=ctx)
        return cache, keep_position(h, h_last, last, start)

    return over_chunks(body, prompt_lengths, chunk, (cache, jnp.zeros((B, draft.config.hidden_size), draft.dtype)))


def init_cache(draft: Eagle3, batch: int, max_len: int, *, max_step_tokens: int = kvc.DEFAULT_STEP_TOKENS
               ) -> kvc.KVCache:
    """Zeroed K/V of the draft layer for positions below max_len: [batch, Hkv, max_len, D], or with a
    sliding window a ring of min(max_len, window + max_step_tokens) slots (models/kv_cache.py)."""
    c = draft.config
    batch, max_len = int_arg("init_cache: batch", batch, 1), int_arg("init_cache: max_len", max_len, 1)
    max_step_tokens = int_arg("init_cache: max_step_tokens", max_step_tokens, 1)
    return kvc.init((c.sliding_window,), batch, max_len, c.num_key_value_heads, c.head_dim, draft.dtype,
                    max_step_tokens=max_step_tokens)


def pair_dtype(target=None):
    """The dtype a draft takes by default: its target's (the dtype of its embedding where the object
    has no `dtype`), bfloat16 without a target. A pair runs in one dtype."""
    if target is None:
        return jnp.bfloat16
    dtype = getattr(target, "dtype", None)
    return jnp.dtype(dtype if dtype is not None else target.embed.get_value().dtype)


def random_eagle3(config: Eagle3Config, seed: int = 0, dtype=None, *, target=None):
    """Random draft (d2t maps draft index i to target id i), on the default device. Without its own
    embedding or head it shares the given target's. dtype None: `pair_dtype(target)`."""
    dtype = pair_dtype(target) if dtype is None else dtype
    if (not config.own_embed or not config.own_lm_head) and target is None:
        raise ValueError("random_eagle3: the config shares the target's embedding or head: pass target=")
    return Eagle3(config, dtype=dtype, rngs=nnx.Rngs(seed),
                  embed=None if config.own_embed else target.embed,
                  lm_head=None if config.own_lm_head else target.lm_head)
