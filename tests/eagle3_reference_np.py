"""An independent float64 numpy EAGLE-3 draft (docs/reference.md 5) and tiny random draft checkpoints.

Depends only on numpy (+ hf_fixtures' safetensors writer); it reads the HF key layout directly, so
it checks the converter and the JAX model at once.

Math, per position t (tokens x_{t+1}, features f_t = concat of 3 target hidden states):
  x = f_t;  norm_before_fc: x = RMSNorm(x; input_norm)  (one norm over the 3*Ht concat)
            fc_norm:        x = concat(RMSNorm(x_i; fc_norm.i) for the 3 chunks)
  g = fc(x)                                   (or a given g: the previous draft step's h)
  hn = hidden_norm(g); en = input_layernorm(embed(x_{t+1}))
  a = attn(concat(en, hn))                    (q/k/v read 2H, RoPE, GQA, causal [+ window / mask])
  h = (hn if norm_before_residual else g) + a;  h = h + mlp(post_attention_layernorm(h))
  logits = lm_head(norm(h)) (lm_head(h) when norm_output is false), over the draft vocab;
  draft id i is target id i + d2t[i].

Public API
----------
- ``tiny_draft_config(**kw) -> dict``: a SpecForge-style ``LlamaForCausalLMEagle3`` config.json dict.
- ``random_draft_weights(config, seed, prefix="midlayer.", embed=True, lm_head=True) -> dict``
- ``write_draft_checkpoint(path, config, weights, dtype=np.float32, key_prefix="")``
- ``write_random_draft(path, seed, prefix=, embed=, lm_head=, key_prefix=, dtype=, **config_kw) -> (config, weights)``
- ``draft_flags(config) -> dict`` the four variant flags as a reader sees them.
- ``rope_inv_freq(config) -> (inv_freq [D/2] float64, scale)``
- ``reference_forward(config, weights, next_tokens, features, *, g=None, embed=None, lm_head=None,
  positions=None, visible=None, sliding_window=None) -> (logits [B,T,Vd], h [B,T,H])``
- ``to_target_ids(weights, draft_ids)``
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np
from hf_fixtures import write_safetensors
from reference_np import yarn_inv_freq_and_scale

FLAGS = {"norm_before_fc": False, "fc_norm": False, "norm_output": True, "norm_before_residual": False}


# --------------------------------------------------------------------------------------------
# config and checkpoint
# --------------------------------------------------------------------------------------------
def tiny_draft_config(*, hidden_size=48, target_hidden_size=64, intermediate_size=80, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, draft_vocab_size=40,
                      aux_layer_ids=(0, 1, 2), rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=256, rms_norm_eps=1e-5, flags_in_eagle_config=False,
                      **flags) -> dict:
    """A config.json dict as SpecForge writes `LlamaForCausalLMEagle3` drafts. `draft_vocab_size=None`
    is the nvidia layout (no lm_head: the target's head). Variant flags (norm_before_fc, fc_norm,
    norm_output, norm_before_residual) go to the top level, or into `eagle_config` (nvidia v3)."""
    unknown = set(flags) - set(FLAGS)
    if unknown:
        raise TypeError(f"unknown flags {sorted(unknown)}")
    eagle = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True}
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim, "vocab_size": vocab_size, "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target_hidden_size, "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta,
        "rope_scaling": rope_scaling, "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu", "tie_word_embeddings": False, "pretraining_tp": 1, "torch_dtype": "float32",
        "eagle_config": eagle,
    }
    (eagle if flags_in_eagle_config else cfg).update(flags)
    return cfg


def draft_flags(config: dict) -> dict:
    eagle = config.get("eagle_config") or {}
    return {k: bool(config.get(k, eagle.get(k, d))) for k, d in FLAGS.items()}


def random_draft_weights(config: dict, seed: int = 0, *, prefix: str = "midlayer.", embed: bool = True,
                         lm_head: bool = True) -> dict:
    """float32 weights in HF layout ([out, in]); norm scales 1 + 0.2 N(0, 1) so every norm matters.
    Draft vocab (when `draft_vocab_size` is set): a random sorted subset of the target vocab, as
    `d2t` int64 offsets and the `t2d` bool mask. Variant tensors follow the config's flags."""
    rng = np.random.default_rng(seed)
    H, Ht, I = config["hidden_size"], config.get("target_hidden_size") or config["hidden_size"], \
        config["intermediate_size"]
    Hq, Hkv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    V, Vd = config["vocab_size"], config.get("draft_vocab_size")
    f = draft_flags(config)

    def lin(o, i):
        return (rng.standard_normal((o, i)) * i ** -0.5).astype(np.float32)

    def nrm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    w = {"fc.weight": lin(H, 3 * Ht), "norm.weight": nrm(H)}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"{prefix}{n}.weight"] = nrm(H)
    w[f"{prefix}self_attn.q_proj.weight"] = lin(Hq * D, 2 * H) * 2  # sharp attention: RoPE and masks matter
    w[f"{prefix}self_attn.k_proj.weight"] = lin(Hkv * D, 2 * H) * 2
    w[f"{prefix}self_attn.v_proj.weight"] = lin(Hkv * D, 2 * H)
    w[f"{prefix}self_attn.o_proj.weight"] = lin(H, Hq * D)
    w[f"{prefix}mlp.gate_proj.weight"] = lin(I, H)
    w[f"{prefix}mlp.up_proj.weight"] = lin(I, H)
    w[f"{prefix}mlp.down_proj.weight"] = lin(H, I)
    if f["norm_before_fc"]:
        w["input_norm.weight"] = nrm(3 * Ht)
    if f["fc_norm"]:
        for i in range(3):
            w[f"fc_norm.{i}.weight"] = nrm(Ht)
    if embed:
        w["embed_tokens.weight"] = rng.standard_normal((V, H)).astype(np.float32)
    if lm_head:
        rows = Vd if Vd is not None else V
        w["lm_head.weight"] = (rng.standard_normal((rows, H)) * 2.0 * H ** -0.5).astype(np.float32)
        if Vd is not None:
            ids = np.sort(rng.choice(V, Vd, replace=False))
            w["d2t"] = (ids - np.arange(Vd)).astype(np.int64)
            t2d = np.zeros(V, bool)
            t2d[ids] = True
            w["t2d"] = t2d
    return w


