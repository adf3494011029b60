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
over "model" in one call fused with the residual add and the next norm (`gpt_oss.reduce_add_norm`;
`vocab_rows(..., partial=True)` gives the lookup's partials): on GPUs the one-shot
kernel of pallas/allreduce.py, whose `Mailbox` (buffers that outlive each call) a program passes in
as an argument and traces under `mailbox_context` (`spec/loop.py`); without one, `lax.psum`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

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
    sums it with its next step (`gpt_oss.reduce_add_norm`)."""
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
