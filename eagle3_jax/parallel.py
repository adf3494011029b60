"""Models, caches and decode state over a `Mesh` of devices, through jax.sharding alone.

A mesh has two axes: "data" splits the batch, "model" splits the weights (tensor parallel attention,
the MoE's every expert split by its units, or with experts="expert" whole experts a device:
`split_experts`, vocabulary-parallel embedding and head). Parameters carry `NamedSharding`s
(`shard`); jit's sharding propagation (GSPMD) partitions every computation on them and inserts the
collectives, so the models' code is the same on one device and on many. `generate` / `decode` read
the mesh from the parameters (`mesh_of`) and lay the KV caches and the loop state out over it
(`constrain_cache`, `constrain_rows`, called by spec/loop.py).

Parameters are placed by one table, `GPT_OSS_SHARDING` (path -> PartitionSpec; its comments say
why), read through `param_spec` / `param_sharding`; what it does not name is replicated. The
loaders (convert: `load_gpt_oss(..., mesh=)` and the others) place each parameter by the same table
as they read it, shard by shard; `shard` and they end with `align_heads` (wqkv's rows in
head-aligned blocks, so each device projects its own heads' q, k, v). The draft (`Eagle3`) is
replicated, except the target's embedding or head where it borrows them (they keep the target's
placement, one copy).
KV caches [B, Hkv, S, D]: B over "data", Hkv over "model" (the draft's cache: B only, as its
weights are replicated). Per-row state ([B, ...]: lengths, outputs, ...): B over "data".

Several processes (after `jax.distributed.initialize`; on CPUs with the gloo collectives) run the
same calls: every process builds the same model and passes the same prompts, `make_mesh` spans the
devices of all of them, and every process gets all of the outputs.

The Pallas kernels (taken on GPUs: pallas/select.py; CPUs run the jnp references) are custom calls
that XLA can only replicate: `generate` / `decode` trace under the mesh (`spec/loop.on_mesh`), where
the models run attention, the MoE experts and the rewind on local shards (`models/shards.py`).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.checks import ArgumentError, int_arg
from eagle3_jax.formats import mxfp4
from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.models.config import Eagle3Config, GptOssConfig
from eagle3_jax.models.kv_cache import KVCache
from eagle3_jax.models.shards import AXES
from eagle3_jax.pallas import allreduce, select

# GptOss parameters, "/"-joined path -> PartitionSpec (axes not named: replicated). Matched in order,
# re.fullmatch; no match: replicated (norms, o_proj bias, router).
GPT_OSS_SHARDING = (
    # embed, lm_head [V, H]: vocabulary rows (the embedding gather and the logits are split by id)
    (r"embed|lm_head", P("model", None)),
    # wqkv [(Hq + 2 Hkv) * D, H], bqkv: outputs in `model` contiguous blocks, each one device's heads'
    # q | k | v once `align_heads` has reordered them (in q|k|v order a block would not fall on head
    # boundaries: model = 2, gpt-oss-120b: q heads 0-39 | q 40-63, k, v, and the projection's output
    # would have to be gathered every layer). Each device's projection is then its own heads' q, k, v.
    (r"layers/\d+/self_attn/wqkv", P("model", None)),
    (r"layers/\d+/self_attn/bqkv", P("model")),
    (r"layers/\d+/self_attn/sinks", P("model")),  # [Hq]: one per query head, with its head
    (r"layers/\d+/self_attn/wo", P(None, "model")),  # [H, Hq * D]: row parallel, its inputs = heads
    # experts (packed blocks, scales and biases, or dense): the leading E axis, expert parallel; a layer
    # whose MoE.expert_split is "tensor" (EXPERTS, the default) splits every expert's units instead
    # (`param_spec` -> `gpt_oss.expert_spec`; set by `split_experts` and `placement_split`)
    (r"layers/\d+/mlp/experts/\w+", P("model")),
)
_EXPERT = re.compile(r"layers/(\d+)/mlp/experts/(\w+)")
# How "model" splits the experts where the caller does not say (`split_experts`): every expert's units
# over the devices. Measured faster than whole experts a device at B=1 and 4 on 2 and 4 H100s
# (2.61 against 3.13 ms a token at tp 2 B=1, `tp_decode_experts_h100x4.json`): each device reads its
# share of each chosen expert, so no device waits on one holding most of a token's experts.
EXPERTS = "tensor"


def make_mesh(model: int = 1, data: int = 1, devices=None) -> Mesh:
    """A Mesh of data * model devices with axes ("data", "model") (GSPMD-propagated: AxisType.Auto).
    devices: a sequence of jax devices (default: all of `jax.devices()`); there must be exactly
    data * model of them. Raises ValueError naming the sizes otherwise, or for a size below 1
    (ArgumentError, also a ValueError, for a size that is no integer)."""
    model, data = int_arg("make_mesh: model", model, 1), int_arg("make_mesh: data", data, 1)
    given = devices is not None
    devices = list(devices if given else jax.devices())
    if data * model != len(devices):
        raise ValueError(f"make_mesh: data={data} * model={model} = {data * model} devices, but "
                         f"{len(devices)} {'given' if given else 'available (pass devices= for a subset)'}")
    return Mesh(np.array(devices, dtype=object).reshape(data, model), AXES, axis_types=(AxisType.Auto,) * 2)


def model_size(mesh: Mesh | AbstractMesh) -> int:
    """The size of the mesh's "model" axis (1 without one)."""
    return dict(mesh.shape).get("model", 1)


