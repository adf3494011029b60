"""Independent float64 numpy reference of GPT-OSS (docs/reference.md section 2), for tests.

Works on the HF-key weights dict of ``hf_fixtures`` (MXFP4 ``_blocks``/``_scales`` or the dense
``gate_up_proj``/``down_proj`` layout) and an HF ``config.json`` dict.  No torch, no jax.

- ``reference_forward(config, weights, tokens) -> (logits [B,T,V], hidden_states)``: float64;
  ``hidden_states`` has L+1 entries ``[B,T,H]``: [0] the embedding output, [i+1] the output of
  block i (the last one BEFORE the final norm; HF's ``output_hidden_states[-1]`` is AFTER it).
- ``reference_greedy(config, weights, prompt, n) -> list[int]``: the n greedily chosen tokens.
- ``yarn_inv_freq_and_scale(config)``, ``rope_cos_sin(config, positions)``: the RoPE tables.

Semantics (tokens start at position 0):
- RMSNorm ``x / sqrt(mean(x^2) + eps) * w``.
- Attention: q/k/v/o with biases, GQA (query head h reads kv head ``h // (nq // nkv)``), scale
  ``head_dim**-0.5``, causal; sliding layers see key j from query i iff ``i - W < j <= i``;
  per-head sink logit S_h (unscaled) joins the softmax denominator with value 0.
- RoPE half-split (NeoX).  rope_type "yarn": HF ``_compute_yarn_parameters`` semantics:
  ``low/high = d*ln(orig/(beta*2pi))/(2 ln theta)`` (d = head_dim), floor/ceil only if
  ``truncate`` (GPT-OSS: false), clamped to ``[0, d-1]`` (a no-op for gpt-oss-120b and for the
  default tiny config), ramp over i in [0, d/2), concentration ``0.1 ln(factor) + 1`` (or
  ``attention_factor``) multiplies cos and sin.  rope_type "default": plain RoPE.
- MoE: router logits over all experts, top-k raw logits, softmax over those k; expert SwiGLU on
  interleaved gate (even) / linear (odd) rows, ``gate = min(gate, limit)``,
  ``lin = clip(lin, -limit, limit)``, ``gate * sigmoid(alpha*gate) * (lin + 1)``.
"""

from __future__ import annotations

import math

import numpy as np

try:  # package-style import (tests/ as a package) or plain sys.path import
    from .hf_fixtures import dequantize_mxfp4_np
except ImportError:  # pragma: no cover
    import os as _os
    import sys as _sys

    _sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
    from hf_fixtures import dequantize_mxfp4_np

SWIGLU_ALPHA_DEFAULT = 1.702


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------
def _rope_params(config: dict) -> dict:
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rp = dict(rp)
    rp.setdefault("rope_type", rp.get("type", "default"))
    rp.setdefault("rope_theta", config.get("rope_theta", 150000.0))
    return rp


