"""Model configurations: frozen dataclasses, presets and the Hugging Face `config.json` reader.

`GptOssConfig.preset("gpt-oss-120b")` gives the published architecture (docs/reference.md 1);
`GptOssConfig.from_hf(path_or_dict)` reads a checkpoint's `config.json`. Every invalid value
raises `ValueError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"
EXPERT_FORMATS = ("mxfp4", "dense")
MXFP4_BLOCK = 32


def _positive(name, v):
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise ValueError(f"{name}: must be a positive number, got {v!r}")


def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {v!r}")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies: `rope_type` "default" (plain), "yarn" (HF `_compute_yarn_parameters`) or
    "llama3" (HF `_compute_llama3_parameters`, used by some EAGLE-3 drafts).

    For YaRN, `factor=None` means max_position_embeddings / original_max_position_embeddings,
    `attention_factor=None` means 0.1 * ln(factor) + 1 (the concentration, on cos and sin).
    """

    theta: float = 150000.0
    rope_type: str = "yarn"
    factor: float | None = 32.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = False
    attention_factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self):
        if self.rope_type not in ("default", "yarn", "llama3"):
            raise ValueError(f"rope_scaling.rope_type: unsupported {self.rope_type!r} "
                             "(expected 'default', 'yarn' or 'llama3')")
        _positive("rope_theta", self.theta)
        if self.rope_type == "yarn":
            if self.factor is not None:
                _positive("rope_scaling.factor", self.factor)
            _positive("rope_scaling.beta_fast", self.beta_fast)
            _positive("rope_scaling.beta_slow", self.beta_slow)
            _positive("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings)


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """GPT-OSS architecture. Sizes in elements; `layer_types[i]` is 'sliding_attention' or 'full_attention'."""

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 131072
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rms_norm_eps: float = 1e-5
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = (200002, 199999, 200012)
    pad_token_id: int | None = 199999
    bos_token_id: int | None = 199998
    experts_format: str = "mxfp4"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
                     "sliding_window", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types: has {len(self.layer_types)} entries, expected num_hidden_layers="
                             f"{self.num_hidden_layers}")
        bad = [t for t in self.layer_types if t not in (SLIDING, FULL)]
        if bad:
            raise ValueError(f"layer_types: unknown type {bad[0]!r} (expected {SLIDING!r} or {FULL!r})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads: {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok: {self.num_experts_per_tok} > num_local_experts="
                             f"{self.num_local_experts}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: must be even for rotary embeddings, got {self.head_dim}")
        if self.experts_format not in EXPERT_FORMATS:
            raise ValueError(f"experts_format: {self.experts_format!r} not in {EXPERT_FORMATS}")
        if self.experts_format == "mxfp4":
            for name in ("hidden_size", "intermediate_size"):
                if getattr(self, name) % MXFP4_BLOCK:
                    raise ValueError(f"{name}: {getattr(self, name)} must be a multiple of {MXFP4_BLOCK} "
                                     "for MXFP4 experts")
        _positive("swiglu_limit", self.swiglu_limit)
        _positive("rms_norm_eps", self.rms_norm_eps)
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings: GPT-OSS has an untied lm_head; tied embeddings are not supported")
        for name, ids in (("eos_token_ids", self.eos_token_ids),):
            for i in ids:
                if not 0 <= i < self.vocab_size:
                    raise ValueError(f"{name}: id {i} outside the vocabulary [0, {self.vocab_size})")

    # -- derived -----------------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def window(self, layer: int) -> int | None:
        """Sliding window (keys per query, own key included) of `layer`, None on full-attention layers."""
        return self.sliding_window if self.is_sliding(layer) else None

    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        """EAGLE-3's default feature layers: (1, L//2 - 1, L - 4) (block outputs)."""
        n = self.num_hidden_layers
        return (min(1, n - 1), max(n // 2 - 1, 0), max(n - 4, 0))

    def replace(self, **kw) -> GptOssConfig:
        return dataclasses.replace(self, **kw)

    # -- presets and HF ------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> GptOssConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf(cls, config_json: str | os.PathLike | dict, experts_format: str | None = None) -> GptOssConfig:
        """Reads an HF GPT-OSS `config.json` (a path to the file or its folder, or the parsed dict).

        Accepts both `rope_scaling` and `rope_parameters` spellings. `experts_format` defaults to
        "mxfp4" when `quantization_config.quant_method == "mxfp4"`, else "dense".
        """
        cfg, where = _read_json(config_json)
        mt = cfg.get("model_type", "gpt_oss")
        if mt != "gpt_oss":
            raise ValueError(f"{where}: model_type is {mt!r}, expected 'gpt_oss'")
        quant = cfg.get("quantization_config")
        if quant is not None:
            method = quant.get("quant_method")
            if method != "mxfp4":
                raise ValueError(f"{where}: quantization_config.quant_method {method!r} is not supported "
                                 "(expected 'mxfp4' or no quantization_config)")
        if experts_format is None:
            experts_format = "mxfp4" if quant is not None else "dense"
        eos = cfg.get("eos_token_id", ())
        eos = (eos,) if isinstance(eos, int) else tuple(eos or ())
        if "rope_scaling" not in cfg and "rope_parameters" not in cfg:  # absent: transformers' GptOssConfig default
            cfg = {**cfg, "rope_scaling": dict(GPT_OSS_HF_ROPE_SCALING)}
        kw: dict[str, Any] = dict(
            rope=rope_from_hf(cfg, where), experts_format=experts_format, eos_token_ids=eos,
            pad_token_id=cfg.get("pad_token_id"), bos_token_id=cfg.get("bos_token_id"),
            layer_types=tuple(cfg.get("layer_types") or ()),
        )
        if "sliding_window" in cfg and cfg["sliding_window"] is None:
            raise ValueError(f"{where}: sliding_window is null; GPT-OSS needs a window for its sliding layers")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "num_local_experts",
                     "num_experts_per_tok", "sliding_window", "max_position_embeddings", "swiglu_limit",
                     "swiglu_alpha", "rms_norm_eps", "attention_bias", "tie_word_embeddings"):
            if name in cfg and cfg[name] is not None:
                kw[name] = cfg[name]
        if "num_experts" in cfg and "num_local_experts" not in cfg:
            kw["num_local_experts"] = cfg["num_experts"]
        # head_dim absent: transformers' GptOssConfig default (64), not hidden / heads (2880 / 64 = 45)
        kw["head_dim"] = cfg["head_dim"] if cfg.get("head_dim") is not None else GPT_OSS_HF_HEAD_DIM
        try:
            return cls(**kw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def to_hf(self) -> dict:
        """The HF `config.json` dict (MXFP4 quantization_config when experts are packed)."""
        r = self.rope
        out = dict(
            architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            num_local_experts=self.num_local_experts, num_experts_per_tok=self.num_experts_per_tok,
            sliding_window=self.sliding_window, layer_types=list(self.layer_types), rope_theta=r.theta,
            rope_scaling=rope_to_hf(r), max_position_embeddings=self.max_position_embeddings,
            swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha, rms_norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias, tie_word_embeddings=False,
            eos_token_id=list(self.eos_token_ids), pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id, torch_dtype="bfloat16",
        )
        if self.experts_format == "mxfp4":
            out["quantization_config"] = {
                "quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}
        return out


# transformers' GptOssConfig defaults for fields a config.json may leave out (an explicit
# "rope_scaling": null still means plain RoPE)
GPT_OSS_HF_HEAD_DIM = 64
GPT_OSS_HF_ROPE_SCALING = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                               original_max_position_embeddings=4096)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def default_layer_types(n: int) -> tuple[str, ...]:
    """GPT-OSS pattern: even layers sliding, odd layers full."""
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(n))


def rope_to_hf(r: RopeConfig) -> dict | None:
    """The HF `rope_scaling` dict of `r` (None for plain RoPE; theta goes in `rope_theta`)."""
    if r.rope_type == "default":
        return None
    if r.rope_type == "llama3":
        return dict(rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
                    high_freq_factor=r.high_freq_factor,
                    original_max_position_embeddings=r.original_max_position_embeddings)
    out = dict(rope_type="yarn", factor=r.factor, beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate,
               original_max_position_embeddings=r.original_max_position_embeddings)
    if r.attention_factor is not None:
        out["attention_factor"] = r.attention_factor
    return out


def rope_from_hf(cfg: dict, where: str = "config") -> RopeConfig:
    """RopeConfig from either `rope_scaling` (+ top-level `rope_theta`) or `rope_parameters`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{where}: rope_scaling/rope_parameters must be a dict, got {type(params).__name__}")
    theta = params.get("rope_theta", cfg.get("rope_theta", 150000.0 if cfg.get("model_type") == "gpt_oss" else 10000.0))
    rtype = params.get("rope_type", params.get("type", "default" if not params else "yarn"))
    try:
        if rtype in ("default", None):
            return RopeConfig(theta=float(theta), rope_type="default")
        factor = params.get("factor")
        if rtype == "llama3":
            return RopeConfig(theta=float(theta), rope_type="llama3", factor=float(factor or 1.0),
                              low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                              high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                              original_max_position_embeddings=int(params.get("original_max_position_embeddings",
                                                                              8192)))
        orig = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        if orig is None:
            raise ValueError("rope_scaling.original_max_position_embeddings: missing")
        if factor is None:
            factor = cfg["max_position_embeddings"] / orig
        attention_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if attention_factor is None and mscale and mscale_all_dim:  # as transformers' YaRN parameters
            attention_factor = _yarn_mscale(float(factor), mscale) / _yarn_mscale(float(factor), mscale_all_dim)
        return RopeConfig(
            theta=float(theta), rope_type=rtype, factor=float(factor),
            beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
            original_max_position_embeddings=int(orig), truncate=bool(params.get("truncate", True)),
            attention_factor=attention_factor,
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _read_json(src) -> tuple[dict, str]:
    if isinstance(src, dict):
        return src, "config"
    path = os.fspath(src)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{path}: config.json not found (expected a folder with config.json and "
                             "*.safetensors files)")
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: config.json not found (no such file; expected a config.json or a checkpoint "
                         "folder holding one)")
    try:
        with open(path) as f:
            return json.load(f), path
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


AUX_CONVENTIONS = ("output", "input")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """EAGLE-3 draft (docs/reference.md 5): fc over 3 target features, one Llama decoder layer, a head.

    `feature_layers` holds the target hidden-state indices the draft reads, normalized:
    h[0] = embeddings, h[k + 1] = output of block k. `aux_layer_ids` / `aux_convention` keep the
    checkpoint's own spelling ("output": id k = output of block k, SGLang / TRT-LLM / SpecForge;
    "input": id k = input of layer k, vLLM / nvidia v3). `draft_vocab_size == vocab_size` with
    `own_lm_head=False` means the target's lm_head is the head. `sliding_window` (None = full)
    bounds the draft's attention for contexts longer than it was trained on.
    """

    hidden_size: int = 2880
    intermediate_size: int = 17280
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088
    draft_vocab_size: int = 32000
    target_hidden_size: int = 2880
    aux_layer_ids: tuple[int, ...] = (1, 17, 33)
    aux_convention: str = "output"
    target_num_layers: int = 36
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig(theta=10000.0, rope_type="default")
    max_position_embeddings: int = 131072
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = True
    norm_before_residual: bool = False
    own_embed: bool = True
    own_lm_head: bool = True
    sliding_window: int | None = None

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "draft_vocab_size", "target_hidden_size", "target_num_layers",
                     "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads: {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size: {self.draft_vocab_size} > vocab_size={self.vocab_size}")
        if not self.own_lm_head and self.draft_vocab_size != self.vocab_size:
            raise ValueError("draft_vocab_size: a draft without its own lm_head uses the target's, so "
                             f"draft_vocab_size must equal vocab_size={self.vocab_size}")
        if self.aux_convention not in AUX_CONVENTIONS:
            raise ValueError(f"aux_convention: {self.aux_convention!r} not in {AUX_CONVENTIONS}")
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids: EAGLE-3 reads 3 target layers, got {list(self.aux_layer_ids)}")
        hi = self.target_num_layers - (1 if self.aux_convention == "output" else 0)
        for k in self.aux_layer_ids:
            if not 0 <= k <= hi:
                raise ValueError(f"aux_layer_ids: {k} outside [0, {hi}] for a {self.target_num_layers}-layer target "
                                 f"({self.aux_convention} convention)")
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        _positive("rms_norm_eps", self.rms_norm_eps)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target hidden-state indices (h[0] = embeddings, h[k + 1] = output of block k)."""
        shift = 1 if self.aux_convention == "output" else 0
        return tuple(k + shift for k in self.aux_layer_ids)

    def replace(self, **kw) -> Eagle3Config:
        return dataclasses.replace(self, **kw)


PRESETS: dict[str, GptOssConfig] = {
    "gpt-oss-120b": GptOssConfig(),
    "gpt-oss-20b": GptOssConfig(num_hidden_layers=24, num_local_experts=32),
    # Tiny configs for tests: the full structure (sliding + full layers, > 4 experts, YaRN active
    # with factor = max_position / original, sinks, GQA) at a size that runs in milliseconds.
    "tiny": GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4, sliding_window=8,
        rope=RopeConfig(factor=4.0, original_max_position_embeddings=256),  # YaRN ramp inside (0, D/2)
        max_position_embeddings=1024, eos_token_ids=(1,), pad_token_id=0, bos_token_id=2),
}
PRESETS["tiny-dense"] = PRESETS["tiny"].replace(experts_format="dense")