def check_mesh(config, mesh: Mesh | AbstractMesh) -> None:
    """Raises ValueError unless `mesh` (a Mesh, or an AbstractMesh: a layout planned without its
    devices) has the axes ("data", "model") and its "model" axis divides
    what `shard` splits over it: for a GptOssConfig num_key_value_heads, num_attention_heads,
    num_local_experts and vocab_size; for an Eagle3Config vocab_size where it borrows the target's
    embedding or head. The message names the axis, its size and what it must divide. A mesh
    without those axes, or a config of another kind, raises ArgumentError (also a ValueError)."""
    if not isinstance(mesh, (Mesh, AbstractMesh)) or tuple(mesh.axis_names) != AXES:
        raise ArgumentError(f"mesh: expected a jax.sharding.Mesh with axes {AXES} (parallel.make_mesh), got "
                         f"{getattr(mesh, 'axis_names', type(mesh).__name__)}")
    m = model_size(mesh)
    if isinstance(config, GptOssConfig):
        names = ("num_key_value_heads", "num_attention_heads", "num_local_experts", "vocab_size")
    elif isinstance(config, Eagle3Config):
        names = ("vocab_size",) if not (config.own_embed and config.own_lm_head) else ()
    else:
        raise ArgumentError(f"check_mesh: expected a GptOssConfig or Eagle3Config, got {type(config).__name__}")
    bad = [f"{n}={getattr(config, n)}" for n in names if getattr(config, n) % m]
    if bad:
        raise ValueError(f'mesh axis "model" of size {m} must divide {", ".join(bad)}')


def path_name(path) -> str:
    """A pytree path (jax.tree_util keys) as "/"-joined text, e.g. "layers/0/self_attn/wqkv"."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def variables(tree) -> list:
    """[(path, leaf)] of a module (its nnx.Variables), an nnx state or any pytree; the path as
    `path_name` text, without the Variable's own attribute."""
    tree = nnx.state(tree) if isinstance(tree, nnx.Module) else tree
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [(path_name(path), x) for path, x in leaves]


def gpt_oss_spec(path: str) -> P:
    """The PartitionSpec `GPT_OSS_SHARDING` gives the GptOss variable at "/"-joined `path` (no
    match: P(), replicated)."""
    return next((spec for pattern, spec in GPT_OSS_SHARDING if re.fullmatch(pattern, path)), P())


def param_sharding(module, mesh: Mesh, path) -> NamedSharding:
    """NamedSharding(mesh, param_spec(module, path)): where `shard` places the module's variable at
    `path`; `module` may be abstract (nnx.eval_shape), so loaders can place each parameter as
    they build it."""
    return NamedSharding(mesh, param_spec(module, path))


def param_spec(module, path) -> P:
    """The PartitionSpec of the module's variable at `path` (a tuple of keys or "/"-joined text):
    GptOss by `GPT_OSS_SHARDING`, its experts by their layer's split (`gpt_oss.expert_spec`); Eagle3
    replicated but for `embed` / `lm_head` when they are the target's (config.own_embed / own_lm_head
    False: the target's rows over "model")."""
    name = path if isinstance(path, str) else path_name(path)
    if isinstance(module, gpt_oss.GptOss):
        m = _EXPERT.fullmatch(name)
        if m:
            return gpt_oss.expert_spec(m.group(2), module.layers[int(m.group(1))].mlp.expert_split)
        return gpt_oss_spec(name)
    if isinstance(module, eagle3.Eagle3):
        c = module.config
        borrowed = {"embed": not c.own_embed, "lm_head": not c.own_lm_head}
        return P("model", None) if borrowed.get(name) else P()
    raise ArgumentError(f"param_spec: expected a gpt_oss.GptOss or eagle3.Eagle3, got {type(module).__name__}")


