"""Model code on local shards: the one place the models meet a device mesh.

A computation traced under `jax.sharding.use_abstract_mesh(mesh.abstract_mesh)` of a mesh with
axes ("data", "model") and more than one device (`spec/loop.py` traces `generate` / `decode` so when
the parameters are sharded: `eagle3_jax.parallel`) runs its attention, its MoE experts and the KV
rewind through `local`: `jax.shard_map` over the mesh, each device on its rows (B over "data") and
its heads or experts (over "model"), so that the Pallas kernels inside, custom calls that XLA's
partitioner can only replicate, see local arrays. Everything else (the GEMMs, the embedding, the
logits) stays with XLA's sharding propagation. With no such mesh in context `local(fn, ...)` is
`fn`: one device, and code traced without the context (gpt_oss.forward on its own, training).
"""

from __future__ import annotations

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
