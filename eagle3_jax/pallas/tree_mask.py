"""Tree structure on device: parent arrays -> packed ancestor masks, depths, positions, child/sibling links.

A speculative tree of N nodes per sequence is given by `parents [B, N]` int32 with
`parents[b, 0] = -1` (node 0 = the root, the last token the target chose) and
`0 <= parents[b, i] < i` for i >= 1 (parents precede children). `tree_mask` returns

  bits          uint32 [B, N, ceil(N/32)]: bit j % 32 of word j // 32 of row i is set iff node j is
                node i or one of its ancestors (the attention mask of tree verify; TRT-LLM layout)
  depth         int32 [B, N]: 0 for the root, depth(parent) + 1 otherwise
  positions     int32 [B, N]: lengths[b] + depth (the position each node is verified at)
  first_child   int32 [B, N]: the smallest index of a child of node i, -1 if none
  next_sibling  int32 [B, N]: the smallest index j > i with parents[j] == parents[i], -1 if none
                (the root has no siblings); siblings are visited in index order

`first_child` / `next_sibling` are the left-child / right-sibling arrays SGLang keeps
(`retrive_next_token`, `retrive_next_sibling`).

The kernel (`tree_mask`, Pallas Triton lowering, one program per sequence) computes the ancestor
relation as the transitive closure of "parent or self" by ceil(log2 N) boolean matrix squarings on
the tensor cores (0/1 entries, float32 accumulation: exact), so it has no sequential chain over
nodes; `tree_mask_reference` walks the nodes in order with a scan. Same signature, same outputs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle3_jax.formats.packed_mask import MASK_WORD, mask_words, pack_mask
from eagle3_jax.pallas import select, util

# ----------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------

def tree_mask_reference(parents, lengths):
    """Plain-jnp tree structure (see the module docstring). parents int32 [B, N], lengths int32 [B]."""
    parents = parents.astype(jnp.int32)
    B, N = parents.shape
    idx = jnp.arange(N, dtype=jnp.int32)

    def one(par):
        def body(carry, i):
            anc, depth = carry
            p = par[i]
            row = jnp.where(p >= 0, anc[jnp.maximum(p, 0)], jnp.zeros((N,), bool)) | (idx == i)
            d = jnp.where(p >= 0, depth[jnp.maximum(p, 0)] + 1, 0)
            return (anc.at[i].set(row), depth.at[i].set(d)), None

        (anc, depth), _ = jax.lax.scan(body, (jnp.zeros((N, N), bool), jnp.zeros((N,), jnp.int32)), idx)
        child = (par[None, :] == idx[:, None])  # [i, j]: j is a child of i
        first_child = jnp.min(jnp.where(child, idx[None, :], N), axis=1)
        sib = (par[None, :] == par[:, None]) & (idx[None, :] > idx[:, None]) & (par[:, None] >= 0)
        next_sibling = jnp.min(jnp.where(sib, idx[None, :], N), axis=1)
        first_child = jnp.where(first_child == N, -1, first_child)
        next_sibling = jnp.where(next_sibling == N, -1, next_sibling)
        return anc, depth, first_child, next_sibling

    anc, depth, first_child, next_sibling = jax.vmap(one)(parents)
    bits = pack_mask(anc)
    positions = lengths.astype(jnp.int32)[:, None] + depth
    return bits, depth, positions, first_child, next_sibling


# ----------------------------------------------------------------------------------------------
# in-kernel helpers (plain jnp on [Np] / [Np, Np] values: valid in Triton kernels and interpret mode)
# ----------------------------------------------------------------------------------------------

def closure(par, N: int, Np: int):
    """par int32 [Np] (padding entries -1) -> (anc bool [Np, Np]: j is i or an ancestor of i, depth [Np])."""
    idx = jnp.arange(Np, dtype=jnp.int32)
    reach = (par[:, None] == idx[None, :]) | (idx[:, None] == idx[None, :])
    for _ in range(max(0, math.ceil(math.log2(max(N, 2))))):
        r = reach.astype(jnp.bfloat16)
        reach = jax.lax.dot_general(r, r, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32) > 0.5
    depth = jnp.sum(reach.astype(jnp.int32), axis=1) - 1
    return reach, depth


def links(par, N: int, Np: int):
    """par int32 [Np] -> (first_child, next_sibling) int32 [Np], -1 for none."""
    idx = jnp.arange(Np, dtype=jnp.int32)
    big = jnp.int32(Np)
    valid = idx < N
    child = (par[None, :] == idx[:, None]) & valid[None, :]
    first_child = jnp.min(jnp.where(child, idx[None, :], big), axis=1)
    sib = (par[None, :] == par[:, None]) & (idx[None, :] > idx[:, None]) & (par[:, None] >= 0) & valid[None, :]
    next_sibling = jnp.min(jnp.where(sib, idx[None, :], big), axis=1)
    return jnp.where(first_child == big, -1, first_child), jnp.where(next_sibling == big, -1, next_sibling)


def pick(vec, i):
    """vec[i] for a traced scalar i, as a masked reduction (no dynamic register indexing in Triton)."""
    idx = jnp.arange(vec.shape[0], dtype=jnp.int32)
    return jnp.sum(jnp.where(idx == i, vec, jnp.zeros_like(vec)))


# ----------------------------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------------------------

def _tree_mask_kernel(par_ref, len_ref, bits_ref, depth_ref, pos_ref, fc_ref, ns_ref, *, N, Np, W):
    b = pl.program_id(0)
    idx = jnp.arange(Np, dtype=jnp.int32)
    valid = idx < N
    par = plgpu.load(par_ref.at[b, jnp.minimum(idx, N - 1)], mask=valid, other=-1)
    par = jnp.where(valid, par, -1)
    anc, depth = closure(par, N, Np)
    fc, ns = links(par, N, Np)
    row = jnp.where(valid, idx, N)  # padding rows point past the end (masked stores)
    plgpu.store(depth_ref.at[b, row], depth, mask=valid)
    plgpu.store(pos_ref.at[b, row], depth + len_ref[b], mask=valid)
    plgpu.store(fc_ref.at[b, row], fc, mask=valid)
    plgpu.store(ns_ref.at[b, row], ns, mask=valid)
    shift = jax.lax.shift_left(jnp.ones((Np,), jnp.uint32), (idx % MASK_WORD).astype(jnp.uint32))
    for w in range(W):
        in_word = (idx // MASK_WORD == w) & valid
        word = jnp.sum(jnp.where(anc & in_word[None, :], shift[None, :], jnp.zeros((Np, Np), jnp.uint32)),
                       axis=1, dtype=jnp.uint32)
        plgpu.store(bits_ref.at[b, row, jnp.full((Np,), w, jnp.int32)], word, mask=valid)


@functools.partial(jax.jit, static_argnames=("interpret",))
def tree_mask_pallas(parents, lengths, *, interpret: bool = False):
    parents = parents.astype(jnp.int32)
    B, N = parents.shape
    Np, W = util.pow2(max(16, N)), mask_words(N)
    i32 = jnp.int32
    out_shape = (jax.ShapeDtypeStruct((B, N, W), jnp.uint32),) + tuple(
        jax.ShapeDtypeStruct((B, N), i32) for _ in range(4))
    return pl.pallas_call(
        functools.partial(_tree_mask_kernel, N=N, Np=Np, W=W), out_shape=out_shape, grid=(B,),
        compiler_params=plgpu.CompilerParams(num_warps=4 if Np <= 64 else 8, num_stages=1),
        interpret=interpret, name="tree_mask")(parents, lengths.astype(i32))


def tree_mask(parents, lengths, *, policy: select.KernelPolicy = select.AUTO):
    """Tree structure of `parents` (see the module docstring): the Pallas kernel where `select.spec_ops`
    says so under `policy` (a GPU, or policy.interpret: the interpreter), the reference elsewhere.
    Returns (bits, depth, positions, first_child, next_sibling)."""
    if select.spec_ops(policy=policy) == "kernel":
        return tree_mask_pallas(parents, lengths, interpret=policy.interpret)
    return tree_mask_reference(parents, lengths)