def shard(module, mesh: Mesh, experts: str | None = None):
    """Places every variable of `module` (gpt_oss.GptOss or eagle3.Eagle3) on `mesh` with the
    NamedSharding of `param_spec`, in place, and returns the module. Variables shared with another
    module (a draft borrowing the target's embedding) move for both. A GptOss's experts are split as
    `experts` says (`split_experts`; None: EXPERTS). Checks `check_mesh` first."""
    if not isinstance(module, (gpt_oss.GptOss, eagle3.Eagle3)):
        raise ArgumentError(f"shard: expected a gpt_oss.GptOss or eagle3.Eagle3, got {type(module).__name__}")
    check_mesh(module.config, mesh)
    if isinstance(module, gpt_oss.GptOss):
        split_experts(module, mesh, experts)
    for path, var in variables(module):
        var.set_value(jax.device_put(var.get_value(), param_sharding(module, mesh, path)))
    if isinstance(module, gpt_oss.GptOss):
        align_heads(module, mesh)
    return module


def align_heads(model: gpt_oss.GptOss, mesh: Mesh) -> gpt_oss.GptOss:
    """Reorders each layer's wqkv rows / bqkv (placed by the table) into model-size head-aligned
    blocks (`gpt_oss.qkv_order`: each device's contiguous block is its heads' q | k | v) and records
    it (`Attention.qkv_blocks`), in place; a layer already in that order is left as it is. The
    reorder runs on the devices (jit, the table's sharding out): no host or device holds a whole
    matrix it would not hold anyway. `shard` and the loaders with mesh= end with it."""
    M = model_size(mesh)
    moves = {}
    for i, layer in enumerate(model.layers):
        att = layer.self_attn
        if att.qkv_blocks == M:
            continue
        for name in ("wqkv", "bqkv"):
            var = getattr(att, name)
            if var is None:
                continue
            sharding = param_sharding(model, mesh, f"layers/{i}/self_attn/{name}")
            key = (name, att.qkv_blocks)
            if key not in moves:  # one program per array and order (every layer has the same shapes)
                idx = att.qkv_reorder(M)
                moves[key] = jax.jit(lambda a, idx=idx: jnp.take(a, idx, axis=0), out_shardings=sharding)
            var.set_value(moves[key](var.get_value()))
        att.qkv_blocks = M
    return model


