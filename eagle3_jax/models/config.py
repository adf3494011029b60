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
        "mxfp4" when `quantization_config.quant_method == "mxfp4"`, else "dense". A key left out
        (or null) takes transformers' GptOssConfig default, gpt-oss-120b's; `hf_defaults_note`
        names those that decide tensor shapes, and any error here names them too. A value of the
        wrong type or range raises ValueError naming the file, the key, expected and found.
        """
        cfg, where = read_config_json(config_json)
        try:
            return cls(**_gpt_oss_kwargs(cfg, experts_format))
        except (TypeError, ValueError) as e:
            note = hf_defaults_note(cfg)
            raise ValueError(f"{where}: {e}" + (f"; {note}" if note else "")) from None

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
# config.json keys that decide the tensors' shapes (or which tensors exist)
GPT_OSS_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "num_local_experts", "attention_bias")
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "sliding_window", "max_position_embeddings")
MAX_DIM, MAX_LAYERS = (1 << 31) - 1, 1 << 16  # config.json sizes past these are corrupt, not models
_KINDS = {"int": "an integer", "number": "a number", "bool": "true or false", "str": "a string",
          "dict": "an object", "list": "a list"}


def hf_value(cfg: dict, key: str, kind: str, prefix: str = ""):
    """cfg[key] (None when absent or null), checked to be of `kind` ("int", "number", "bool", "str",
    "dict", "list" (or tuple); bools, NaN and infinities are not numbers); else ValueError
    "{prefix}{key}: expected ..., found ..."."""
    v = cfg.get(key)
    if v is None:
        return None
    ok = {"int": type(v) is int, "number": type(v) is int or (type(v) is float and math.isfinite(v)),
          "bool": type(v) is bool, "str": type(v) is str, "dict": isinstance(v, dict),
          "list": isinstance(v, (list, tuple))}[kind]
    if not ok:
        raise ValueError(f"{prefix}{key}: expected {_KINDS[kind]}, found {v!r}")
    return v


def _gpt_oss_kwargs(cfg: dict, experts_format: str | None) -> dict:
    """GptOssConfig keyword arguments from a config.json dict (keys absent: left to the defaults)."""
    mt = cfg.get("model_type", "gpt_oss")
    if mt != "gpt_oss":
        raise ValueError(f"model_type is {mt!r}, expected 'gpt_oss'")
    quant = hf_value(cfg, "quantization_config", "dict")
    if quant is not None:
        method = quant.get("quant_method")
        if method != "mxfp4":
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported "
                             "(expected 'mxfp4' or no quantization_config)")
    if experts_format is None:
        experts_format = "mxfp4" if quant is not None else "dense"
    eos = cfg.get("eos_token_id")
    eos = [eos] if type(eos) is int else eos or []
    if not isinstance(eos, (list, tuple)) or not all(type(i) is int for i in eos):
        raise ValueError(f"eos_token_id: expected an integer or a list of integers, found {cfg['eos_token_id']!r}")
    layer_types = hf_value(cfg, "layer_types", "list") or []
    if not all(type(t) is str for t in layer_types):
        raise ValueError(f"layer_types: expected a list of strings, found {layer_types!r}")
    if "rope_scaling" not in cfg and "rope_parameters" not in cfg:  # absent: transformers' GptOssConfig default
        cfg = {**cfg, "rope_scaling": dict(GPT_OSS_HF_ROPE_SCALING)}
    if "sliding_window" in cfg and cfg["sliding_window"] is None:
        raise ValueError("sliding_window is null; GPT-OSS needs a window for its sliding layers")
    kw: dict[str, Any] = dict(rope=_rope(cfg), experts_format=experts_format, eos_token_ids=tuple(eos),
                              pad_token_id=hf_value(cfg, "pad_token_id", "int"),
                              bos_token_id=hf_value(cfg, "bos_token_id", "int"), layer_types=tuple(layer_types))
    for name in _INTS + ("head_dim", "num_experts"):
        v = hf_value(cfg, name, "int")
        most = MAX_LAYERS if name == "num_hidden_layers" else MAX_DIM
        if v is not None and v > most:
            raise ValueError(f"{name}: {v} is more than any model has (at most {most} read)")
    for names, kind in ((_INTS + ("head_dim", "num_experts"), "int"),
                        (("swiglu_limit", "swiglu_alpha", "rms_norm_eps"), "number"),
                        (("attention_bias", "tie_word_embeddings"), "bool")):
        for name in names:
            if hf_value(cfg, name, kind) is not None:
                kw[name] = cfg[name]
    if "num_experts" in kw:
        n = kw.pop("num_experts")
        kw.setdefault("num_local_experts", n)
    # head_dim absent: transformers' GptOssConfig default (64), not hidden / heads (2880 / 64 = 45)
    kw.setdefault("head_dim", GPT_OSS_HF_HEAD_DIM)
    return kw


def hf_defaults_note(cfg: dict) -> str:
    """"" when the config.json dict sets every key that decides the tensors' shapes
    (GPT_OSS_SHAPE_KEYS); else a sentence naming those it lacks (or sets to null) and the
    gpt-oss-120b defaults assumed for them, to add to a shape error."""
    if not isinstance(cfg, dict):
        return ""
    default = GptOssConfig()
    missing = [k for k in GPT_OSS_SHAPE_KEYS if cfg.get(k) is None
               and not (k == "num_local_experts" and cfg.get("num_experts") is not None)]
    if not missing:
        return ""
    assumed = ", ".join(f"{k}={GPT_OSS_HF_HEAD_DIM if k == 'head_dim' else getattr(default, k)}" for k in missing)
    return (f"config.json has no {', '.join(missing)}: assumed gpt-oss-120b's {assumed} (transformers' "
            "GptOssConfig defaults)")


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
    """RopeConfig from either `rope_scaling` (+ top-level `rope_theta`) or `rope_parameters`; a
    value of the wrong type or range raises ValueError naming `where` and the key."""
    try:
        return _rope(cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _rope(cfg: dict) -> RopeConfig:
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = {} if cfg.get(key) is None else cfg[key]
    if not isinstance(params, dict):
        raise ValueError(f"{key}: expected an object, found {params!r}")
    theta = hf_value(params, "rope_theta", "number", f"{key}.")
    if theta is None:
        theta = hf_value(cfg, "rope_theta", "number")
    if theta is None:
        theta = 150000.0 if cfg.get("model_type") == "gpt_oss" else 10000.0
    rtype = params.get("rope_type", params.get("type", "default" if not params else "yarn"))
    if rtype in ("default", None):
        return RopeConfig(theta=float(theta), rope_type="default")
    if not isinstance(rtype, str):
        raise ValueError(f"{key}.rope_type: expected a string, found {rtype!r}")
    num = lambda name, default: float(hf_value(params, name, "number", f"{key}.") or default)  # noqa: E731
    factor = hf_value(params, "factor", "number", f"{key}.")
    if rtype == "llama3":
        orig = hf_value(params, "original_max_position_embeddings", "int", f"{key}.")
        return RopeConfig(theta=float(theta), rope_type="llama3", factor=float(factor or 1.0),
                          low_freq_factor=num("low_freq_factor", 1.0), high_freq_factor=num("high_freq_factor", 4.0),
                          original_max_position_embeddings=8192 if orig is None else orig)
    orig = hf_value(params, "original_max_position_embeddings", "int", f"{key}.")
    if orig is None:
        orig = hf_value(cfg, "max_position_embeddings", "int")
    if orig is None:
        raise ValueError(f"{key}.original_max_position_embeddings: missing (and no max_position_embeddings)")
    _positive_int(f"{key}.original_max_position_embeddings", orig)
    if factor is None:
        most = hf_value(cfg, "max_position_embeddings", "int")
        if most is None:
            raise ValueError(f"{key}.factor: missing, and no max_position_embeddings to derive it from")
        factor = most / orig
    attention_factor = hf_value(params, "attention_factor", "number", f"{key}.")
    mscale = hf_value(params, "mscale", "number", f"{key}.")
    mscale_all_dim = hf_value(params, "mscale_all_dim", "number", f"{key}.")
    if attention_factor is None and mscale and mscale_all_dim:  # as transformers' YaRN parameters
        attention_factor = _yarn_mscale(float(factor), mscale) / _yarn_mscale(float(factor), mscale_all_dim)
    truncate = hf_value(params, "truncate", "bool", f"{key}.")
    return RopeConfig(
        theta=float(theta), rope_type=rtype, factor=float(factor), beta_fast=num("beta_fast", 32.0),
        beta_slow=num("beta_slow", 1.0), original_max_position_embeddings=orig,
        truncate=True if truncate is None else truncate, attention_factor=attention_factor,
    )


def read_config_json(src) -> tuple[dict, str]:
    """(the parsed config.json, where it was read) from a dict (where: "config"), a config.json
    path or a checkpoint folder holding one. ValueError when it is missing, not JSON, or not a JSON
    object."""
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
        with open(path, "rb") as f:
            cfg = json.loads(f.read())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(cfg).__name__}")
    return cfg, path


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
