"""EAGLE-3 draft checkpoints (`LlamaForCausalLMEagle3`, docs/reference.md 5) <-> `Eagle3`.

Reads the layouts published drafts use: SpecForge / lmsys (draft vocab with `d2t` / `t2d`),
nvidia (no `lm_head`: the target's head serves; v3 with `norm_before_fc` and aux ids read as
hidden-state boundaries), with or without `embed_tokens` (absent: the target's embedding is
shared, not copied), keys under `midlayer.` or `layers.0.` (optionally below `model.`).
`save_eagle3` writes the SpecForge layout back, which SGLang and vLLM load (a whole folder or
nothing, replacing a checkpoint only with overwrite=True: `folders`). With `mesh=`, the
draft is placed as `parallel.shard` places it (replicated; a borrowed embedding or head keeps the
target's placement), each parameter built on the mesh from the file (`params.place`).
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from eagle3_jax import parallel
from eagle3_jax.convert import folders, params
from eagle3_jax.convert import safetensors_io as stio
from eagle3_jax.models.config import (
    MAX_DIM,
    Eagle3Config,
    GptOssConfig,
    hf_value,
    read_config_json,
    rope_from_hf,
    rope_to_hf,
)
from eagle3_jax.models.eagle3 import Eagle3, pair_dtype

LAYER_PREFIXES = ("midlayer.", "layers.0.")


def config_from_hf(cfg: dict, target_config: GptOssConfig, where: str = "config.json", *,
                   aux_layer_ids=None, aux_convention: str | None = None, has_lm_head: bool = True,
                   has_embed: bool = True, sliding_window: int | None = None, head_rows: int | None = None,
                   variants: dict | None = None) -> Eagle3Config:
    """Eagle3Config from a draft's config.json dict, checked against the target's config.

    The aux-layer convention is `aux_convention` when given, else the config's
    `eagle_config.aux_layer_convention` when present, else "input" when an id equals the target's
    layer count (only a hidden-state boundary can be L), else "output" (SpecForge / SGLang).
    head_rows: the lm_head's rows (the draft vocabulary where the config gives no draft_vocab_size);
    variants: flags the checkpoint's tensors imply (norm_before_fc, fc_norm), switched on whatever the
    config says; sliding_window None: `eagle_config.sliding_window` (what `save_eagle3` writes), else full."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(cfg).__name__}")
    try:
        layer = hf_value(cfg, "transformer_layer_config", "dict") or {}  # speculators nest the layer config
        cfg = {**layer, **{k: v for k, v in cfg.items() if k != "transformer_layer_config"}}
        eagle = hf_value(cfg, "eagle_config", "dict") or {}
        arch = hf_value(cfg, "architectures", "list") or []
        ints = {k: hf_value(cfg, k, "int") for k in (
            "num_hidden_layers", "vocab_size", "hidden_size", "target_hidden_size", "draft_vocab_size",
            "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")}
        for k, v in ints.items():
            if v is not None and v > MAX_DIM:
                raise ValueError(f"{k}: {v} is more than any model has (at most {MAX_DIM} read)")
        eps = hf_value(cfg, "rms_norm_eps", "number")
        own_ids = hf_value(eagle, "eagle_aux_hidden_state_layer_ids", "list", "eagle_config.") or \
            hf_value(cfg, "eagle_aux_hidden_state_layer_ids", "list")
        if own_ids and not all(type(i) is int for i in own_ids):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids: expected a list of integers, found {own_ids!r}")
        ids = aux_layer_ids or own_ids
        conv = aux_convention or hf_value(eagle, "aux_layer_convention", "str", "eagle_config.")
        if sliding_window is None:
            sliding_window = hf_value(eagle, "sliding_window", "int", "eagle_config.")
        flags = {}
        for name, default in (("norm_before_fc", False), ("fc_norm", False), ("norm_output", True),
                              ("norm_before_residual", False)):
            src, prefix = (cfg, "") if name in cfg else (eagle, "eagle_config.")
            flags[name] = bool(hf_value(src, name, "bool", prefix) if name in src else default)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if arch and not any("eagle" in str(a).lower() or "speculator" in str(a).lower() for a in arch):
        raise ValueError(f"{where}: architectures {arch} is not an EAGLE-3 draft (expected LlamaForCausalLMEagle3)")
    if ints["num_hidden_layers"] not in (None, 1):
        raise ValueError(f"{where}: num_hidden_layers is {ints['num_hidden_layers']}; EAGLE-3 drafts have 1")
    L, V = target_config.num_hidden_layers, target_config.vocab_size
    vocab = V if ints["vocab_size"] is None else ints["vocab_size"]
    if vocab != V:
        raise ValueError(f"{where}: vocab_size {vocab} does not match the target's vocab_size {V}")
    H = ints["hidden_size"]
    if H is None:
        raise ValueError(f"{where}: missing hidden_size")
    Ht = ints["target_hidden_size"] or H
    if Ht != target_config.hidden_size:
        raise ValueError(f"{where}: target_hidden_size {Ht} does not match the target's hidden_size "
                         f"{target_config.hidden_size}")
    dv = ints["draft_vocab_size"]
    if dv is None and has_lm_head and head_rows is not None:
        dv = head_rows  # no draft_vocab_size: the head's rows say it
    own_head = has_lm_head
    if dv is not None and dv != V and not has_lm_head:
        raise ValueError(f"{where}: draft_vocab_size is {dv} but the checkpoint has no lm_head.weight (use "
                         "frspec.restrict_head to build a head from the target's rows)")
    ids = ids or target_config.default_aux_layer_ids()
    conv = conv or ("input" if L in ids else "output")
    implied = variants or {}
    heads = ints["num_attention_heads"]
    if heads is None or heads <= 0:
        raise ValueError(f"{where}: num_attention_heads: expected a positive integer, found {heads!r}")
    rope = rope_from_hf({"rope_theta": 10000.0, **cfg}, where)
    try:
        return Eagle3Config(
            hidden_size=H, intermediate_size=ints["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=ints["num_key_value_heads"] or heads, head_dim=ints["head_dim"] or H // heads,
            vocab_size=V, draft_vocab_size=dv if own_head and dv is not None else V,
            target_hidden_size=Ht, aux_layer_ids=tuple(ids), aux_convention=conv, target_num_layers=L,
            rms_norm_eps=1e-5 if eps is None else eps, rope=rope,
            max_position_embeddings=ints["max_position_embeddings"] or target_config.max_position_embeddings,
            **{k: v or bool(implied.get(k)) for k, v in flags.items()},
            own_embed=has_embed, own_lm_head=own_head, sliding_window=sliding_window)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


class _Entry(NamedTuple):
    key: str                  # HF tensor name (after the layer prefix)
    attr: tuple               # attribute path in Eagle3
    shape: tuple              # HF shape
    transpose: bool           # HF [out, in] -> our [in, out]
    cols: tuple | None = None  # (start, stop) of the fused param's last axis it fills (wqkv), None: all


def _entries(c: Eagle3Config, p: str) -> list[_Entry]:
    """Every float tensor of the draft."""
    H, Ht, I = c.hidden_size, c.target_hidden_size, c.intermediate_size
    q = c.num_attention_heads * c.head_dim
    qkv = params.qkv_columns(c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    out = [("fc.weight", ("fc",), (H, 3 * Ht), True), ("norm.weight", ("norm", "scale"), (H,), False),
           (p + "input_layernorm.weight", ("input_layernorm", "scale"), (H,), False),
           (p + "hidden_norm.weight", ("hidden_norm", "scale"), (H,), False),
           (p + "post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), (H,), False),
           *((p + f"self_attn.{n}_proj.weight", ("wqkv",), (b - a, 2 * H), True, (a, b)) for n, (a, b) in qkv.items()),
           (p + "self_attn.o_proj.weight", ("wo",), (H, q), True),
           (p + "mlp.gate_proj.weight", ("gate",), (I, H), True), (p + "mlp.up_proj.weight", ("up",), (I, H), True),
           (p + "mlp.down_proj.weight", ("down",), (H, I), True)]
    if c.norm_before_fc:
        out.append(("input_norm.weight", ("input_norm", "scale"), (3 * Ht,), False))
    if c.fc_norm:
        out += [(f"fc_norm.{i}.weight", ("fc_norm", i, "scale"), (Ht,), False) for i in range(3)]
    if c.own_embed:
        out.append(("embed_tokens.weight", ("embed",), (c.vocab_size, H), False))
    if c.own_lm_head:
        out.append(("lm_head.weight", ("lm_head",), (c.draft_vocab_size, H), False))
    return [_Entry(*e) for e in out]


def _get_attr(module, path):
    for p in path:
        module = module[p] if isinstance(p, int) else getattr(module, p)
    return module


def check_d2t(d2t: np.ndarray, vocab_size: int, where: str) -> None:
    """d2t offsets must map draft ids to distinct target ids inside the target vocabulary."""
    tgt = np.arange(d2t.shape[0]) + d2t.astype(np.int64)
    bad = np.flatnonzero((tgt < 0) | (tgt >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: d2t maps draft id {i} to target id {int(tgt[i])}, outside the target "
                         f"vocabulary [0, {vocab_size})")
    if np.unique(tgt).size != tgt.size:
        raise ValueError(f"{where}: d2t maps several draft ids to the same target id")


def load_eagle3(path: str | os.PathLike, target_config: GptOssConfig | None = None, *, target=None,
                dtype=None, aux_layer_ids=None, aux_convention: str | None = None,
                sliding_window: int | None = None, mesh=None, progress: bool | None = None) -> Eagle3:
    """HF EAGLE-3 draft folder -> Eagle3 on the default device, or on `mesh`.

    target_config: the target's GptOssConfig (or pass `target=`, the GptOss module, which is
    required when the checkpoint has no `embed_tokens` or no `lm_head`: those are shared with the
    target, not copied). dtype None: the target's dtype when `target=` is given (a pair must share
    one dtype to run together), else bfloat16. aux_layer_ids / aux_convention override the
    checkpoint's; sliding_window bounds the draft's attention (None: full). progress: a tqdm bar over
    the checkpoint's bytes (None: only past 1 GiB or several files; True always, False never).
    mesh: a parallel.make_mesh Mesh: every variable gets `parallel.param_sharding` (the values and
    placement of `parallel.shard(load_eagle3(...), mesh)`: the draft's own weights replicated, each
    read once per process, through jax.make_array_from_callback; a borrowed embedding or head is
    moved onto the mesh for target and draft alike, as `shard` does). A mesh that does not divide
    the vocabulary a borrowed embedding or head needs raises before any tensor is read.
    Raises ValueError naming the problem.
    """
    path = os.fspath(path)
    if target is not None:
        target_config = target.config
    dtype = pair_dtype(target) if dtype is None else params.float_dtype("load_eagle3", dtype)
    if target_config is None:
        raise ValueError("load_eagle3: pass target_config= (or target=)")
    tensors = {k[len("model."):] if k.startswith("model.") else k: v for k, v in stio.open_checkpoint(path).items()}
    cfg_file = os.path.join(path, "config.json") if os.path.isdir(path) else None
    if cfg_file is None or not os.path.exists(cfg_file):
        raise ValueError(f"{path}: config.json not found ({stio.EXPECTED})")
    raw, _ = read_config_json(cfg_file)
    try:
        tied = hf_value(raw, "tie_word_embeddings", "bool")
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from None
    if "fc.weight" not in tensors:
        raise ValueError(f"{path}: missing tensor fc.weight (the EAGLE-3 feature projection)")
    prefix = next((p for p in LAYER_PREFIXES if p + "self_attn.q_proj.weight" in tensors), None)
    if prefix is None:
        raise ValueError(f"{path}: missing tensor midlayer.self_attn.q_proj.weight (or layers.0.*)")
    if tied and "lm_head.weight" not in tensors and "embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]  # tied: the draft's own embedding is its head
    head = tensors.get("lm_head.weight")
    variants = dict(norm_before_fc="input_norm.weight" in tensors, fc_norm="fc_norm.0.weight" in tensors)
    cfg = config_from_hf(raw, target_config, cfg_file, aux_layer_ids=aux_layer_ids, aux_convention=aux_convention,
                         has_lm_head=head is not None, has_embed="embed_tokens.weight" in tensors,
                         sliding_window=sliding_window,
                         head_rows=int(head.shape[0]) if head is not None and len(head.shape) == 2 else None,
                         variants=variants)
    if not cfg.own_embed or not cfg.own_lm_head:
        what = "embed_tokens" if not cfg.own_embed else "lm_head"
        if target is None:
            raise ValueError(f"{path}: the draft has no {what}.weight; pass target= to share the target's")
        if cfg.hidden_size != target_config.hidden_size:
            raise ValueError(f"{path}: the draft has no {what}.weight, and the target's (width "
                             f"{target_config.hidden_size}) does not fit its hidden_size {cfg.hidden_size}")
    fc = tensors["fc.weight"]
    if tuple(fc.shape) != (cfg.hidden_size, 3 * cfg.target_hidden_size):
        raise ValueError(f"{fc.file}: fc.weight: expected shape {[cfg.hidden_size, 3 * cfg.target_hidden_size]} "
                         f"(3 x the target's hidden size {target_config.hidden_size}), found {list(fc.shape)}")
    if mesh is not None:
        parallel.check_mesh(cfg, mesh)
    entries = _entries(cfg, prefix)
    present = {e.key: stio.check(tensors, e.key, e.shape, path) for e in entries}  # all checked before any is read
    stio.check_all_used(tensors, {e.key for e in entries} | {"d2t", "t2d"}, path, "EAGLE-3 draft")
    d2t = _draft_to_target(tensors, cfg, path).astype(np.int32)
    own = cfg.replace(own_embed=True, own_lm_head=True)  # abstract shell; shared Params are attached below
    abstract = nnx.eval_shape(lambda: Eagle3(own, dtype=dtype, rngs=nnx.Rngs(0)))
    abstract.config = cfg
    if not cfg.own_embed:
        abstract.embed = target.embed
    if not cfg.own_lm_head:
        abstract.lm_head = target.lm_head
    name = os.path.basename(os.path.normpath(path))
    if mesh is None:
        fill = params.Filler()
        with stio.load_progress(present, progress, f"loading {name}") as bar:
            for key, attr, _, transpose, cols in entries:
                a = tensors[key].load()
                fill.put(_get_attr(abstract, attr), a.T if transpose else a, cols)
                bar.update(tensors[key].nbytes)
        fill.finish()
        abstract.d2t.set_value(jnp.asarray(d2t))
        return abstract
    groups: dict[tuple, list] = {}
    for key, attr, _, transpose, cols in entries:
        info = present[key]
        groups.setdefault(attr, []).append((info, params.Source(info.read, transpose, cols)))
    with stio.load_progress(present, progress, f"loading {name}") as bar:
        params.place_all(groups, lambda attr: _get_attr(abstract, attr),
                         lambda attr: parallel.param_sharding(abstract, mesh, "/".join(map(str, attr))), bar)
    abstract.d2t.set_value(jax.make_array_from_callback(d2t.shape, parallel.param_sharding(abstract, mesh, "d2t"),
                                                        lambda index: d2t[index]))
    for name in ("embed", "lm_head"):  # borrowed: moved for both, as parallel.shard moves them
        var = getattr(abstract, name)
        sharding = parallel.param_sharding(abstract, mesh, name)
        if var.get_value().sharding != sharding:
            var.set_value(jax.device_put(var.get_value(), sharding))
    return abstract


def _draft_to_target(tensors, cfg: Eagle3Config, path: str) -> np.ndarray:
    """d2t offsets [draft_vocab_size]: the checkpoint's d2t, else derived from its t2d mask (the i-th
    marked target id is draft id i), else zeros for a full-vocab head; checked against t2d."""
    n, V = cfg.draft_vocab_size, cfg.vocab_size
    t2d = None
    if "t2d" in tensors:
        t2d = stio.get(tensors, "t2d", (V,), path, "biu")
        if t2d.dtype.kind != "b" and not np.isin(t2d, (0, 1)).all():
            raise ValueError(f"{tensors['t2d'].file}: t2d must be a 0/1 mask over the target vocabulary")
        t2d = np.flatnonzero(t2d)
    if not cfg.own_lm_head:
        return np.zeros(n, np.int64)
    if "d2t" in tensors:
        d2t = stio.get(tensors, "d2t", (n,), path, "i").astype(np.int64)
    elif t2d is not None:
        if t2d.size != n:
            raise ValueError(f"{tensors['t2d'].file}: t2d marks {t2d.size} target ids for a draft vocabulary of {n}")
        d2t = t2d - np.arange(n)
    elif n == V:
        d2t = np.zeros(n, np.int64)
    else:
        raise ValueError(f"{path}: draft vocabulary {n} < the target's {V} but the checkpoint has neither d2t nor "
                         "t2d (the map from draft to target ids)")
    check_d2t(d2t, V, tensors["d2t"].file + ": d2t" if "d2t" in tensors else path)
    if t2d is not None and not np.array_equal(t2d, np.sort(np.arange(n) + d2t)):
        raise ValueError(f"{tensors['t2d'].file}: t2d does not mark exactly the target ids d2t maps to")
    return d2t


def save_eagle3(draft: Eagle3, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Writes the SpecForge `LlamaForCausalLMEagle3` layout (config.json + model.safetensors with
    `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` int64, `t2d` bool; `embed_tokens` only when the
    draft owns one; matrices in the draft's dtype, norms float32, so save -> load is lossless).
    Aux ids keep the checkpoint's own spelling (what each serving stack already does with the
    original); input-convention drafts also get `eagle_config.aux_layer_convention: "input"`.

    Written whole or not at all, with `save_gpt_oss`'s folder rules: a folder that is not empty
    (a GPT-OSS checkpoint, say) raises ValueError naming what it holds unless overwrite=True, which
    replaces its checkpoint files of any kind and keeps other files. A model that is not an Eagle3
    raises ValueError before anything is created."""
    params.expect_module("save_eagle3", draft, Eagle3)
    folders.check_target(path, "save_eagle3", overwrite)
    c = draft.config
    tensors = {}
    for key, attr, _, transpose, cols in _entries(c, "midlayer."):
        a = params.columns(_get_attr(draft, attr).get_value(), cols)
        a = a.T if transpose else a
        tensors[key] = np.ascontiguousarray(a.astype(np.float32) if a.ndim == 1 else a)  # matrices keep their dtype
    d2t = np.asarray(draft.d2t[...]).astype(np.int64)
    t2d = np.zeros(c.vocab_size, bool)
    t2d[np.arange(c.draft_vocab_size) + d2t] = True
    if c.own_lm_head:
        tensors["d2t"], tensors["t2d"] = d2t, t2d
    eagle = {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids), "use_aux_hidden_state": True}
    if c.aux_convention == "input":
        eagle["aux_layer_convention"] = "input"
    if c.sliding_window is not None:  # ours: read back by load_eagle3; serving stacks ignore it
        eagle["sliding_window"] = c.sliding_window
    cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
               hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
               num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
               head_dim=c.head_dim, vocab_size=c.vocab_size,
               draft_vocab_size=c.draft_vocab_size if c.own_lm_head else None,
               target_hidden_size=c.target_hidden_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope.theta,
               rope_scaling=rope_to_hf(c.rope), max_position_embeddings=c.max_position_embeddings,
               hidden_act="silu", tie_word_embeddings=False, norm_before_fc=c.norm_before_fc, fc_norm=c.fc_norm,
               norm_output=c.norm_output, norm_before_residual=c.norm_before_residual, eagle_config=eagle,
               torch_dtype=np.dtype(draft.dtype).name)
    with folders.staged(path, "save_eagle3", overwrite) as tmp:
        safetensors.numpy.save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
