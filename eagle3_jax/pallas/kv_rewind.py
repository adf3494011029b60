"""Accepted-path KV compaction, in place, all layers in one call.

After verify, tree node i's K/V sit at cache slot lengths[b] + i of every layer. Acceptance gives the
accepted path (accept.py: `path [B, max_depth + 1]`, path[:, 0] = 0 the root, path[:, d] the node at
depth d for d <= accept_len, -1 beyond). `kv_rewind` moves, for d = 1 .. accept_len[b],

    slot lengths[b] + path[b, d]  ->  slot lengths[b] + d          (every layer, every kv head)

so the committed sequence is contiguous; the caller then sets lengths += accept_len + 1. Slots past
lengths + accept_len keep whatever they held (scratch). On a ring (`rings[i]`: a sliding layer's
buffer, models/kv_cache.py) both slots are taken mod its S; layers may differ in S. A chain
(path[d] = d) moves nothing: rows with path[d] == d are masked off, so a chain costs one launch and
no memory traffic; a caller that knows statically that its tree is a chain can skip the call.

Moves never conflict in the sense of a sequential in-order copy (path is strictly increasing and
path[d] >= d, so no destination is a later source); the kernel still reads all moved rows of a
(layer group, sequence, kv head) before it writes any, with a CTA barrier between.

Kernel: Pallas Triton lowering, grid (layer group, B * Hkv), a group's layers of one shape and kind
(dense or ring); the caches travel as
`input_output_aliases` (each output is its input buffer), so under `jax.jit(..., donate_argnums=...)`
(or as a loop carry) the update is in place and only the moved rows are touched.
`kv_rewind_reference` is the same function in plain jnp (a gather + scatter per layer).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle3_jax.pallas import select, util


def _moves(lengths, path, accept_len):
    """-> (src, dst, move) int32/bool [B, Dm + 1]: the slot moves of each sequence."""
    Dm1 = path.shape[1]
    d = jnp.arange(Dm1, dtype=jnp.int32)[None, :]
    move = (d >= 1) & (d <= accept_len[:, None]) & (path != d) & (path >= 0)
    L = lengths.astype(jnp.int32)[:, None]
    return L + jnp.maximum(path, 0), L + d, move


def _rings(rings, n: int) -> tuple[bool, ...]:
    rings = (False,) * n if rings is None else tuple(bool(r) for r in rings)
    if len(rings) != n:
        raise ValueError(f"kv_rewind: rings has {len(rings)} entries for {n} layers")
    return rings


def kv_rewind_reference(k_caches, v_caches, lengths, path, accept_len, rings=None):
    """Plain-jnp rewind. k_caches, v_caches: tuples of per-layer [B, Hkv, S_layer, D]; lengths, accept_len
    int32 [B]; path int32 [B, Dm + 1]; rings: per layer, whether its buffer is a ring (None: none).
    Returns the updated (k_caches, v_caches) tuples."""
    src, dst, move = _moves(lengths, path.astype(jnp.int32), accept_len.astype(jnp.int32))
    rings = _rings(rings, len(k_caches))

    def one(c, ring):
        S = c.shape[2]
        s_, d_ = (src % S, dst % S) if ring else (jnp.clip(src, 0, S - 1), dst)
        rows = jnp.take_along_axis(c, s_[:, None, :, None], axis=2)  # [B, H, Dm+1, D]
        d_ = jnp.where(move, d_, S)  # out of range: dropped
        b = jnp.arange(c.shape[0])[:, None, None]
        h = jnp.arange(c.shape[1])[None, :, None]
        return c.at[b, h, d_[:, None, :]].set(rows, mode="drop")

    return (tuple(one(c, r) for c, r in zip(k_caches, rings)),
            tuple(one(c, r) for c, r in zip(v_caches, rings)))


def _rewind_kernel(len_ref, path_ref, acc_ref, *refs, n, groups, Hkv, D, Dp, Dm1, barrier):
    """groups: per program row g, (layer indices, their slots S, ring)."""
    ins, outs = refs[:n], refs[n:]
    g, bh = pl.program_id(0), pl.program_id(1)
    b, h = bh // Hkv, bh % Hkv
    length, acc = len_ref[b], acc_ref[b]
    d = jnp.arange(Dp, dtype=jnp.int32)
    in_path = d < Dm1
    path = plgpu.load(path_ref.at[b, jnp.minimum(d, Dm1 - 1)])
    move = in_path & (d >= 1) & (d <= acc) & (path != d) & (path >= 0)
    col = jnp.arange(D, dtype=jnp.int32)
    m2 = jnp.broadcast_to(move[:, None], (Dp, D))

    def do_group(group):
        arrays, S, ring = group
        src = length + jnp.where(move, path, 0)
        dst = length + d
        if ring:
            src, dst = src % S, dst % S
        dst = jnp.where(move, dst, S)  # masked rows point past the end
        rows = [plgpu.load(ins[a].at[b, h, src[:, None], col[None, :]], mask=m2, other=0) for a in arrays]
        if barrier:
            plgpu.debug_barrier()
        for a, r in zip(arrays, rows):
            plgpu.store(outs[a].at[b, h, dst[:, None], col[None, :]], r, mask=m2)

    if len(groups) == 1:
        do_group(groups[0])
    else:
        jax.lax.switch(g, [functools.partial(lambda grp, _: do_group(grp), grp) for grp in groups], None)


def _kv_rewind_pallas(k_caches, v_caches, lengths, path, accept_len, rings=None, *, interpret: bool = False,
                      group_size: int | None = None):
    caches = tuple(k_caches) + tuple(v_caches)
    rings = _rings(rings, len(k_caches)) * 2
    n = len(caches)
    B, Hkv, _, D = caches[0].shape
    for c in caches:
        if c.shape[:2] + c.shape[3:] != (B, Hkv, D) or c.dtype != caches[0].dtype:
            raise ValueError(f"kv_rewind: all caches must share batch, heads, head_dim and dtype, got {c.shape} "
                             f"{c.dtype} beside {caches[0].shape} {caches[0].dtype}")
    Dm1 = path.shape[1]
    Dp = util.pow2(max(2, Dm1))
    if group_size is None:  # keep ~16K live elements per program
        group_size = max(1, min(n, (8192 // (Dp * D))))
    groups = []
    for kind in dict.fromkeys((c.shape[2], r) for c, r in zip(caches, rings)):  # in first-seen order
        members = [i for i, (c, r) in enumerate(zip(caches, rings)) if (c.shape[2], r) == kind]
        groups += [(tuple(members[i:i + group_size]), *kind) for i in range(0, len(members), group_size)]
    kern = functools.partial(_rewind_kernel, n=n, groups=groups, Hkv=Hkv, D=D, Dp=Dp, Dm1=Dm1,
                             barrier=not interpret)
    i32 = jnp.int32
    out = pl.pallas_call(
        kern, out_shape=tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches),
        grid=(len(groups), B * Hkv), input_output_aliases={3 + i: i for i in range(n)},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="kv_rewind")(lengths.astype(i32), path.astype(i32), accept_len.astype(i32), *caches)
    nk = len(k_caches)
    return tuple(out[:nk]), tuple(out[nk:])


_jit_donating = jax.jit(_kv_rewind_pallas, static_argnames=("rings", "interpret", "group_size"), donate_argnums=(0, 1))
_jit_plain = jax.jit(_kv_rewind_pallas, static_argnames=("rings", "interpret", "group_size"))


def kv_rewind_pallas(k_caches, v_caches, lengths, path, accept_len, rings=None, *, interpret: bool = False,
                     group_size: int | None = None):
    """The kernel. Compiled: the cache buffers are donated (updated in place). Interpret: no donation."""
    fn = _jit_plain if interpret else _jit_donating
    rings = _rings(rings, len(k_caches))
    return fn(tuple(k_caches), tuple(v_caches), lengths, path, accept_len, rings, interpret=interpret,
              group_size=group_size)


def kv_rewind(k_caches, v_caches, lengths, path, accept_len, rings=None, *,
              policy: select.KernelPolicy = select.AUTO):
    """In-place accepted-path compaction: the kernel where `select.spec_ops` says so under `policy` (a
    GPU, or policy.interpret: the interpreter), the reference elsewhere. rings: per layer, whether
    its buffer is a ring (`KVCache.rings`; None: none). Donates the cache buffers on the kernel path."""
    if select.spec_ops(policy=policy) == "kernel":
        return kv_rewind_pallas(tuple(k_caches), tuple(v_caches), lengths, path, accept_len, rings,
                                interpret=policy.interpret)
    return kv_rewind_reference(tuple(k_caches), tuple(v_caches), lengths, path, accept_len, rings)