def write_draft_checkpoint(path, config: dict, weights: dict, dtype=np.float32, key_prefix: str = "") -> None:
    """config.json + model.safetensors; float tensors stored as `dtype` (d2t / t2d as given); every
    key under `key_prefix` (e.g. "model.")."""
    os.makedirs(path, exist_ok=True)
    out = {key_prefix + k: (v.astype(dtype) if np.issubdtype(v.dtype, np.floating) else v)
           for k, v in weights.items()}
    write_safetensors(os.path.join(path, "model.safetensors"), out, {"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)


def write_random_draft(path, seed: int = 0, *, prefix: str = "midlayer.", embed: bool = True, lm_head: bool = True,
                       key_prefix: str = "", dtype=np.float32, **config_kw) -> tuple:
    """tiny_draft_config(**config_kw) + random_draft_weights + write_draft_checkpoint in one call.
    `draft_vocab_size=None, lm_head=False` is the nvidia layout. Returns (config, weights)."""
    config = tiny_draft_config(**config_kw)
    weights = random_draft_weights(config, seed, prefix=prefix, embed=embed, lm_head=lm_head)
    if dtype != np.float32:
        weights = bf16_round(weights)
    write_draft_checkpoint(path, config, weights, dtype, key_prefix)
    return config, weights


def bf16_round(weights: dict) -> dict:
    """Float tensors rounded through bfloat16 (back to float32), so a bf16 checkpoint loses nothing."""
    return {k: (v.astype(ml_dtypes.bfloat16).astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v)
            for k, v in weights.items()}


# --------------------------------------------------------------------------------------------
# math
# --------------------------------------------------------------------------------------------
def rope_inv_freq(config: dict) -> tuple:
    """(inv_freq float64 [D/2], cos/sin scale) per HF's rope init functions: default, yarn (truncate
    defaults to True as in HF; attention factor 0.1 ln(factor) + 1), llama3."""
    D = config["head_dim"]
    theta = float(config.get("rope_theta", 10000.0))
    rs = config.get("rope_scaling") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    base = 1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    if kind == "default":
        return base, 1.0
    factor = float(rs["factor"])
    orig = float(rs["original_max_position_embeddings"])
    if kind == "llama3":
        lo, hi = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        wavelen = 2 * math.pi / base
        out = np.empty_like(base)
        for i, (b, wl) in enumerate(zip(base, wavelen)):
            if wl < orig / hi:
                out[i] = b
            elif wl > orig / lo:
                out[i] = b / factor
            else:
                s = (orig / wl - lo) / (hi - lo)
                out[i] = (1 - s) * b / factor + s * b
        return out, 1.0
    assert kind == "yarn", kind
    return yarn_inv_freq_and_scale({**config, "rope_theta": theta})  # the GPT-OSS reference's YaRN


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, inv, scale):
    """x [B, T, h, D], pos [B, T]: half-split (NeoX) rotation."""
    ang = pos[..., None].astype(np.float64) * inv  # [B, T, D/2]
    c, s = (np.cos(ang) * scale)[:, :, None], (np.sin(ang) * scale)[:, :, None]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _strip(weights: dict) -> tuple:
    w = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in weights.items()}
    p = "midlayer." if "midlayer.self_attn.q_proj.weight" in w else "layers.0."
    return {k: (np.asarray(v, np.float64) if np.issubdtype(np.asarray(v).dtype, np.floating) else np.asarray(v))
            for k, v in w.items()}, p


