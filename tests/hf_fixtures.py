"""Tiny random Hugging Face GPT-OSS checkpoints, for tests.

Depends only on numpy, ml_dtypes and safetensors (no torch, no eagle3_jax), so the JAX side can
be tested against checkpoints that have exactly the layout of the real ones
(``openai/gpt-oss-120b``'s config.json and safetensors keys; docs/architecture.md), just much smaller.

Public API
----------
- ``tiny_hf_config(**overrides) -> dict``: a ``config.json`` dict as HF ships it.
- ``random_hf_weights(config, seed, mxfp4=True, norm_dtype="float32") -> dict[str, np.ndarray]``
- ``dequantize_mxfp4_np(blocks, scales) -> np.ndarray`` (float64, ``[..., rows, G*32]``)
- ``dense_from_mxfp4(weights) -> dict`` and ``is_mxfp4(weights) -> bool``
- ``config_for_weights(config, weights) -> dict`` (quantization_config matching the layout)
- ``write_hf_checkpoint(path, config, weights, num_shards=1) -> list[str]``
- ``read_hf_checkpoint(path) -> (config, weights)`` and ``read_safetensors(file) -> dict``
"""

from __future__ import annotations

import copy
import json
import math
import os
import struct

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)

# E2M1 nibble -> value (OCP MX FP4).  Index 8 is -0.0.
FP4_LUT = np.array(
    [+0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float64,
)
# Root-mean-square of a uniformly random FP4 nibble's value: sqrt(68.5 / 8) ~= 2.93.
_FP4_RMS = math.sqrt(float(np.mean(FP4_LUT**2)))

MXFP4_BLOCK = 32  # values per shared scale
MXFP4_MODULES_TO_NOT_CONVERT = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


# --------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------
def tiny_hf_config(**overrides) -> dict:
    """A GPT-OSS ``config.json`` dict, in the form HF ships (``rope_scaling`` + ``rope_theta``).

    Defaults keep the structure of gpt-oss-120b at tiny size: 4 layers (even layers sliding),
    8 experts top-4, hidden 64, intermediate 64, 4 q heads / 2 kv heads / head_dim 16,
    vocab 128, sliding_window 8, YaRN factor 4 over original 256 (max_position_embeddings 1024).

    Why original 256 and not 32: with head_dim 16 and theta 150000 the YaRN correction range is
    ``low = 8*ln(orig/(beta_fast*2*pi))/ln(theta)``, ``high = 8*ln(orig/(beta_slow*2*pi))/ln(theta)``.
    For orig 32, low = -1.23 < 0, where HF clamps it to 0 (``max(low, 0)``) while OpenAI's
    reference asserts ``0 < low < high < head_dim/2 - 1`` and docs/reference.md 2 gives it unclamped: ambiguous.
    For orig 256: low = 0.162, high = 2.49, inside (0, 7): every implementation agrees, and the
    ramp still blends (ramp = 0, .36, .79, 1, 1, 1, 1, 1).  YaRN is static (it does not depend on
    the sequence length), so short test sequences still exercise it.

    ``overrides`` replace keys; ``num_hidden_layers`` also regenerates ``layer_types`` unless
    given; rope keys ``factor``/``original_max_position_embeddings`` may be given inside a
    ``rope_scaling`` override (missing keys keep their defaults) and ``max_position_embeddings``
    follows ``factor * original`` unless given.  ``quantization_config=None`` removes the key
    (the layout of a dequantized bf16 checkpoint).
    """
    overrides = dict(overrides)
    n_layers = int(overrides.get("num_hidden_layers", 4))
    rope = {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_type": "yarn",
        "truncate": False,
    }
    rope.update(overrides.pop("rope_scaling", None) or {})
    cfg = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": 125,
        "eos_token_id": 127,
        "experts_per_token": 4,  # legacy duplicate of num_experts_per_tok, present in the real file
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initial_context_length": 256,  # legacy duplicate of original_max_position_embeddings
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
        ],
        "max_position_embeddings": int(rope["factor"] * rope["original_max_position_embeddings"]),
        "model_type": "gpt_oss",
        "num_attention_heads": 4,
        "num_experts_per_tok": 4,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "output_router_logits": False,
        "pad_token_id": 126,
        "quantization_config": {
            "modules_to_not_convert": list(MXFP4_MODULES_TO_NOT_CONVERT),
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": rope,
        "rope_theta": 150000.0,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 8,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": 128,
    }
    cfg.update(overrides)
    if cfg.get("quantization_config") is None:
        cfg.pop("quantization_config", None)
    if "num_experts_per_tok" in overrides and "experts_per_token" not in overrides:
        cfg["experts_per_token"] = cfg["num_experts_per_tok"]
    if "initial_context_length" not in overrides:
        cfg["initial_context_length"] = cfg["rope_scaling"]["original_max_position_embeddings"]
    if len(cfg["layer_types"]) != cfg["num_hidden_layers"]:
        raise ValueError("layer_types must have num_hidden_layers entries")
    for k in ("hidden_size", "intermediate_size"):
        if cfg[k] % MXFP4_BLOCK:
            raise ValueError(f"{k} must be a multiple of {MXFP4_BLOCK} for MXFP4")
    return cfg


