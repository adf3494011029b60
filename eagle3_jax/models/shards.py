"""Model code on local shards: the one place the models meet a device mesh.

A computation traced under `jax.sharding.use_abstract_mesh(mesh.abstract_mesh)` of a mesh with
axes ("data", "model") and more than one device (`spec/loop.py` traces `generate` / `decode` so when
the parameters are sharded: `eagle3_jax.parallel`) runs its attention, its MoE experts and the KV
rewind through `local`: `jax.shard_map` over the mesh, each device on its rows (B over "data") and
its heads or experts (over "model"), so that the Pallas kernels inside, custom calls that XLA's
partitioner can only replicate, see local arrays. Everything else (the GEMMs, the embedding, the
logits) stays with XLA's sharding propagation. With no such mesh in context `local(fn, ...)` is
`fn`: one device, and code traced without the context (gpt_oss.forward on its own, training).

With "model" > 1, decode-sized steps sum each sublayer's partial outputs over "model" in one call
fused with the residual add and the next norm (`gpt_oss.reduce_add_norm`): on GPUs the one-shot
kernel of pallas/allreduce.py, whose `Mailbox` (buffers that outlive each call) a program passes in
as an argument and traces under `mailbox_context` (`spec/loop.py`); without one, `lax.psum`.
"""

from __future__ import annotations

import contextlib

import jax
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


def local(fn, in_specs, out_specs):
    """fn on each device's shards (`jax.shard_map` over the mesh in context; specs as shard_map's,
    None arguments pass through), or fn itself where there is no such mesh."""
    m = mesh()
    if m is None:
        return fn
    return jax.shard_map(fn, mesh=m, in_specs=in_specs, out_specs=out_specs, check_vma=False)


_MAILBOXES: list = []  # (Mailbox, Mesh) of the program being traced (innermost last)


@contextlib.contextmanager
def mailbox_context(mailbox, mesh=None):
    """Trace under this to give the models `mailbox` (a pallas.allreduce.Mailbox among the program's
    arguments, or None) and the concrete `mesh` (a jax.sharding.Mesh) the program runs on."""
    _MAILBOXES.append((mailbox, mesh))
    try:
        yield
    finally:
        _MAILBOXES.pop()


def mailbox():
    """(Mailbox, Mesh) in context (`mailbox_context`), or (None, None)."""
    return _MAILBOXES[-1] if _MAILBOXES else (None, None)