def reference_forward(config: dict, weights: dict, next_tokens, features=None, *, g=None, embed=None, lm_head=None,
                      positions=None, visible=None, sliding_window=None) -> tuple:
    """float64 draft pass. next_tokens int [B, T]; features [B, T, 3*Ht] (or g [B, T, H] given directly);
    embed [V, H] / lm_head [Vd, H] override or stand in for missing tensors (the target's);
    positions [B, T] (default 0..T-1); visible bool [B, T, T] query i sees key j (default causal);
    sliding_window W: key visible only if pos_q - W < pos_k. Returns (logits [B, T, Vd], h [B, T, H])."""
    w, p = _strip(weights)
    f = draft_flags(config)
    eps = float(config.get("rms_norm_eps", 1e-6))
    Hq, Hkv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    tok = np.asarray(next_tokens)
    B, T = tok.shape
    if g is None:
        x = np.asarray(features, np.float64)
        if f["norm_before_fc"]:
            x = _rms(x, w["input_norm.weight"], eps)
        if f["fc_norm"]:
            x = np.concatenate([_rms(c, w[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(np.split(x, 3, -1))], -1)
        g = x @ w["fc.weight"].T
    g = np.asarray(g, np.float64)
    E = np.asarray(embed, np.float64) if embed is not None else w["embed_tokens.weight"]
    hn = _rms(g, w[p + "hidden_norm.weight"], eps)
    en = _rms(E[tok], w[p + "input_layernorm.weight"], eps)
    xin = np.concatenate([en, hn], -1)
    q = (xin @ w[p + "self_attn.q_proj.weight"].T).reshape(B, T, Hq, D)
    k = (xin @ w[p + "self_attn.k_proj.weight"].T).reshape(B, T, Hkv, D)
    v = (xin @ w[p + "self_attn.v_proj.weight"].T).reshape(B, T, Hkv, D)
    pos = np.broadcast_to(np.arange(T), (B, T)) if positions is None else np.asarray(positions)
    inv, scale = rope_inv_freq(config)
    q, k = _rope(q, pos, inv, scale), _rope(k, pos, inv, scale)
    see = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T)) if visible is None else np.asarray(visible)
    if sliding_window is not None:
        see = see & (pos[:, None, :] > pos[:, :, None] - sliding_window)
    rep = Hq // Hkv
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)  # query head h reads kv head h // rep
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    s = np.where(see[:, None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", s, v).reshape(B, T, Hq * D)
    h = (hn if f["norm_before_residual"] else g) + o @ w[p + "self_attn.o_proj.weight"].T
    y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
    h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    head = np.asarray(lm_head, np.float64) if lm_head is not None else w["lm_head.weight"]
    out = _rms(h, w["norm.weight"], eps) if f["norm_output"] else h
    return out @ head.T, h


def to_target_ids(weights: dict, draft_ids):
    """Draft-vocab indices -> target ids (identity without d2t)."""
    ids = np.asarray(draft_ids)
    return ids if "d2t" not in weights else ids + np.asarray(weights["d2t"])[ids]