def config_for_weights(config: dict, weights: dict) -> dict:
    """Copy of ``config`` whose ``quantization_config`` matches the expert layout of ``weights``
    (present for MXFP4 ``_blocks``/``_scales``, absent for the dense bf16 layout)."""
    cfg = copy.deepcopy(config)
    if is_mxfp4(weights):
        cfg.setdefault(
            "quantization_config",
            {"modules_to_not_convert": list(MXFP4_MODULES_TO_NOT_CONVERT), "quant_method": "mxfp4"},
        )
    else:
        cfg.pop("quantization_config", None)
    return cfg


# --------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------
def dequantize_mxfp4_np(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Exact MXFP4 dequantization.

    ``blocks [..., rows, G, 16] uint8``, ``scales [..., rows, G] uint8`` ->
    ``float64 [..., rows, G*32]`` where element ``32*g + 2*b`` is the low nibble of
    ``blocks[..., g, b]`` and ``32*g + 2*b + 1`` the high nibble, each times ``2**(scale-127)``.
    Same orientation as the blocks (``[out, in]``); no transpose.
    """
    blocks = np.asarray(blocks)
    scales = np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise TypeError("blocks and scales must be uint8")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"bad shapes {blocks.shape} / {scales.shape}")
    lo = FP4_LUT[blocks & 0x0F]
    hi = FP4_LUT[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    vals = vals * np.exp2(scales.astype(np.float64) - 127.0)[..., None]
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK)


def is_mxfp4(weights: dict) -> bool:
    return any(k.endswith("gate_up_proj_blocks") for k in weights)


def dense_from_mxfp4(weights: dict) -> dict:
    """The dequantized (HF "BF16" variant) layout of the same weights, exactly.

    ``mlp.experts.gate_up_proj [E, H, 2I]`` and ``mlp.experts.down_proj [E, I, H]`` in ``x @ W``
    layout (transposed relative to the blocks), bf16 (every MXFP4 value is exactly
    representable in bf16 for the scale range used here: checked); ``_bias`` keys kept.
    """
    out = {}
    for k, v in weights.items():
        if k.endswith("_scales"):
            continue
        if k.endswith("_blocks"):
            base = k[: -len("_blocks")]
            w = dequantize_mxfp4_np(v, weights[base + "_scales"])  # [E, out, in]
            w = np.ascontiguousarray(np.swapaxes(w, -1, -2))  # [E, in, out]
            wb = w.astype(BF16)
            if not np.array_equal(wb.astype(np.float64), w):
                raise ValueError(f"{k}: dequantized values not exact in bf16")
            out[base] = wb
        else:
            out[k] = v
    return out


def _random_mxfp4(rng, n_exp, rows, cols, scale_center, scale_spread):
    """Random packed weights ``[E, rows, cols]`` (cols = contraction axis)."""
    g = cols // MXFP4_BLOCK
    blocks = rng.integers(0, 256, size=(n_exp, rows, g, MXFP4_BLOCK // 2), dtype=np.uint8)
    lo, hi = scale_spread
    scales = (scale_center + rng.integers(lo, hi + 1, size=(n_exp, rows, g))).astype(np.uint8)
    return blocks, scales


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------
def _bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).astype(BF16)


def random_hf_weights(config: dict, seed: int = 0, mxfp4: bool = True, norm_dtype: str = "float32") -> dict:
    """Random weights under the HF keys / shapes of docs/reference.md section 3 (torch ``[out, in]``).

    Float tensors are ``ml_dtypes.bfloat16`` except the RMSNorm scales (``norm_dtype``:
    "float32" or "bfloat16").  Magnitudes: linear weights std ~ 1/sqrt(fan_in); all biases and
    sinks random and nonzero; router rows with std 2/sqrt(H) so top-k is well separated.
    MXFP4 experts: random nibbles, scale bytes around ``127 - log2(2.93 * sqrt(fan_in))``
    (e.g. 122 for fan_in 64) with spread [-2, +2] (so some rows are 4x larger than typical
    (so that some gate/linear pre-activations exceed the swiglu clamp at 7).
    ``mxfp4=False`` returns ``dense_from_mxfp4`` of the same weights.
    """
    if norm_dtype not in ("float32", "bfloat16"):
        raise ValueError(norm_dtype)
    rng = np.random.default_rng(seed)
    H = config["hidden_size"]
    I = config["intermediate_size"]
    V = config["vocab_size"]
    E = config["num_local_experts"]
    nq = config["num_attention_heads"]
    nkv = config["num_key_value_heads"]
    hd = config["head_dim"]
    ndt = np.float32 if norm_dtype == "float32" else BF16

    def lin(out, inp, gain=1.0):
        return _bf16(rng.standard_normal((out, inp)) * gain / math.sqrt(inp))

    def vec(n, std, mean=0.0):
        return _bf16(mean + std * rng.standard_normal(n))

    def norm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32).astype(ndt)

    def scale_center(fan_in):
        return int(round(127 - math.log2(_FP4_RMS * math.sqrt(fan_in))))

    w = {}
    w["model.embed_tokens.weight"] = _bf16(rng.standard_normal((V, H)))
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        w[p + "self_attn.q_proj.weight"] = lin(nq * hd, H)
        w[p + "self_attn.q_proj.bias"] = vec(nq * hd, 0.3)
        w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, H)
        w[p + "self_attn.k_proj.bias"] = vec(nkv * hd, 0.3)
        w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, H)
        w[p + "self_attn.v_proj.bias"] = vec(nkv * hd, 0.3)
        w[p + "self_attn.o_proj.weight"] = lin(H, nq * hd)
        w[p + "self_attn.o_proj.bias"] = vec(H, 0.3)
        w[p + "self_attn.sinks"] = vec(nq, 1.0, mean=0.5)
        w[p + "mlp.router.weight"] = lin(E, H, gain=2.0)
        w[p + "mlp.router.bias"] = vec(E, 0.5)
        gb, gs = _random_mxfp4(rng, E, 2 * I, H, scale_center(H), (-2, 2))
        db, ds = _random_mxfp4(rng, E, H, I, scale_center(I), (-2, 2))
        w[p + "mlp.experts.gate_up_proj_blocks"] = gb
        w[p + "mlp.experts.gate_up_proj_scales"] = gs
        w[p + "mlp.experts.gate_up_proj_bias"] = _bf16(0.5 * rng.standard_normal((E, 2 * I)))
        w[p + "mlp.experts.down_proj_blocks"] = db
        w[p + "mlp.experts.down_proj_scales"] = ds
        w[p + "mlp.experts.down_proj_bias"] = _bf16(0.3 * rng.standard_normal((E, H)))
    w["model.norm.weight"] = norm(H)
    w["lm_head.weight"] = lin(V, H)
    return w if mxfp4 else dense_from_mxfp4(w)


def expected_shapes(config: dict, mxfp4: bool = True) -> dict:
    """``key -> shape`` for every tensor of a checkpoint of this config."""
    H, I, V, E = (config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_local_experts"))
    nq, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    s = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        s.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nq * hd, H),
            p + "self_attn.q_proj.bias": (nq * hd,),
            p + "self_attn.k_proj.weight": (nkv * hd, H),
            p + "self_attn.k_proj.bias": (nkv * hd,),
            p + "self_attn.v_proj.weight": (nkv * hd, H),
            p + "self_attn.v_proj.bias": (nkv * hd,),
            p + "self_attn.o_proj.weight": (H, nq * hd),
            p + "self_attn.o_proj.bias": (H,),
            p + "self_attn.sinks": (nq,),
            p + "mlp.router.weight": (E, H),
            p + "mlp.router.bias": (E,),
            p + "mlp.experts.gate_up_proj_bias": (E, 2 * I),
            p + "mlp.experts.down_proj_bias": (E, H),
        })
        if mxfp4:
            s.update({
                p + "mlp.experts.gate_up_proj_blocks": (E, 2 * I, H // 32, 16),
                p + "mlp.experts.gate_up_proj_scales": (E, 2 * I, H // 32),
                p + "mlp.experts.down_proj_blocks": (E, H, I // 32, 16),
                p + "mlp.experts.down_proj_scales": (E, H, I // 32),
            })
        else:
            s.update({
                p + "mlp.experts.gate_up_proj": (E, H, 2 * I),
                p + "mlp.experts.down_proj": (E, I, H),
            })
    return s


# --------------------------------------------------------------------------------------------
# safetensors I/O
# --------------------------------------------------------------------------------------------
_ST_DTYPES = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    BF16: "BF16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}
_ST_DTYPES_INV = {v: k for k, v in _ST_DTYPES.items()}


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """Write a .safetensors file (format: u64 LE header length, JSON header, raw LE bytes).

    Written by hand so that ``ml_dtypes.bfloat16`` -> "BF16" does not depend on the installed
    safetensors version (safetensors 0.8's numpy API also handles it).  Tensors are laid out in
    key order (safetensors' own writer orders by dtype alignment first, so the bytes differ, but
    both readers return identical tensors: checked in tests/test_reference.py).
    """
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    payload = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: unsupported dtype {a.dtype}")
        if a.dtype.byteorder == ">":
            a = a.byteswap().view(a.dtype.newbyteorder("<"))
        raw = a.tobytes()
        header[name] = {
            "dtype": _ST_DTYPES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        payload.append(raw)
        offset += len(raw)
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((-len(hb)) % 8)  # pad to 8-byte alignment, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for raw in payload:
            f.write(raw)


def read_safetensors(path: str) -> dict:
    """Read every tensor of a .safetensors file as numpy (BF16 -> ml_dtypes.bfloat16)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES_INV[info["dtype"]]
        s, e = info["data_offsets"]
        out[name] = np.frombuffer(data[base + s : base + e], dtype=dt).reshape(info["shape"]).copy()
    return out


def write_hf_checkpoint(path, config: dict, weights: dict, num_shards: int = 1,
                        match_quantization: bool = True) -> list:
    """Write ``config.json`` plus the weights to directory ``path`` (created if needed).

    ``num_shards == 1``: ``model.safetensors``.  Otherwise ``model-0000k-of-0000N.safetensors``
    (k = 1..N, tensors split in key order, layer-contiguous) and ``model.safetensors.index.json``
    ``{"metadata": {"total_size": bytes}, "weight_map": {key: file}}``.
    With ``match_quantization`` the config written gets ``config_for_weights`` (the mxfp4
    quantization_config only when the experts are packed).  Returns the files written.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = config_for_weights(config, weights) if match_quantization else config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    files = ["config.json"]
    meta = {"format": "pt"}
    if num_shards <= 1:
        write_safetensors(os.path.join(path, "model.safetensors"), weights, meta)
        return files + ["model.safetensors"]

    keys = sorted(weights, key=_checkpoint_sort_key)
    sizes = [np.asarray(weights[k]).nbytes for k in keys]
    total = sum(sizes)
    shards = [[] for _ in range(num_shards)]
    acc = 0
    for k, sz in zip(keys, sizes):
        idx = min(num_shards - 1, int(acc * num_shards / max(total, 1)))
        shards[idx].append(k)
        acc += sz
    # no empty shard files: move keys forward if needed
    for i in range(num_shards):
        if not shards[i]:
            donor = max(range(num_shards), key=lambda j: len(shards[j]))
            if len(shards[donor]) < 2:
                raise ValueError("more shards than tensors")
            shards[i].append(shards[donor].pop())
    weight_map = {}
    for i, ks in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        write_safetensors(os.path.join(path, name), {k: weights[k] for k in ks}, meta)
        files.append(name)
        for k in ks:
            weight_map[k] = name
    index = {"metadata": {"total_size": int(total)}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return files + ["model.safetensors.index.json"]


def _checkpoint_sort_key(key: str):
    parts = key.split(".")
    if key.startswith("model.embed_tokens"):
        return (0, 0, key)
    if len(parts) > 2 and parts[1] == "layers":
        return (1, int(parts[2]), key)
    return (2, 0, key)


def read_hf_checkpoint(path) -> tuple:
    """``(config dict, {key: numpy array})`` from a directory written by ``write_hf_checkpoint``
    (or any HF safetensors checkpoint that fits in memory)."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights = {}
    for fn in files:
        weights.update(read_safetensors(os.path.join(path, fn)))
    return cfg, weights
