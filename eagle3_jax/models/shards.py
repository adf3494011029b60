"""Model code on local shards: the one place the models meet a device mesh.

A computation traced under `jax.sharding.use_abstract_mesh(mesh.abstract_mesh)` of a mesh with
axes ("data", "model") and more than one device (`spec/loop.py` traces `generate` / `decode` so when
the parameters are sharded: `eagle3_jax.parallel`) runs its attention, its MoE experts and the KV
rewind through `local`: `jax.shard_map` over the mesh, each device on its rows (B over "data") and
its heads or experts (over "model"), so that the Pallas kernels inside, custom calls that XLA's
partitioner can only replicate, see local arrays; the target's embedding and logits are split by
vocabulary rows the same way (`vocab_rows`, `vocab_logits`). Everything else (the GEMMs) stays with
XLA's sharding propagation. With no such mesh in context `local(fn, ...)` is
`fn`: one device, and code traced without the context (gpt_oss.forward on its own, training).

With "model" > 1, decode-sized steps sum the embedding lookup and each sublayer's partial outputs
over "model" in one call fused with the residual add and the next norm (`reduce_add_norm`, where
`reduces_fused`; `vocab_rows(..., partial=True)` gives the lookup's partials), and the step's pick
over the split vocabulary exchanges each device's best the same way (`vocab_argmax`): on GPUs the
one-shot kernel of pallas/allreduce.py, whose `Mailbox` (buffers that outlive each call) a program
passes in as an argument and traces under `mailbox_context` (`spec/loop.py`); without one,
`lax.psum`. No XLA collective is left in a decode step.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from eagle3_jax.pallas import allreduce, select

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
ROWS = P(DATA)  # [B, ...]: rows over "data"
HEADS = P(DATA, MODEL)  # KV caches [B, Hkv, S, D]: rows over "data", kv heads over "model"


def mesh():
    """The abstract mesh in context if it has AXES and more than one device, else None."""
    m = jax.sharding.get_abstract_mesh()
    if m.empty or m.size == 1 or tuple(m.axis_names) != AXES:
        return None
    return m


def model_size() -> int:
    """Devices along "model" of the mesh in context (1 without one)."""
    m = mesh()
    return 1 if m is None else m.shape[MODEL]


def rows_per_device(n: int) -> int:
    """Of n rows split over "data" in the mesh in context, the rows each device holds (n without one)."""
    m = mesh()
    return n if m is None else n // m.shape[DATA]


def local(fn, in_specs, out_specs):
    """fn on each device's shards (`jax.shard_map` over the mesh in context; specs as shard_map's,
    None arguments pass through), or fn itself where there is no such mesh."""
    m = mesh()
    if m is None:
        return fn
    return jax.shard_map(fn, mesh=m, in_specs=in_specs, out_specs=out_specs, check_vma=False)


VOCAB = P(MODEL, None)  # an embedding or head [V, H]: vocabulary rows over "model"


def vocab_rows(table, ids, partial: bool = False):
    """table[ids] for a table [V, H] split as VOCAB: each device looks up the ids in its rows (zero
    rows for the others') and the rows are summed over "model" (one value and zeros: exact).
    ids [B, ...] over "data". Stated rather than left to XLA's partitioner, which at one row (batch
    1 decode on GPUs) gathered the whole table instead. partial=True (under a mesh): each device's
    lookup instead, not summed, f32 [M, N, H] (P("model", "data"), N = ids.size), for a caller that
    sums it with its next step (`reduce_add_norm`)."""
    if mesh() is None:
        return table[ids]

    def body(t, i):
        n = t.shape[0]
        j = i - lax.axis_index(MODEL) * n
        mine = (j >= 0) & (j < n)
        rows = jnp.where(mine[..., None], t[jnp.clip(j, 0, n - 1)], jnp.zeros((), t.dtype))
        if partial:
            return rows.reshape(1, -1, t.shape[-1]).astype(jnp.float32)
        return lax.psum(rows, MODEL)

    return local(body, (VOCAB, ROWS), P(MODEL, DATA) if partial else ROWS)(table, ids)


def vocab_logits(h, w):
    """float32 h @ w.T for h [B, ..., H] (rows over "data") and w [V, H] split as VOCAB: each device
    its vocabulary columns, the logits [B, ..., V] left split over "model". Stated rather than left
    to XLA's partitioner, which at one row (batch 1 decode on GPUs) gathered the whole head first
    (2.2 ms of all-gather a token on 2 H100s)."""
    def body(h, w):
        return jnp.einsum("...h,vh->...v", h, w, preferred_element_type=jnp.float32)

    if mesh() is None:
        return body(h, w)
    return local(body, (ROWS, VOCAB), P(DATA, *([None] * (h.ndim - 2)), MODEL))(h, w)


_MAILBOXES: list = []  # the Mailbox of each program being traced (innermost last)


@contextlib.contextmanager
def mailbox_context(mailbox):
    """Trace under this to give the models `mailbox` (a pallas.allreduce.Mailbox among the program's
    arguments, or None)."""
    _MAILBOXES.append(mailbox)
    try:
        yield
    finally:
        _MAILBOXES.pop()


def mailbox():
    """The Mailbox in context (`mailbox_context`), or None."""
    return _MAILBOXES[-1] if _MAILBOXES else None


def reduces_fused(x) -> bool:
    """Whether a step of tokens [B, T] (or on the residual stream x [B, T, H]) sums its embedding
    lookup and its sublayers' partial outputs with `reduce_add_norm` (a mesh with "model" > 1 and at
    most allreduce.MAX_ROWS rows a device: decode and verify), rather than leaving the sums to XLA's
    all-reduce (prefill, one device)."""
    return model_size() > 1 and rows_per_device(x.shape[0] * x.shape[1]) <= allreduce.MAX_ROWS


def reduce_add_norm(part, x, norm):
    """part: each "model" device's partial output of a sublayer, f32 [M, N, H] (P("model", "data"),
    N = B * T), x: the residual stream [B, T, H], norm: the RMSNorm module after the sum -> (s,
    norm(s)), s = x + the sum of the partials (pallas/allreduce.py's function: the sum in f32, s
    rounded to x.dtype). One kernel on each device where `select.tp_reduce` says so (with a Mailbox
    in context: `mailbox`), else lax.psum."""
    box = mailbox()
    kernel = select.tp_reduce(x, rows_per_device(part.shape[1]), part.shape[0], box) == "kernel"

    def body(p, r, scale, *box):
        shape = r.shape
        args = (p[0], r.reshape(-1, shape[-1]), scale)
        if kernel:
            s, y = allreduce.allreduce_add_rms_norm(*args, *box, eps=norm.eps, axis=MODEL)
        else:
            s, y = allreduce.allreduce_add_rms_norm_reference(*args, eps=norm.eps, axis=MODEL)
        return s.reshape(shape), y.reshape(shape)

    boxes = (box,) if kernel else ()
    specs = (P(MODEL, DATA), ROWS, P()) + (P(AXES),) * len(boxes)
    return local(body, specs, (ROWS, ROWS))(part, x, norm.scale[...], *boxes)


def vocab_argmax(logits):
    """jnp.argmax(logits, -1) (the first index among equal maxima; a NaN counts as the maximum) for
    logits f32 [B, ..., V] as `logits` leaves them, int32 [B, ...]. Where "model" > 1 splits V, each
    device takes the maximum and first index of its columns and the devices exchange them as a sum
    of slots, one a device (its value and zeros: exact; V <= 2^24 keeps an index exact in f32): the
    one-shot kernel of pallas/allreduce.py where `select.tp_pick` says so, else lax.psum. With the
    kernel a decode step holds no NCCL call (with XLA's all-gather in it, tp 4's loop failed to
    instantiate as one CUDA graph: docs/perf/multi_gpu.md)."""
    M, V = model_size(), logits.shape[-1]
    if M == 1:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if V > 1 << 24:
        raise ValueError(f"vocab_argmax: a vocabulary of {V} entries; indices exchanged in f32 need V <= 2^24")
    lead = logits.shape[:-1]
    rows = rows_per_device(int(np.prod(lead)))
    box = mailbox()
    kernel = select.tp_pick(rows, M, box) == "kernel"

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
    return local(body, in_specs, ROWS)(logits, *boxes)
