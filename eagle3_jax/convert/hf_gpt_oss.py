"""Hugging Face GPT-OSS checkpoints <-> `GptOss` (docs/reference.md 3), and orbax save / restore.

`load_gpt_oss(path)` reads one file or shards (`model.safetensors.index.json`), MXFP4 experts
(`*_blocks` / `*_scales`, kept packed) or the dequantized layout (`gate_up_proj` / `down_proj`,
[E, in, out]), norms in fp32 or bf16. Tensors stream one at a time from memory maps to the device.
With `mesh=`, each parameter is placed by parallel.py's table as it is read, every device's shard
from the byte ranges it covers (`params.place`): no host or device holds a whole sharded tensor.
`random_gpt_oss(config, seed, dtype, mesh=None)`: random weights, created split on `mesh` likewise.
`experts=` (with a mesh: "tensor", the default `parallel.EXPERTS`, or "expert"): how the experts are
split (`parallel.split_experts`), read in that split where it needs no padding (else whole experts a
device, then padded and moved: `parallel.placement_split`); the writers store them as the
checkpoint does whatever the split. The writers (`save_gpt_oss`, `save_checkpoint`) write a whole
folder or nothing, and replace a checkpoint only with overwrite=True (`folders`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from eagle3_jax import parallel
from eagle3_jax.checks import ArgumentError, int_arg
from eagle3_jax.convert import folders, params
from eagle3_jax.convert import safetensors_io as stio
from eagle3_jax.models import gpt_oss
from eagle3_jax.models.config import GptOssConfig, RopeConfig, hf_defaults_note, read_config_json
from eagle3_jax.models.gpt_oss import GptOss


class Entry(NamedTuple):
    key: str                      # HF tensor name
    path: tuple                   # path of the nnx.Param in GptOss
    shape: tuple                  # HF shape
    to_param: Callable            # HF array -> our layout
    to_hf: Callable               # our layout -> HF array
    kinds: str = "f"              # allowed dtype kinds
    cols: tuple | None = None     # (start, stop) of the param's first axis it fills (fused qkv), None: all


def _same(a):
    return a


def _t(a):
    return np.swapaxes(a, -1, -2)


def layout(keys, where: str = "checkpoint") -> str:
    """'mxfp4' or 'dense' from the tensor names present (layer 0's experts)."""
    if "model.layers.0.mlp.experts.gate_up_proj_blocks" in keys:
        return "mxfp4"
    if "model.layers.0.mlp.experts.gate_up_proj" in keys:
        return "dense"
    raise ValueError(f"{where}: missing tensor model.layers.0.mlp.experts.gate_up_proj_blocks (MXFP4) or "
                     "model.layers.0.mlp.experts.gate_up_proj (dense): unknown expert layout")


def entries(cfg: GptOssConfig) -> list[Entry]:
    """Every checkpoint tensor with its parameter path and HF shape; the one table both directions use."""
    H, V, E, I = cfg.hidden_size, cfg.vocab_size, cfg.num_local_experts, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    out = [Entry("model.embed_tokens.weight", ("embed",), (V, H), _same, _same),
           Entry("model.norm.weight", ("norm", "scale"), (H,), _same, _same),
           Entry("lm_head.weight", ("lm_head",), (V, H), _same, _same)]
    for i in range(cfg.num_hidden_layers):
        p, L = f"model.layers.{i}.", ("layers", i)
        out += [Entry(p + "input_layernorm.weight", L + ("input_layernorm", "scale"), (H,), _same, _same),
                Entry(p + "post_attention_layernorm.weight", L + ("post_attention_layernorm", "scale"), (H,),
                      _same, _same),
                Entry(p + "self_attn.sinks", L + ("self_attn", "sinks"), (cfg.num_attention_heads,), _same, _same),
                Entry(p + "mlp.router.weight", L + ("mlp", "router_w"), (E, H), _t, _t),
                Entry(p + "mlp.router.bias", L + ("mlp", "router_b"), (E,), _same, _same)]
        qkv = params.qkv_columns(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        for name, w, cols, n_in in (*((n, "qkv", c, H) for n, c in qkv.items()), ("o", "o", None, q)):
            n_out = H if cols is None else cols[1] - cols[0]  # [out, in] as HF stores them
            out.append(Entry(p + f"self_attn.{name}_proj.weight", L + ("self_attn", "w" + w), (n_out, n_in), _same,
                             _same, cols=cols))
            if cfg.attention_bias:
                out.append(Entry(p + f"self_attn.{name}_proj.bias", L + ("self_attn", "b" + w), (n_out,),
                                 _same, _same, cols=cols))
        x = p + "mlp.experts."
        X = L + ("mlp", "experts")
        out += [Entry(x + "gate_up_proj_bias", X + ("gate_up_bias",), (E, 2 * I), _same, _same),
                Entry(x + "down_proj_bias", X + ("down_bias",), (E, H), _same, _same)]
        if cfg.experts_format == "mxfp4":
            out += [Entry(x + "gate_up_proj_blocks", X + ("gate_up_blocks",), (E, 2 * I, H // 32, 16),
                          _same, _same, "u"),
                    Entry(x + "gate_up_proj_scales", X + ("gate_up_scales",), (E, 2 * I, H // 32), _same, _same, "u"),
                    Entry(x + "down_proj_blocks", X + ("down_blocks",), (E, H, I // 32, 16), _same, _same, "u"),
                    Entry(x + "down_proj_scales", X + ("down_scales",), (E, H, I // 32), _same, _same, "u")]
        else:  # HF dense layout is x @ W ([E, in, out]); ours is [E, out, in]
            out += [Entry(x + "gate_up_proj", X + ("gate_up",), (E, H, 2 * I), _t, _t),
                    Entry(x + "down_proj", X + ("down",), (E, I, H), _t, _t)]
    return out


def _param(state, path):
    node = state
    for p in path:
        node = node[p]
    return node


def load_gpt_oss(path: str | os.PathLike, dtype=jnp.bfloat16, config: GptOssConfig | None = None, *,
                 mesh=None, experts: str | None = None, progress: bool | None = None) -> GptOss:
    """HF GPT-OSS checkpoint folder -> GptOss on the default device, or split over `mesh`.

    dtype: storage/compute dtype of the unquantized weights and activations (bf16, or f32 for
    tests; a floating dtype, else ValueError); norms and sinks are kept in f32, packed experts as
    uint8. The expert layout follows the tensors present. Every tensor's name, shape and dtype is
    checked before any is read (safetensors_io.open_checkpoint checks the files themselves); bad
    input raises ValueError naming the file, key, expected and found, and, when config.json left
    out keys that decide shapes, the gpt-oss-120b defaults it assumed (`hf_defaults_note`). MXFP4
    scales of 255 (E8M0's NaN) raise as they are read.
    mesh: a parallel.make_mesh Mesh: every parameter gets `parallel.param_sharding` (the same
    placement and values as `parallel.shard(load_gpt_oss(path, dtype), mesh)`), built by
    jax.make_array_from_callback from the byte ranges of each local device's shard only (under
    jax.distributed every process reads just its own devices' shards). A mesh that does not divide
    the heads, experts or vocabulary raises ValueError (parallel.check_mesh) before any tensor is read.
    experts: how the mesh splits the experts (`parallel.split_experts`: "tensor" or "expert"; None,
    `parallel.EXPERTS`); only with mesh=.
    progress: a tqdm bar over the checkpoint's bytes on stderr (a widget in notebooks); None shows
    it only for checkpoints worth waiting for (over 1 GiB or several shards: gpt-oss-120b is 65 GB
    in 15), True always, False never.
    """
    path = os.fspath(path)
    dtype = params.float_dtype("load_gpt_oss", dtype)
    tensors = stio.open_checkpoint(path)
    note = ""
    if config is None:
        raw, _ = read_config_json(path)
        config = GptOssConfig.from_hf(path)
        note = hf_defaults_note(raw)
    try:
        config = config.replace(experts_format=layout(tensors, path))
        table = _checked_entries(tensors, config, path)
    except ValueError as e:
        raise ValueError(f"{e}; {note}" if note else str(e)) from None
    _check_split(config, mesh, experts)
    abstract = nnx.eval_shape(lambda: GptOss(config, dtype=dtype, rngs=nnx.Rngs(0)))
    if mesh is not None:
        parallel.placement_split(abstract, mesh, experts)
    graphdef, state = nnx.split(abstract)
    name = os.path.basename(os.path.normpath(path))
    if mesh is None:
        fill = params.Filler()
        with stio.load_progress(tensors, progress, f"loading {name}") as bar:
            for e in table:
                a = tensors[e.key].load()
                _check_scales(a, tensors[e.key])
                fill.put(_param(state, e.path), e.to_param(a), e.cols, axis=0)
                bar.update(tensors[e.key].nbytes)
        fill.finish()
        return nnx.merge(graphdef, state)
    groups: dict[tuple, list] = {}
    for e in table:
        info = tensors[e.key]
        groups.setdefault(e.path, []).append((info, params.Source(_reader(info), e.to_param is _t, e.cols, axis=0)))
    with stio.load_progress(tensors, progress, f"loading {name}") as bar:
        params.place_all(groups, lambda p: _param(state, p),
                         lambda p: parallel.param_sharding(abstract, mesh, "/".join(map(str, p))), bar)
    return parallel.split_experts(parallel.align_heads(nnx.merge(graphdef, state), mesh), mesh, experts)


def _checked_entries(tensors: dict, config: GptOssConfig, path: str) -> list[Entry]:
    """The checkpoint table of `config`, every tensor of it checked against the checkpoint (name,
    shape, dtype kind) and every checkpoint tensor used; the layer count is checked first (a
    config naming more layers than the checkpoint holds fails before the table is built)."""
    layers = {k.split(".")[2] for k in tensors if k.startswith("model.layers.")}
    n = config.num_hidden_layers
    if n > len(layers):
        raise ValueError(f"{path}: config.json num_hidden_layers is {n}, the checkpoint holds tensors of {len(layers)} "
                         f"layers (missing tensor model.layers.{n - 1}.input_layernorm.weight)")
    table = entries(config)
    for e in table:
        stio.check(tensors, e.key, e.shape, path, e.kinds)
    stio.check_all_used(tensors, {e.key for e in table}, path, "GPT-OSS config")  # e.g. biases, attention_bias false
    return table


def _check_scales(a: np.ndarray, info: stio.TensorInfo, index=()) -> None:
    """MXFP4 scales are E8M0 exponents: 255 is the format's NaN, not a scale. `a` is the block
    `index` of the tensor (TensorInfo.read's); ValueError naming the file, key and element."""
    if info.key.endswith("_scales"):
        bad = np.flatnonzero(a.reshape(-1) == 255)
        if bad.size:
            at = np.unravel_index(bad[0], a.shape)
            at = [int(i) + lo for i, (lo, _) in zip(at, stio.block_bounds(info.shape, index))]
            raise ValueError(f"{info.file}: {info.key}: E8M0 scale 255 (NaN) at {at}; MXFP4 scales are exponents "
                             "0..254")


def _reader(info: stio.TensorInfo) -> Callable:
    """info.read, with the scales checked as they are read (`_check_scales`)."""
    def read(index=()):
        a = info.read(index)
        _check_scales(a, info, index)
        return a

    return read


def _check_split(config: GptOssConfig, mesh, experts: str | None) -> None:
    """Raises ValueError for a mesh that does not divide the config (parallel.check_mesh), an unknown
    expert split, or a split without a mesh."""
    if mesh is None:
        if experts is not None:
            raise ArgumentError(f"experts={experts!r} splits the experts over a mesh; pass mesh= or leave it out")
        return
    parallel.check_mesh(config, mesh)
    parallel.expert_units(config, mesh, experts)


def random_gpt_oss(config: GptOssConfig, seed: int = 0, dtype=jnp.bfloat16, mesh=None,
                   experts: str | None = None) -> GptOss:
    """`gpt_oss.random_gpt_oss` (the same values for the same seed), on the default device, or with
    `mesh=` created already split by `parallel.param_sharding` (as `parallel.shard` would place
    it; no device ever holds a whole sharded parameter), the experts then split as `experts` says
    (`parallel.split_experts`). Raises ValueError for a mesh that does not divide the config
    (parallel.check_mesh) before building anything."""
    _check_split(config, mesh, experts)
    if mesh is None:
        return gpt_oss.random_gpt_oss(config, seed, dtype)
    abstract = parallel.placement_split(
        nnx.eval_shape(lambda: GptOss(config, dtype=dtype, rngs=nnx.Rngs(0))), mesh, experts)
    model = gpt_oss.random_gpt_oss(config, seed, dtype, shardings=lambda p: parallel.param_sharding(abstract, mesh, p))
    model = parallel.placement_split(model, mesh, experts)  # the split its experts were created in
    return parallel.split_experts(parallel.align_heads(model, mesh), mesh, experts)


def _stored_state(model: GptOss):
    """The model's nnx state as the writers store it: each layer's wqkv rows / bqkv in q|k|v order
    (a model placed on a mesh holds them in head-aligned blocks: `parallel.align_heads`), experts
    without the units a "tensor" split pads (`parallel.split_experts`)."""
    state = nnx.clone(nnx.state(model))
    units = model.config.intermediate_size
    for i, layer in enumerate(model.layers):
        att = layer.self_attn
        for name in ("wqkv", "bqkv"):
            if getattr(att, name) is not None and att.qkv_blocks != 1:
                var = state["layers"][i]["self_attn"][name]
                var.set_value(att.qkv_columns(var.get_value(), axis=0))
        for name, var in state["layers"][i]["mlp"]["experts"].items():
            var.set_value(parallel.resize_units(name, var.get_value(), units))
    return state


def save_gpt_oss(model: GptOss, path: str | os.PathLike, max_shard_bytes: int = 4 << 30, *,
                 overwrite: bool = False) -> None:
    """Writes `model` in the HF layout (config.json, safetensors, sharded with an index when larger
    than max_shard_bytes); bf16 floats, f32 norms and sinks (as the model holds them), packed experts
    as stored. Each shard is gathered to the host only while it is written.

    The folder is written whole or not at all (`folders.staged`: a hidden folder beside `path`,
    renamed into place once every file is on disk). A folder `path` that is not empty raises
    ValueError naming what it holds, unless overwrite=True: then all its checkpoint files (of any
    kind: stale shards and index included) are replaced, other files (a README, tokenizer.json)
    kept. A model that is not a GptOss raises ValueError before anything is created."""
    params.expect_module("save_gpt_oss", model, GptOss)
    max_shard_bytes = int_arg("max_shard_bytes", max_shard_bytes, 1)
    folders.check_target(path, "save_gpt_oss", overwrite)
    state = _stored_state(model)
    table = entries(model.config)
    shards, size = [[]], 0
    for e in table:
        dtype = _stored_dtype(e, _param(state, e.path).get_value().dtype)
        n = int(np.prod(e.shape, dtype=np.int64)) * dtype.itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    with folders.staged(path, "save_gpt_oss", overwrite) as tmp:
        total = 0
        for name, shard in zip(names, shards):
            arrays = {}
            for e in shard:
                a = params.columns(_param(state, e.path).get_value(), e.cols, axis=0)
                arrays[e.key] = np.ascontiguousarray(e.to_hf(a.astype(_stored_dtype(e, a.dtype))))
                total += arrays[e.key].nbytes
            safetensors.numpy.save_file(arrays, os.path.join(tmp, name), metadata={"format": "pt"})
            del arrays
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {e.key: n for n, shard in zip(names, shards) for e in shard}}
            with open(os.path.join(tmp, stio.INDEX), "w") as f:
                json.dump(index, f, indent=1)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(model.config.to_hf(), f, indent=1)


def _stored_dtype(e: Entry, dtype) -> np.dtype:
    """The dtype `save_gpt_oss` stores a parameter of `dtype` in: bf16 for floats, except norms and
    sinks (kept as the model holds them); packed experts as they are."""
    dtype = np.dtype(dtype)
    keep = "layernorm" in e.key or e.key == "model.norm.weight" or e.key.endswith(".sinks")
    return np.dtype(ml_dtypes.bfloat16) if dtype.kind == "f" and not keep else dtype


# -- orbax ---------------------------------------------------------------------------------------

# Version of the parameter tree orbax checkpoints store; bumped when it changes (2: q/k/v fused into wqkv;
# 3: wqkv and wo [out, in], as HF stores the projections).
CHECKPOINT_LAYOUT = 3


def save_checkpoint(model: GptOss, directory: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Orbax checkpoint of a converted model: `directory/state` plus `directory/eagle3_jax.json`.

    Written whole or not at all, with the same folder rules as `save_gpt_oss` (a folder that is not
    empty needs overwrite=True, which replaces its checkpoint files of any kind and keeps other
    files). A model that is not a GptOss raises ValueError before anything is touched. One process
    only (under jax.distributed with several processes: ValueError; gather to one first)."""
    import orbax.checkpoint as ocp

    params.expect_module("save_checkpoint", model, GptOss)
    if jax.process_count() > 1:
        raise ValueError(f"save_checkpoint: writes from one process, found {jax.process_count()} (jax.distributed); "
                         "gather the model onto one process's devices first")
    directory = os.path.abspath(os.fspath(directory))
    folders.check_target(directory, "save_checkpoint", overwrite)
    meta = {"kind": "gpt_oss", "layout": CHECKPOINT_LAYOUT, "config": dataclasses.asdict(model.config),
            "dtype": jnp.dtype(model.dtype).name}
    state = nnx.to_pure_dict(_stored_state(model))
    with folders.staged(directory, "save_checkpoint", overwrite) as tmp:
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(os.path.join(tmp, "state"), state)
        with open(os.path.join(tmp, "eagle3_jax.json"), "w") as f:
            json.dump(meta, f, indent=1)


def restore_checkpoint(directory: str | os.PathLike, mesh=None, experts: str | None = None) -> GptOss:
    """The GptOss `save_checkpoint` wrote, on the default device, or with `mesh=` restored directly
    into `parallel.param_sharding`'s placement (orbax reads each local device's shard; the same
    as `parallel.shard(restore_checkpoint(directory), mesh)`). Raises ValueError for a folder that
    is not such a checkpoint (naming the file and key at fault in eagle3_jax.json), another
    parameter layout, or a mesh that does not divide the config (before reading any parameter).
    experts: as in `load_gpt_oss`."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    meta_file = os.path.join(directory, "eagle3_jax.json")
    if folders.is_temporary(directory):
        raise ValueError(f"{directory}: an unfinished or replaced checkpoint a writer left behind, not a checkpoint")
    if not os.path.exists(meta_file):
        previous = folders.previous_versions(directory)
        hint = f"; an interrupted save left the previous checkpoint in {previous[-1]}" if previous else ""
        raise ValueError(f"{meta_file}: not found (not an eagle3_jax checkpoint){hint}")
    meta, _ = read_config_json(meta_file)
    if meta.get("kind", "gpt_oss") != "gpt_oss":
        raise ValueError(f"{meta_file}: kind: {meta.get('kind')!r}, restore_checkpoint reads 'gpt_oss'")
    if meta.get("layout", 1) != CHECKPOINT_LAYOUT:
        raise ValueError(f"{meta_file}: parameter layout {meta.get('layout', 1)}, this version reads layout "
                         f"{CHECKPOINT_LAYOUT} (wqkv and wo [out, in]); convert the HF checkpoint again")
    try:
        c = dict(meta["config"])
        c["rope"] = RopeConfig(**c["rope"])
        config = GptOssConfig(**c)
        dtype = params.float_dtype("restore_checkpoint", meta["dtype"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{meta_file}: config or dtype: {e!r}") from None
    _check_split(config, mesh, experts)
    abstract = nnx.eval_shape(lambda: GptOss(config, dtype=dtype, rngs=nnx.Rngs(0)))
    if mesh is not None:
        parallel.placement_split(abstract, mesh, experts)
    graphdef, state = nnx.split(abstract)
    # without a mesh: the default device (orbax would otherwise restore the placement it was saved from)
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    sharding = (lambda p: one) if mesh is None else (lambda p: parallel.param_sharding(abstract, mesh, p))
    target = jax.tree_util.tree_map_with_path(
        lambda p, v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(parallel.path_name(p))),
        nnx.to_pure_dict(state))
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(os.path.join(directory, "state"), target)
    nnx.replace_by_pure_dict(state, restored)
    model = nnx.merge(graphdef, state)
    return model if mesh is None else parallel.split_experts(parallel.align_heads(model, mesh), mesh, experts)