def yarn_inv_freq_and_scale(config: dict) -> tuple:
    """``(inv_freq float64 [head_dim/2], attention scaling)`` for the config's RoPE."""
    rp = _rope_params(config)
    d = int(config["head_dim"])
    theta = float(rp["rope_theta"])
    freq = theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
    if rp["rope_type"] == "default":
        return 1.0 / freq, 1.0
    if rp["rope_type"] != "yarn":
        raise NotImplementedError(rp["rope_type"])
    factor = float(rp["factor"])
    orig = float(rp["original_max_position_embeddings"])
    beta_fast = float(rp.get("beta_fast") or 32.0)
    beta_slow = float(rp.get("beta_slow") or 1.0)

    def corr_dim(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    mask = 1.0 - ramp  # 1 -> keep original frequency (extrapolation)
    inv_freq = (1.0 / (factor * freq)) * (1.0 - mask) + (1.0 / freq) * mask
    att = rp.get("attention_factor")
    if att is None:
        mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")

        def get_mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        if mscale and mscale_all:
            att = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
        else:
            att = get_mscale(factor)
    return inv_freq, float(att)


def rope_cos_sin(config: dict, positions) -> tuple:
    """``(cos, sin)`` float64 ``[..., head_dim/2]``, concentration already applied to both."""
    inv_freq, scale = yarn_inv_freq_and_scale(config)
    ang = np.asarray(positions, dtype=np.float64)[..., None] * inv_freq
    return np.cos(ang) * scale, np.sin(ang) * scale


def _apply_rope(x, cos, sin):
    """x [B,T,h,d]; cos/sin [T, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------
def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _prepare(config: dict, weights: dict) -> dict:
    """float64 copies, experts as ``W1 [E, 2I, H]``, ``W2 [E, H, I]`` (torch [out, in])."""
    L = config["num_hidden_layers"]
    p = {"embed": _f64(weights["model.embed_tokens.weight"]),
         "norm": _f64(weights["model.norm.weight"]),
         "lm_head": _f64(weights["lm_head.weight"]),
         "layers": []}
    for i in range(L):
        k = f"model.layers.{i}."
        lw = {name: _f64(weights[k + key]) for name, key in [
            ("ln1", "input_layernorm.weight"), ("ln2", "post_attention_layernorm.weight"),
            ("wq", "self_attn.q_proj.weight"), ("bq", "self_attn.q_proj.bias"),
            ("wk", "self_attn.k_proj.weight"), ("bk", "self_attn.k_proj.bias"),
            ("wv", "self_attn.v_proj.weight"), ("bv", "self_attn.v_proj.bias"),
            ("wo", "self_attn.o_proj.weight"), ("bo", "self_attn.o_proj.bias"),
            ("sinks", "self_attn.sinks"),
            ("wr", "mlp.router.weight"), ("br", "mlp.router.bias"),
            ("b1", "mlp.experts.gate_up_proj_bias"), ("b2", "mlp.experts.down_proj_bias")]}
        e = k + "mlp.experts."
        if e + "gate_up_proj_blocks" in weights:
            lw["w1"] = dequantize_mxfp4_np(weights[e + "gate_up_proj_blocks"], weights[e + "gate_up_proj_scales"])
            lw["w2"] = dequantize_mxfp4_np(weights[e + "down_proj_blocks"], weights[e + "down_proj_scales"])
        else:  # dense x @ W layout: gate_up_proj [E, H, 2I], down_proj [E, I, H]
            lw["w1"] = np.swapaxes(_f64(weights[e + "gate_up_proj"]), 1, 2)
            lw["w2"] = np.swapaxes(_f64(weights[e + "down_proj"]), 1, 2)
        p["layers"].append(lw)
    return p


def _attention(config, lw, x, cos, sin, sliding):
    B, T, _ = x.shape
    nq, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    q = (x @ lw["wq"].T + lw["bq"]).reshape(B, T, nq, hd)
    k = (x @ lw["wk"].T + lw["bk"]).reshape(B, T, nkv, hd)
    v = (x @ lw["wv"].T + lw["bv"]).reshape(B, T, nkv, hd)
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    kv_of_q = np.arange(nq) // (nq // nkv)
    k, v = k[:, :, kv_of_q], v[:, :, kv_of_q]  # [B,T,nq,hd]
    logits = np.einsum("bihd,bjhd->bhij", q, k) * (hd ** -0.5)
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    visible = j <= i
    if sliding:
        visible &= j > i - int(config["sliding_window"])
    logits = np.where(visible[None, None], logits, -np.inf)
    s = lw["sinks"][None, :, None, None]  # [1,nq,1,1]
    m = np.maximum(logits.max(-1, keepdims=True), s)
    e = np.exp(logits - m)
    probs = e / (e.sum(-1, keepdims=True) + np.exp(s - m))
    out = np.einsum("bhij,bjhd->bihd", probs, v).reshape(B, T, nq * hd)
    return out @ lw["wo"].T + lw["bo"]


def _moe(config, lw, x, router_logits=None):
    B, T, H = x.shape
    xf = x.reshape(-1, H)
    kk = config["num_experts_per_tok"]
    limit = float(config.get("swiglu_limit", 7.0))
    alpha = float(config.get("swiglu_alpha", SWIGLU_ALPHA_DEFAULT))
    r = xf @ lw["wr"].T + lw["br"]  # [N,E]
    if router_logits is not None:
        router_logits.append(r.reshape(B, T, -1))
    top = np.argsort(-r, axis=-1, kind="stable")[:, :kk]  # sorted descending
    top_val = np.take_along_axis(r, top, axis=-1)
    w = np.exp(top_val - top_val.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    out = np.zeros_like(xf)
    for e in np.unique(top):
        tok, slot = np.nonzero(top == e)
        h = xf[tok] @ lw["w1"][e].T + lw["b1"][e]  # [n, 2I]
        gate = np.minimum(h[:, 0::2], limit)
        lin = np.clip(h[:, 1::2], -limit, limit)
        act = gate * (1.0 / (1.0 + np.exp(-alpha * gate))) * (lin + 1.0)
        y = act @ lw["w2"][e].T + lw["b2"][e]
        np.add.at(out, tok, w[tok, slot][:, None] * y)
    return out.reshape(B, T, H)


def _forward(config, p, tokens, router_logits=None):
    tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    B, T = tokens.shape
    eps = float(config.get("rms_norm_eps", 1e-5))
    layer_types = config.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config["num_hidden_layers"])]
    cos, sin = rope_cos_sin(config, np.arange(T))
    x = p["embed"][tokens]
    hs = [x]
    for i, lw in enumerate(p["layers"]):
        sliding = layer_types[i] == "sliding_attention" and config.get("sliding_window") is not None
        x = x + _attention(config, lw, _rms_norm(x, lw["ln1"], eps), cos, sin, sliding)
        x = x + _moe(config, lw, _rms_norm(x, lw["ln2"], eps), router_logits)
        hs.append(x)
    logits = _rms_norm(x, p["norm"], eps) @ p["lm_head"].T
    return logits, hs


def reference_forward(config: dict, weights: dict, tokens, *, router_logits: list | None = None) -> tuple:
    """float64 GPT-OSS forward of ``tokens`` int ``[B, T]`` at positions ``0..T-1``.

    Returns ``(logits [B,T,V], hidden_states)`` with ``hidden_states`` a list of L+1 arrays
    ``[B,T,H]``: [0] = embedding output, [i+1] = output of block i (before the final norm).
    If ``router_logits`` is a list, the raw router logits ``[B,T,E]`` of each layer are appended.
    """
    return _forward(config, _prepare(config, weights), tokens, router_logits)


def final_norm(config: dict, weights: dict, h) -> np.ndarray:
    """The final RMSNorm (``model.norm``) applied to a hidden state, float64."""
    return _rms_norm(_f64(h), _f64(weights["model.norm.weight"]), float(config.get("rms_norm_eps", 1e-5)))


def reference_greedy(config: dict, weights: dict, prompt, n: int) -> list:
    """Greedy continuation: the ``n`` new token ids (prompt excluded), re-running the full
    forward over prompt + generated tokens at each step (no cache)."""
    p = _prepare(config, weights)
    seq = [int(t) for t in np.asarray(prompt).reshape(-1)]
    out = []
    for _ in range(n):
        logits, _ = _forward(config, p, np.asarray([seq]))
        nxt = int(np.argmax(logits[0, -1]))
        out.append(nxt)
        seq.append(nxt)
    return out