def expert_units(config: GptOssConfig, mesh: Mesh, experts: str | None = None) -> int:
    """The intermediate units each expert array holds when `mesh` splits the experts as `experts`
    says (None: EXPERTS): config.intermediate_size, or under "tensor" that rounded up to what
    "model" divides in whole units of the layout (32-input groups of packed experts: gpt-oss-120b's
    2880 over 4 devices holds 2944)."""
    experts = EXPERTS if experts is None else experts
    if experts not in gpt_oss.EXPERT_SPLITS:
        raise ArgumentError(f"experts: {experts!r}, expected one of {gpt_oss.EXPERT_SPLITS}")
    I = config.intermediate_size
    if experts == "expert":
        return I
    step = model_size(mesh) * (mxfp4.BLOCK if config.experts_format == "mxfp4" else 1)
    return -(-I // step) * step


def placement_split(model: gpt_oss.GptOss, mesh: Mesh, experts: str | None = None) -> gpt_oss.GptOss:
    """Sets every layer's `MoE.expert_split` of `model` (an abstract GptOss that a loader or
    `random_gpt_oss` is about to fill, nnx.eval_shape) to the split its experts can be created in
    directly, so that `param_sharding` places them so as they are read: `experts` (None: EXPERTS)
    where it needs no padding (`expert_units` == intermediate_size: gpt-oss-120b over 2 devices),
    else "expert" (whole experts), from which `split_experts` then pads and moves them. In place;
    returns `model`."""
    experts = EXPERTS if experts is None else experts
    direct = experts if expert_units(model.config, mesh, experts) == model.config.intermediate_size else "expert"
    for layer in model.layers:
        layer.mlp.expert_split = direct
    return model


def split_experts(model: gpt_oss.GptOss, mesh: Mesh, experts: str | None = None) -> gpt_oss.GptOss:
    """Sets every layer's `MoE.expert_split` to `experts` (None: EXPERTS; "expert": each device
    E / model whole experts; "tensor": each device its share of every expert's intermediate units,
    the arrays padded to `expert_units` with units that add nothing, `gpt_oss.resize_units`) and
    places the expert arrays so (jit on the devices, the new sharding out), in place. `shard` and the
    loaders with mesh= call it; the writers store the experts unpadded."""
    experts = EXPERTS if experts is None else experts
    units = expert_units(model.config, mesh, experts)
    moves = {}
    for i, layer in enumerate(model.layers):
        moe = layer.mlp
        if moe.expert_split == experts and moe.experts.gate_up_bias.shape[1] == 2 * units:
            continue  # already so (created so: `placement_split`)
        moe.expert_split = experts
        for name, var in vars(moe.experts).items():
            if not isinstance(var, nnx.Variable):
                continue
            if name not in moves:  # one program per array (every layer has the same shapes)
                sharding = param_sharding(model, mesh, f"layers/{i}/mlp/experts/{name}")
                moves[name] = jax.jit(lambda a, name=name: gpt_oss.resize_units(name, a, units),
                                      out_shardings=sharding)
            value = var.get_value()
            if value.sharding.device_set != set(mesh.devices.flat):  # first onto the mesh, whole experts each
                value = jax.device_put(value, NamedSharding(mesh, gpt_oss.expert_spec(name, "expert")))
            var.set_value(moves[name](value))
    return model


_MAILBOXES: dict = {}


def mailbox(mesh: Mesh | None, hidden: int) -> allreduce.Mailbox | None:
    """The Mailbox (pallas/allreduce.py) that decode programs on `mesh` pass to the one-shot
    all-reduce kernel, for rows of `hidden`: made on first use and shared by every program on the
    mesh (its flags count the calls, which every device makes alike). None where the kernel does not
    run: no mesh, one device along "model", not `select.tp_kernel(hidden)`, or model groups whose
    GPUs cannot reach each other's memory (`allreduce.shared_memory_problem`: across hosts, or
    several devices of a group in one process and others elsewhere). Across processes every process
    must ask alike (it gathers from all of them)."""
    if mesh is None or model_size(mesh) == 1 or not select.tp_kernel(hidden):
        return None
    key = (mesh, hidden)
    if key not in _MAILBOXES:
        hosts = allreduce.process_hosts() if mesh.is_multi_process else None
        shared = allreduce.shared_memory_problem(mesh, "model", hosts) is None
        _MAILBOXES[key] = allreduce.new_mailbox(mesh, hidden, hosts=hosts) if shared else None
    return _MAILBOXES[key]


def mesh_of(tree) -> Mesh | None:
    """The mesh that the arrays of `tree` (a module, its nnx state, or any pytree) are placed on
    through NamedShardings; None when none is. Raises ValueError when some are on a mesh and others
    are not, or on another mesh (e.g. a target sharded and its draft not: `shard` both)."""
    leaves = [(path, x.get_value() if isinstance(x, nnx.Variable) else x) for path, x in variables(tree)]
    arrays = [(path, x) for path, x in leaves if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]
    meshes = {x.sharding.mesh for _, x in arrays if isinstance(x.sharding, NamedSharding)}
    if not meshes:
        return None
    if len(meshes) > 1:
        raise ValueError(f"mesh_of: arrays on {len(meshes)} different meshes: {sorted(map(str, meshes))}")
    mesh = meshes.pop()
    for path, x in arrays:
        if not isinstance(x.sharding, NamedSharding):
            raise ValueError(f"mesh_of: {path} is on {x.sharding}, not on the mesh {mesh} of the "
                             "other arrays; place every module with parallel.shard(module, mesh)")
    return mesh


def cache_spec(heads: bool = True) -> P:
    """KV buffers [B, Hkv, S, D]: B over "data", Hkv over "model" (heads False: replicated over it)."""
    return P("data", "model" if heads else None, None, None)


def constrain_cache(cache: KVCache | None, mesh: Mesh, heads: bool = True) -> KVCache | None:
    """`cache` with every buffer constrained to `cache_spec(heads)` on `mesh` (inside jit); None: None."""
    if cache is None:
        return None
    s = NamedSharding(mesh, cache_spec(heads))
    wsc = jax.lax.with_sharding_constraint
    return cache.replace(k=tuple(wsc(k, s) for k in cache.k), v=tuple(wsc(v, s) for v in cache.v))


def constrain_rows(x, mesh: Mesh):
    """x [B, ...] constrained to its leading (batch) axis over "data", the rest replicated (inside
    jit; a B that "data" does not divide is padded by XLA); None: None."""
    if x is None:
        return None
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))


def constrain_replicated(x, mesh: Mesh):
    """x (a pytree of arrays) constrained whole onto every device of `mesh` (inside jit)."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


def put_rows(x, mesh: Mesh):
    """A host array [B, ...] placed on `mesh` with its rows over "data" (B a multiple of it: spec/decode.py
    pads the batch)."""
    return jax.device_put(x, NamedSharding(mesh, P("data")))


def replicate(x, mesh: Mesh):
    """x (a pytree of host arrays or PRNG keys, the same on every process) placed whole on every
    device of `mesh`. Keys go as their data (device_put takes no key array onto devices of other
    processes)."""
    s = NamedSharding(mesh, P())

    def put(a):
        if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(jax.device_put(np.asarray(jax.random.key_data(a)), s),
                                            impl=jax.random.key_impl(a))
        return jax.device_put(a, s)

    return jax.tree.map(put, x)
