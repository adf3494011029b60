"""Devices: meshes, the sharding table, the run context, and model code on local shards. The one
module that knows about devices.

A mesh has two axes: "data" splits the batch, "model" splits the weights (tensor parallel attention,
the MoE's every expert split by its units, or with experts="expert" whole experts a device,
vocabulary-parallel embedding and head). Parameters carry `NamedSharding`s placed by one table,
`GPT_OSS_SHARDING` (path -> PartitionSpec), read through `param_partition`; what it does not name is
replicated. `shard` (and the loaders with mesh=) place a module's parameters; `generate` / `decode`
read the mesh from them (`mesh_of`) and lay the KV caches and the loop state out over it. The
draft (`Eagle3`) is replicated but for the target's embedding or head where it borrows them.

How a program runs is one immutable value, `RunContext` (`context` makes it): the mesh (None: one
device), the kernel policy (`pallas.select.KernelPolicy`), XLA's compiler options and the all-reduce
`Mailbox`. The models' and the loop's functions take it as their `ctx` argument; nothing is read
from an ambient context. Under a mesh of several devices the models run attention, the MoE experts,
the norms' kernels and the spec ops through `RunContext.local` (`jax.shard_map`, each device on its
rows and heads or experts): Pallas kernels are custom calls that XLA's partitioner can only
replicate. GEMMs stay with XLA's sharding propagation. With "model" > 1, decode-sized steps sum each
sublayer's partial outputs over "model" fused with the residual add and the next norm
(`reduce_add_norm`), and the pick over a split vocabulary exchanges each device's best
(`vocab_argmax`): the one-shot kernel of pallas/allreduce.py where the context has a Mailbox, else
lax.psum.

Several processes (after `jax.distributed.initialize`) run the same calls: every process builds the
same model and passes the same prompts, `make_mesh` spans the devices of all of them, and every
process gets all of the outputs.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.checks import ArgumentError, int_arg
from eagle3_jax.formats import mxfp4
from eagle3_jax.models.config import Eagle3Config, GptOssConfig
from eagle3_jax.pallas import allreduce, select

KernelPolicy = select.KernelPolicy  # here too: a RunContext's kernels, `parallel.KernelPolicy(attention=...)`

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# -- the sharding table: PartitionSpecs named for what they lay out ------------------------------------
BATCH = P(DATA)  # per-row arrays [B, ...]: rows over "data"
BATCH_HEADS = P(DATA, MODEL)  # KV caches [B, Hkv, S, D]: rows over "data", kv heads over "model"
VOCAB = P(MODEL, None)  # an embedding or head [V, H]: vocabulary rows over "model"
PARTIALS = P(MODEL, DATA)  # each "model" device's partial sums f32 [M, N, H], N = B * T rows over "data"
REPLICATED = P()

# GptOss parameters, "/"-joined path -> PartitionSpec (axes not named: replicated). Matched in order,
# re.fullmatch; no match: replicated (norms, o_proj bias, router).
GPT_OSS_SHARDING = (
    # embed, lm_head [V, H]: vocabulary rows (the embedding gather and the logits are split by id)
    (r"embed|lm_head", VOCAB),
    # wqkv [(Hq + 2 Hkv) * D, H], bqkv: outputs in `model` contiguous blocks, each one device's heads'
    # q | k | v once `align_heads` has reordered them (in q|k|v order a block would not fall on head
    # boundaries, and the projection's output would have to be gathered every layer).
    (r"layers/\d+/self_attn/wqkv", P(MODEL, None)),
    (r"layers/\d+/self_attn/bqkv", P(MODEL)),
    (r"layers/\d+/self_attn/sinks", P(MODEL)),  # [Hq]: one per query head, with its head
    (r"layers/\d+/self_attn/wo", P(None, MODEL)),  # [H, Hq * D]: row parallel, its inputs = heads
    # experts: by their layer's MoE.expert_split (`expert_partition`); this row is "expert"'s
    (r"layers/\d+/mlp/experts/\w+", P(MODEL)),
)
_EXPERT = re.compile(r"layers/(\d+)/mlp/experts/(\w+)")
EXPERT_SPLITS = ("expert", "tensor")  # how "model" splits the experts: whole experts, or every expert's units
# Where the caller does not say: every expert's units over the devices, so that no device waits on one
# holding most of a token's experts (docs/perf/multi_gpu.md).
EXPERTS = "tensor"
# expert array -> (its intermediate-units axis, entries of that axis a unit): gate_up's rows are
# interleaved (gate, up) pairs, down's inputs come in 32-unit MXFP4 groups of 16 bytes
_UNITS = {"gate_up_blocks": (1, 2), "gate_up_scales": (1, 2), "gate_up_bias": (1, 2), "gate_up": (1, 2),
          "down_blocks": (2, 1 / mxfp4.BLOCK), "down_scales": (2, 1 / mxfp4.BLOCK), "down": (2, 1)}


def expert_partition(name: str, split: str) -> P:
    """The PartitionSpec of the expert array `name` (an Mxfp4Experts or DenseExperts attribute) under
    `split`: "expert", the leading E axis over "model" (each device whole experts); "tensor", every
    expert's intermediate units over "model" (gate_up's rows, down's input groups or columns; down's
    bias replicated, added by one device)."""
    if split == "expert":
        return P(MODEL)
    if name not in _UNITS:
        return REPLICATED
    return P(*([None] * _UNITS[name][0]), MODEL)


def resize_units(name: str, a, units: int):
    """Expert array `name` holding `units` intermediate units: cut, or padded at the end with zero
    blocks and biases and scale byte 127 (x 1), so that a padded unit's activation is 0 and adds
    nothing. Arrays without units are returned as they are."""
    if name not in _UNITS:
        return a
    axis, per = _UNITS[name]
    n = int(units * per)
    if n <= a.shape[axis]:
        return a[(slice(None),) * axis + (slice(0, n),)]
    width = [(0, 0)] * a.ndim
    width[axis] = (0, n - a.shape[axis])
    return jnp.pad(a, width, constant_values=127 if name.endswith("_scales") else 0)


def cache_partition(heads: bool = True) -> P:
    """KV buffers [B, Hkv, S, D]: B over "data", Hkv over "model" (heads False: replicated over it)."""
    return P(DATA, MODEL if heads else None, None, None)


# -- the run context ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunContext:
    """How a program runs, passed to the models and the loop as `ctx`. mesh: a `make_mesh` Mesh of
    several devices, or None (one device: no shard_map, no collectives); kernels: which
    implementation each op takes (`select.KernelPolicy`; AUTO: by platform and shape);
    compiler_options: XLA options the loop's program compiles with, ((name, value), ...);
    mailbox: the one-shot all-reduce's `allreduce.Mailbox` for this mesh, or None (lax.psum).
    A pytree: the mailbox's arrays are its leaves (a compiled program takes them as arguments),
    the rest is static. Make one with `context`; `RunContext()` is one device, automatic kernels."""
    mesh: Mesh | None = None
    kernels: select.KernelPolicy = select.AUTO
    compiler_options: tuple = ()
    mailbox: allreduce.Mailbox | None = None

    def __post_init__(self):
        if self.mesh is not None and (not isinstance(self.mesh, Mesh) or tuple(self.mesh.axis_names) != AXES):
            raise ArgumentError(f"RunContext: mesh must be a jax.sharding.Mesh with axes {AXES} "
                                f"(parallel.make_mesh) or None, got {self.mesh!r}")
        if not isinstance(self.kernels, select.KernelPolicy):
            raise ArgumentError(f"RunContext: kernels must be a pallas.select.KernelPolicy, got "
                                f"{type(self.kernels).__name__}")

    @property
    def model_size(self) -> int:
        """Devices along "model" (1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.shape[MODEL]

    def rows_per_device(self, n: int) -> int:
        """Of n rows split over "data", the rows each device holds (n without a mesh)."""
        return n if self.mesh is None else n // self.mesh.shape[DATA]

    def local(self, fn, in_specs, out_specs):
        """fn on each device's shards (`jax.shard_map` over the mesh; specs as shard_map's, None
        arguments pass through), or fn itself without a mesh."""
        if self.mesh is None:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def reduces_fused(self, x) -> bool:
        """Whether a step of tokens [B, T] (or on the residual stream x [B, T, H]) sums its embedding
        lookup and its sublayers' partial outputs with `reduce_add_norm` ("model" > 1 and at most
        allreduce.MAX_ROWS rows a device: decode and verify), rather than leaving the sums to XLA's
        all-reduce (prefill, one device)."""
        return self.model_size > 1 and self.rows_per_device(x.shape[0] * x.shape[1]) <= allreduce.MAX_ROWS

    @property
    def options(self) -> dict:
        """compiler_options as the dict `Lowered.compile` takes."""
        return dict(self.compiler_options)


jax.tree_util.register_dataclass(RunContext, data_fields=["mailbox"],
                                 meta_fields=["mesh", "kernels", "compiler_options"])

ONE_DEVICE = RunContext()  # the models' default: one device, automatic kernels


def context(mesh: Mesh | None = None, *, hidden: int | None = None, kernels: select.KernelPolicy | None = None,
            compiler_options: dict | None = None, reduce_timeout_ms: int | None = None) -> RunContext:
    """The RunContext for programs on `mesh` (None, or a mesh of one device: one device). hidden: the
    target's hidden size, for the all-reduce Mailbox (`mailbox`; None: no Mailbox, lax.psum);
    kernels: None is `select.AUTO`; compiler_options: None is `select.compiler_options()` (on GPUs
    every loop a CUDA graph), {} none; reduce_timeout_ms: how long the fused all-reduce waits for a
    peer before it fails the program (`allreduce.Mailbox.timeout_ms`; None: its default)."""
    mesh = None if mesh is None or mesh.size == 1 else mesh
    if mesh is not None:
        check_axes(mesh)
    options = select.compiler_options() if compiler_options is None else compiler_options
    box = None if hidden is None else mailbox(mesh, hidden)
    if box is not None and reduce_timeout_ms is not None:
        box = dataclasses.replace(box, timeout_ms=reduce_timeout_ms)
    return RunContext(mesh=mesh, kernels=select.AUTO if kernels is None else kernels,
                      compiler_options=tuple(sorted(options.items())), mailbox=box)


def context_for(target, *, kernels: select.KernelPolicy | None = None, compiler_options: dict | None = None,
                reduce_timeout_ms: int | None = None) -> RunContext:
    """The RunContext `generate` / `decode` run a GptOss `target` in unless given one: the mesh its
    parameters are on (`mesh_of`; one device: None), its hidden size's Mailbox there, `kernels` (None:
    automatic), `compiler_options` (None: `select.compiler_options()`) and `reduce_timeout_ms`
    (`context`)."""
    return context(mesh_of(target), hidden=target.config.hidden_size, kernels=kernels,
                   compiler_options=compiler_options, reduce_timeout_ms=reduce_timeout_ms)


def failure_report() -> str | None:
    """Why a program of this process failed in the fused all-reduce (`allreduce.failure_report`: the
    reduction, the device and the peer it waited for), or None. Callers that catch a device error
    (`generate`, `decode`) add it to their message."""
    return allreduce.failure_report()


_MAILBOXES: dict = {}  # (mesh, hidden) -> Mailbox or None; see `mailbox`


def mailbox(mesh: Mesh | None, hidden: int) -> allreduce.Mailbox | None:
    """The Mailbox (pallas/allreduce.py) of the one-shot all-reduce kernel on `mesh`, for rows of
    `hidden`: made on first use and shared by every program on the mesh (its flags count the calls,
    which every device makes alike; its memory lies outside XLA and is never freed, so one a mesh
    and width is kept for the process's life: a process holds few meshes). None where the kernel
    does not run: no mesh, one device along "model", not `select.tp_kernel(hidden)`, or model groups
    whose GPUs cannot reach each other's memory (`allreduce.shared_memory_problem`). Across
    processes every process must ask alike (it gathers from all of them)."""
    if mesh is None or model_size(mesh) == 1 or not select.tp_kernel(hidden):
        return None
    key = (mesh, hidden)
    if key not in _MAILBOXES:
        hosts = allreduce.process_hosts() if mesh.is_multi_process else None
        shared = allreduce.shared_memory_problem(mesh, MODEL, hosts) is None
        _MAILBOXES[key] = allreduce.new_mailbox(mesh, hidden, hosts=hosts) if shared else None
    return _MAILBOXES[key]


# -- model code on local shards (functions of the run context) -------------------------------------

def vocab_rows(ctx: RunContext, table, ids, partial: bool = False):
    """table[ids] for a table [V, H] split as VOCAB: each device looks up the ids in its rows (zero
    rows for the others') and the rows are summed over "model" (one value and zeros: exact).
    ids [B, ...] over "data". Stated rather than left to XLA's partitioner, which at one row
    gathered the whole table instead. partial=True (under a mesh): each device's lookup instead,
    not summed, f32 [M, N, H] (PARTIALS, N = ids.size), for `reduce_add_norm`."""
    if ctx.mesh is None:
        return table[ids]

    def body(t, i):
        n = t.shape[0]
        j = i - lax.axis_index(MODEL) * n
        mine = (j >= 0) & (j < n)
        rows = jnp.where(mine[..., None], t[jnp.clip(j, 0, n - 1)], jnp.zeros((), t.dtype))
        if partial:
            return rows.reshape(1, -1, t.shape[-1]).astype(jnp.float32)
        return lax.psum(rows, MODEL)

    return ctx.local(body, (VOCAB, BATCH), PARTIALS if partial else BATCH)(table, ids)


def vocab_logits(ctx: RunContext, h, w):
    """float32 h @ w.T for h [B, ..., H] (rows over "data") and w [V, H] split as VOCAB: each device
    its vocabulary columns, the logits [B, ..., V] left split over "model". Stated rather than left
    to XLA's partitioner, which at one row gathered the whole head first."""
    def body(h, w):
        return jnp.einsum("...h,vh->...v", h, w, preferred_element_type=jnp.float32)

    if ctx.mesh is None:
        return body(h, w)
    return ctx.local(body, (BATCH, VOCAB), P(DATA, *([None] * (h.ndim - 2)), MODEL))(h, w)


def reduce_add_norm(ctx: RunContext, part, x, norm):
    """part: each "model" device's partial output of a sublayer, f32 [M, N, H] (PARTIALS, N = B * T),
    x: the residual stream [B, T, H], norm: the RMSNorm module after the sum -> (s, norm(s)), s = x +
    the sum of the partials (pallas/allreduce.py's function: the sum in f32, s rounded to x.dtype).
    One kernel on each device where `select.tp_reduce` says so (the context's Mailbox), else lax.psum."""
    box = ctx.mailbox
    kernel = select.tp_reduce(x, ctx.rows_per_device(part.shape[1]), part.shape[0], box,
                              policy=ctx.kernels) == "kernel"

    def body(p, r, scale, *box):
        shape = r.shape
        args = (p[0], r.reshape(-1, shape[-1]), scale)
        if kernel:
            s, y = allreduce.allreduce_add_rms_norm(*args, *box, eps=norm.eps, axis=MODEL)
        else:
            s, y = allreduce.allreduce_add_rms_norm_reference(*args, eps=norm.eps, axis=MODEL)
        return s.reshape(shape), y.reshape(shape)

    boxes = (box,) if kernel else ()
    specs = (PARTIALS, BATCH, REPLICATED) + (P(AXES),) * len(boxes)
    return ctx.local(body, specs, (BATCH, BATCH))(part, x, norm.scale[...], *boxes)


def vocab_argmax(ctx: RunContext, logits):
    """jnp.argmax(logits, -1) (the first index among equal maxima; a NaN counts as the maximum) for
    logits f32 [B, ..., V] as `vocab_logits` leaves them, int32 [B, ...]. Where "model" > 1 splits V,
    each device takes the maximum and first index of its columns and the devices exchange them as a
    sum of slots, one a device (its value and zeros: exact; V <= 2^24 keeps an index exact in f32):
    the one-shot kernel of pallas/allreduce.py where `select.tp_pick` says so, else lax.psum. With
    the kernel a decode step holds no NCCL call (docs/perf/multi_gpu.md)."""
    M, V = ctx.model_size, logits.shape[-1]
    if M == 1:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if V > 1 << 24:
        raise ValueError(f"vocab_argmax: a vocabulary of {V} entries; indices exchanged in f32 need V <= 2^24")
    lead = logits.shape[:-1]
    rows = ctx.rows_per_device(int(np.prod(lead)))
    box = ctx.mailbox
    kernel = select.tp_pick(rows, M, box, policy=ctx.kernels) == "kernel"

    def body(z, *box):
        shape = z.shape[:-1]
        z = z.reshape(-1, z.shape[-1])
        me = lax.axis_index(MODEL)
        i = jnp.argmax(z, axis=-1)
        top = jnp.take_along_axis(z, i[:, None], -1)[:, 0]
        mine = jnp.stack([top, (i + me * z.shape[-1]).astype(jnp.float32)], -1)
        local_box = box[0] if kernel else None
        width = allreduce.row_width(local_box) if kernel else 2 * M
        slots = jnp.where(jnp.arange(width) // 2 == me, jnp.tile(mine, (1, width // 2)), 0.0)
        if kernel:
            zero, one = jnp.zeros_like(slots), jnp.ones((width,), jnp.float32)
            slots = allreduce.allreduce_add_rms_norm(slots, zero, one, local_box, eps=1.0, axis=MODEL)[0]
        else:
            slots = lax.psum(slots, MODEL)
        pairs = slots[:, :2 * M].reshape(-1, M, 2)
        best = jnp.argmax(pairs[..., 0], axis=-1)  # the first device among equal maxima: the lowest index
        pick = jnp.take_along_axis(pairs[..., 1], best[:, None], -1)[:, 0]
        return pick.astype(jnp.int32).reshape(shape)

    boxes = (box,) if kernel else ()
    in_specs = (P(DATA, *([None] * (len(lead) - 1)), MODEL),) + (P(AXES),) * len(boxes)
    return ctx.local(body, in_specs, BATCH)(logits, *boxes)


# -- meshes and placing modules on them -----------------------------------------------------------

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
    return dict(mesh.shape).get(MODEL, 1)


def check_axes(mesh) -> None:
    """Raises ArgumentError (a ValueError) unless `mesh` is a Mesh or AbstractMesh with axes AXES."""
    if not isinstance(mesh, (Mesh, AbstractMesh)) or tuple(mesh.axis_names) != AXES:
        raise ArgumentError(f"mesh: expected a jax.sharding.Mesh with axes {AXES} (parallel.make_mesh), got "
                            f"{getattr(mesh, 'axis_names', type(mesh).__name__)}")


def check_mesh(config, mesh: Mesh | AbstractMesh) -> None:
    """Raises ValueError unless `mesh` (a Mesh, or an AbstractMesh: a layout planned without its
    devices) has the axes ("data", "model") and its "model" axis divides
    what `shard` splits over it: for a GptOssConfig num_key_value_heads, num_attention_heads,
    num_local_experts and vocab_size; for an Eagle3Config vocab_size where it borrows the target's
    embedding or head. The message names the axis, its size and what it must divide. A mesh
    without those axes, or a config of another kind, raises ArgumentError (also a ValueError)."""
    check_axes(mesh)
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


def gpt_oss_partition(path: str) -> P:
    """The PartitionSpec `GPT_OSS_SHARDING` gives the GptOss variable at "/"-joined `path` (no
    match: P(), replicated)."""
    return next((part for pattern, part in GPT_OSS_SHARDING if re.fullmatch(pattern, path)), REPLICATED)


def param_sharding(module, mesh: Mesh, path) -> NamedSharding:
    """NamedSharding(mesh, param_partition(module, path)): where `shard` places the module's variable at
    `path`; `module` may be abstract (nnx.eval_shape), so loaders can place each parameter as
    they build it."""
    return NamedSharding(mesh, param_partition(module, path))


def _kind(module) -> str:
    """"gpt_oss" or "eagle3" by the module's config; ArgumentError for anything else."""
    config = getattr(module, "config", None)
    if isinstance(config, GptOssConfig):
        return "gpt_oss"
    if isinstance(config, Eagle3Config):
        return "eagle3"
    raise ArgumentError(f"expected a gpt_oss.GptOss or eagle3.Eagle3, got {type(module).__name__}")


def param_partition(module, path) -> P:
    """The PartitionSpec of the module's variable at `path` (a tuple of keys or "/"-joined text):
    GptOss by `GPT_OSS_SHARDING`, its experts by their layer's split (`expert_partition`); Eagle3
    replicated but for `embed` / `lm_head` when they are the target's (config.own_embed / own_lm_head
    False: the target's rows over "model")."""
    name = path if isinstance(path, str) else path_name(path)
    if _kind(module) == "gpt_oss":
        m = _EXPERT.fullmatch(name)
        if m:
            return expert_partition(m.group(2), module.layers[int(m.group(1))].mlp.expert_split)
        return gpt_oss_partition(name)
    c = module.config
    borrowed = {"embed": not c.own_embed, "lm_head": not c.own_lm_head}
    return VOCAB if borrowed.get(name) else REPLICATED


def shard(module, mesh: Mesh, experts: str | None = None):
    """Places every variable of `module` (gpt_oss.GptOss or eagle3.Eagle3) on `mesh` with the
    NamedSharding of `param_partition`, in place, and returns the module. Variables shared with another
    module (a draft borrowing the target's embedding) move for both. A GptOss's experts are split as
    `experts` says (`split_experts`; None: EXPERTS). Checks `check_mesh` first."""
    kind = _kind(module)
    check_mesh(module.config, mesh)
    if kind == "gpt_oss":
        split_experts(module, mesh, experts)
    for path, var in variables(module):
        var.set_value(jax.device_put(var.get_value(), param_sharding(module, mesh, path)))
    if kind == "gpt_oss":
        align_heads(module, mesh)
    return module


def align_heads(model, mesh: Mesh):
    """Reorders each layer's wqkv rows / bqkv of a GptOss `model` (placed by the table) into model-size
    head-aligned blocks (`gpt_oss.qkv_order`: each device's contiguous block is its heads' q | k | v) and records
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
    if experts not in EXPERT_SPLITS:
        raise ArgumentError(f"experts: {experts!r}, expected one of {EXPERT_SPLITS}")
    I = config.intermediate_size
    if experts == "expert":
        return I
    step = model_size(mesh) * (mxfp4.BLOCK if config.experts_format == "mxfp4" else 1)
    return -(-I // step) * step


def placement_split(model, mesh: Mesh, experts: str | None = None):
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


def split_experts(model, mesh: Mesh, experts: str | None = None):
    """Sets every layer's `MoE.expert_split` to `experts` (None: EXPERTS; "expert": each device
    E / model whole experts; "tensor": each device its share of every expert's intermediate units,
    the arrays padded to `expert_units` with units that add nothing, `resize_units`) of a GptOss and
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
                moves[name] = jax.jit(lambda a, name=name: resize_units(name, a, units),
                                      out_shardings=sharding)
            value = var.get_value()
            if value.sharding.device_set != set(mesh.devices.flat):  # first onto the mesh, whole experts each
                value = jax.device_put(value, NamedSharding(mesh, expert_partition(name, "expert")))
            var.set_value(moves[name](value))
    return model


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


def constrain_cache(cache, mesh: Mesh, heads: bool = True):
    """`cache` (a models.kv_cache.KVCache) with every buffer constrained to `cache_partition(heads)` on
    `mesh` (inside jit); None: None."""
    if cache is None:
        return None
    s = NamedSharding(mesh, cache_partition(heads))
    wsc = jax.lax.with_sharding_constraint
    return cache.replace(k=tuple(wsc(k, s) for k in cache.k), v=tuple(wsc(v, s) for v in cache.v))


def constrain_rows(x, mesh: Mesh):
    """x [B, ...] constrained to its leading (batch) axis over "data", the rest replicated (inside
    jit; a B that "data" does not divide is padded by XLA); None: None."""
    if x is None:
        return None
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, BATCH))


def constrain_replicated(x, mesh: Mesh):
    """x (a pytree of arrays) constrained whole onto every device of `mesh` (inside jit)."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, REPLICATED))


def put_rows(x, mesh: Mesh):
    """A host array [B, ...] placed on `mesh` with its rows over "data" (B a multiple of it: spec/decode.py
    pads the batch)."""
    return jax.device_put(x, NamedSharding(mesh, BATCH))


def replicate(x, mesh: Mesh):
    """x (a pytree of host arrays or PRNG keys, the same on every process) placed whole on every
    device of `mesh`. Keys go as their data (device_put takes no key array onto devices of other
    processes)."""
    s = NamedSharding(mesh, REPLICATED)

    def put(a):
        if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(jax.device_put(np.asarray(jax.random.key_data(a)), s),
                                            impl=jax.random.key_impl(a))
        return jax.device_put(a, s)

    return jax.tree.map(put, x)
