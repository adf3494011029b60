"""Acceptance of a verified speculative tree, on device: greedy and lossless sampling.

Tree (see tree_mask.py): N nodes per sequence, `parents [B, N]` (parents[:, 0] = -1, parents before
children), `tokens [B, N]` int32 the node tokens (tokens[:, 0] = the root, the last committed token;
tokens[:, i] for i >= 1 the draft tokens). The target ran the N nodes; its prediction after node i
is `target [B, N]` (greedy: argmax ids) or `p [B, N, V]` (sampling: probabilities, rows summing to 1).

Outputs, both modes:
  accept_len int32 [B]: accepted draft tokens (root excluded); tokens committed = accept_len + 1
  path       int32 [B, max_depth + 1]: node indices of the accepted path, path[:, 0] = 0 (the root),
             path[:, d] = the accepted node at depth d for d <= accept_len, -1 beyond (the fill)
  bonus      int32 [B]: the token the target adds after the accepted path (the next root)
`max_depth` (static, default N - 1) bounds the path: nodes deeper than it are never accepted.

Greedy (REFERENCE.md 6): node i is accepted iff every node on its root path (root excluded) equals
the target argmax at its parent; the deepest accepted node wins (the smallest index among equals);
bonus = target argmax there.

Lossless sampling, recursive rejection over siblings (SpecInfer's multi-step speculative sampling;
EAGLE's tree sampling). Start at the root with residual r = p[root]. Visit the children of the
current node c in index order; child x with proposal distribution q_x is accepted with probability
min(1, r(x) / q_x(x)); on acceptance move to x (r = p[x], start over with x's children); on rejection
r <- norm(max(r - q_x, 0)) and try the next sibling. When no child is left, the bonus token is drawn
from r. This returns a token sequence distributed exactly as the target's whenever each draft token
was drawn from its q_x given everything drafted before it:
  proposal="sample":        child tokens of node c are i.i.d. draws from q[c] (q [B, N, V] the draft
                            distribution at each node; a chain is the one-child case: accept with
                            min(1, p/q), resample from norm(max(p - q, 0)))
  proposal="deterministic": children are chosen without sampling (top-k trees, EAGLE / EAGLE-2): q_x
                            is the point mass at x, so x is accepted with probability r(x) and a
                            rejection removes x from r (EAGLE's evaluate_posterior rule); q is unused.
Randomness: u = uniform(key, [B, N + 1]); child i's test uses u[:, i], the bonus draw u[:, N]
(inverse CDF: the first token whose cumulative residual mass exceeds u * mass; p rows are taken as
normalized). Kernel and reference draw the same u, so they agree token for token (up to float
rounding of the cumulative sums at a boundary).

Kernels: Pallas Triton lowering, one program per sequence. Greedy works on [N, N] tiles in registers
(ancestor closure by matrix squaring, tree_mask.closure). Sampling walks the tree with a while loop;
each rejection is one pass over the vocabulary into a ping-pong residual buffer; the bonus draw is
one more pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .tree_mask import _on_gpu, _pow2, closure, links, pick, tree_mask_reference

PROPOSALS = ("sample", "deterministic")


def _check(tokens, parents, max_depth):
    B, N = parents.shape
    if tokens.shape != (B, N):
        raise ValueError(f"accept: tokens {tokens.shape} and parents {parents.shape} differ")
    return N - 1 if max_depth is None else int(max_depth)


# ----------------------------------------------------------------------------------------------
# greedy
# ----------------------------------------------------------------------------------------------

def accept_greedy_reference(tokens, parents, target, *, max_depth=None):
    """Plain-jnp greedy acceptance. tokens, parents, target int32 [B, N] -> (accept_len, path, bonus)."""
    Dm = _check(tokens, parents, max_depth)
    parents = parents.astype(jnp.int32)
    B, N = parents.shape
    _, depth, _, _, _ = tree_mask_reference(parents, jnp.zeros((B,), jnp.int32))

    def one(tok, par, tgt, dep):
        def body(ok, i):
            p = jnp.maximum(par[i], 0)
            good = (par[i] < 0) | (ok[p] & (tok[i] == tgt[p]) & (dep[i] <= Dm))
            return ok.at[i].set(good), None

        ok, _ = jax.lax.scan(body, jnp.zeros((N,), bool), jnp.arange(N))
        best = jnp.max(jnp.where(ok, dep, -1))
        c = jnp.argmax(ok & (dep == best))  # first index at the best depth
        path = jnp.full((Dm + 1,), -1, jnp.int32)

        def walk(carry, _):
            path, node = carry
            path = jnp.where(node >= 0, path.at[jnp.clip(dep[node], 0, Dm)].set(node), path)
            return (path, jnp.where(node >= 0, par[jnp.maximum(node, 0)], -1)), None

        (path, _), _ = jax.lax.scan(walk, (path, c.astype(jnp.int32)), None, length=Dm + 1)
        return best, path, tgt[c]

    return jax.vmap(one)(tokens.astype(jnp.int32), parents, target.astype(jnp.int32), depth)


def _greedy_kernel(tok_ref, par_ref, tgt_ref, len_ref, path_ref, bonus_ref, *, N, Np, Dm, Dp):
    b = pl.program_id(0)
    idx = jnp.arange(Np, dtype=jnp.int32)
    valid = idx < N
    safe = jnp.minimum(idx, N - 1)
    par = jnp.where(valid, plgpu.load(par_ref.at[b, safe]), -1)
    tok = plgpu.load(tok_ref.at[b, safe])
    tgt = plgpu.load(tgt_ref.at[b, safe])
    anc, depth = closure(par, N, Np)
    P = par[:, None] == idx[None, :]
    zero = jnp.zeros((Np, Np), jnp.int32)
    tgt_parent = jnp.sum(jnp.where(P, tgt[None, :], zero), axis=1)
    bad = valid & (par >= 0) & ((tok != tgt_parent) | (depth > Dm))
    ok = valid & (jnp.max(jnp.where(anc & bad[None, :], 1, zero), axis=1) == 0)
    best = jnp.max(jnp.where(ok, depth, -1))
    c = jnp.min(jnp.where(ok & (depth == best), idx, Np))
    on_path = jnp.max(jnp.where((idx[:, None] == c) & anc, 1, zero), axis=0) > 0  # row c of anc
    k = jnp.arange(Dp, dtype=jnp.int32)
    hit = on_path[None, :] & (depth[None, :] == k[:, None])
    path = jnp.max(jnp.where(hit, idx[None, :], jnp.full((Dp, Np), -1, jnp.int32)), axis=1)
    krow = jnp.where(k <= Dm, k, Dm + 1)
    plgpu.store(path_ref.at[b, krow], path, mask=k <= Dm)
    len_ref[b] = best
    bonus_ref[b] = pick(tgt, c)


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def accept_greedy_pallas(tokens, parents, target, *, max_depth=None, interpret: bool = False):
    Dm = _check(tokens, parents, max_depth)
    B, N = parents.shape
    Np, Dp = _pow2(max(16, N)), _pow2(max(16, Dm + 1))
    i32 = jnp.int32
    out_shape = (jax.ShapeDtypeStruct((B,), i32), jax.ShapeDtypeStruct((B, Dm + 1), i32),
                 jax.ShapeDtypeStruct((B,), i32))
    kern = functools.partial(_greedy_kernel, N=N, Np=Np, Dm=Dm, Dp=Dp)
    # outputs in kernel-argument order: (tokens, parents, target) -> (len, path, bonus)
    return pl.pallas_call(kern, out_shape=out_shape, grid=(B,), interpret=interpret,
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                          name="accept_greedy")(tokens.astype(i32), parents.astype(i32), target.astype(i32))


def accept_greedy(tokens, parents, target, *, max_depth=None, interpret: bool | None = None):
    """Greedy acceptance: the kernel on GPU (or with interpret=True), the reference elsewhere."""
    if interpret or (interpret is None and _on_gpu()):
        return accept_greedy_pallas(tokens, parents, target, max_depth=max_depth, interpret=bool(interpret))
    return accept_greedy_reference(tokens, parents, target, max_depth=max_depth)


# ----------------------------------------------------------------------------------------------
# lossless sampling
# ----------------------------------------------------------------------------------------------

def _uniforms(key, B, N):
    return jax.random.uniform(key, (B, N + 1), jnp.float32)


def accept_sample_reference(tokens, parents, p, q, key, *, max_depth=None, proposal="sample"):
    """Plain-jnp lossless tree sampling (see the module docstring).

    tokens, parents int32 [B, N]; p float32 [B, N, V] target probabilities after each node; q float32
    [B, N, V] draft probabilities at each node (None for proposal="deterministic"); key a PRNG key.
    Returns (accept_len [B], path [B, max_depth + 1], bonus [B]).
    """
    Dm = _check(tokens, parents, max_depth)
    if proposal not in PROPOSALS:
        raise ValueError(f"accept_sample: proposal must be one of {PROPOSALS}, got {proposal!r}")
    B, N, V = p.shape
    parents = parents.astype(jnp.int32)
    u = _uniforms(key, B, N)
    _, depth, _, first_child, next_sibling = tree_mask_reference(parents, jnp.zeros((B,), jnp.int32))
    f32 = jnp.float32
    vocab = jnp.arange(V, dtype=jnp.int32)
    sample = proposal == "sample"

    def one(tok, pb, qb, ub, fc, ns):
        def cond(s):
            return s["child"] >= 0

        def body(s):
            cur, child = s["cur"], s["child"]
            r = jnp.where(s["fresh"], pb[cur], s["rbuf"])
            x = tok[child]
            qx = qb[cur, x] if sample else f32(1)
            accept = ub[child] * qx < r[x] / s["rz"]
            qv = qb[cur] if sample else (vocab == x).astype(f32)
            rbuf = jnp.maximum(r - s["rz"] * qv, 0)
            d = s["d"] + 1
            nxt = jnp.where(d < Dm, fc[child], -1)
            return dict(
                cur=jnp.where(accept, child, cur),
                child=jnp.where(accept, nxt, ns[child]),
                d=jnp.where(accept, d, s["d"]),
                fresh=accept,
                rbuf=jnp.where(accept, s["rbuf"], rbuf),
                rz=jnp.where(accept, f32(1), jnp.sum(rbuf)),
                path=jnp.where(accept, s["path"].at[jnp.minimum(d, Dm)].set(child), s["path"]))

        s0 = dict(cur=jnp.int32(0), child=jnp.where(Dm > 0, fc[0], -1).astype(jnp.int32), d=jnp.int32(0),
                  fresh=jnp.bool_(True), rbuf=jnp.zeros((V,), f32), rz=f32(1),
                  path=jnp.full((Dm + 1,), -1, jnp.int32).at[0].set(0))
        s = jax.lax.while_loop(cond, body, s0)
        r = jnp.where(s["fresh"], pb[s["cur"]], s["rbuf"])
        t = ub[N] * s["rz"]
        cs = jnp.cumsum(r)
        hit = cs > t
        last_nz = jnp.max(jnp.where(r > 0, vocab, 0))
        bonus = jnp.where(jnp.any(hit), jnp.argmax(hit), last_nz)
        return s["d"], s["path"], bonus.astype(jnp.int32)

    qq = p if q is None else q
    return jax.vmap(one)(tokens.astype(jnp.int32), p.astype(f32), qq.astype(f32), u, first_child, next_sibling)


def _sample_kernel(tok_ref, par_ref, p_ref, q_ref, u_ref, len_ref, path_ref, bonus_ref, rbuf_ref, *,
                   N, Np, Dm, Dp, V, BV, sample, barrier):
    f32 = jnp.float32
    b = pl.program_id(0)
    idx = jnp.arange(Np, dtype=jnp.int32)
    valid = idx < N
    safe = jnp.minimum(idx, N - 1)
    par = jnp.where(valid, plgpu.load(par_ref.at[b, safe]), -1)
    tok = plgpu.load(tok_ref.at[b, safe])
    ub = jnp.where(valid, plgpu.load(u_ref.at[b, safe]), 0.0)
    fc, ns = links(par, N, Np)
    nblk = (V + BV - 1) // BV
    lane = jnp.arange(BV, dtype=jnp.int32)
    kk = jnp.arange(Dp, dtype=jnp.int32)

    def sync():
        if barrier:
            plgpu.debug_barrier()

    def residual_block(t, cur, fresh, buf):
        v = t * BV + lane
        ok = v < V
        vs = jnp.minimum(v, V - 1)
        pv = plgpu.load(p_ref.at[b, cur, vs], mask=ok & fresh, other=0.0)
        rv = plgpu.load(rbuf_ref.at[b, buf, vs], mask=ok & jnp.logical_not(fresh), other=0.0)
        return v, ok, vs, pv + rv

    def cond(s):
        return s[1] >= 0

    def body(s):
        cur, child, d, fresh, buf, rz, path = s
        x = pick(tok, child)
        px = plgpu.load(p_ref.at[b, cur, x])
        rx = jnp.where(fresh, px, plgpu.load(rbuf_ref.at[b, buf, x]))
        qx = plgpu.load(q_ref.at[b, cur, x]) if sample else f32(1)
        accept = pick(ub, child) * qx < rx / rz

        def on_accept(_):
            d1 = d + 1
            nxt = jnp.where(d1 < Dm, pick(fc, child), -1)
            # (branch results must be traced values for the Triton lowering, not literals)
            return (child, nxt, d1, accept, buf, rz * 0 + 1, jnp.where(kk == d1, child, path))

        def on_reject(_):
            nb = 1 - buf

            def rpass(t, z):
                v, ok, vs, r = residual_block(t, cur, fresh, buf)
                if sample:
                    qv = plgpu.load(q_ref.at[b, cur, vs], mask=ok, other=0.0)
                else:
                    qv = jnp.where(v == x, 1.0, 0.0).astype(f32)
                new = jnp.maximum(r - rz * qv, 0.0)
                plgpu.store(rbuf_ref.at[b, nb, jnp.where(ok, v, V)], new, mask=ok)
                return z + jnp.sum(new)

            z = jax.lax.fori_loop(0, nblk, rpass, f32(0))
            sync()
            return (cur, pick(ns, child), d, accept, nb, z, path)  # accept is False here

        return jax.lax.cond(accept, on_accept, on_reject, None)

    path0 = jnp.where(kk == 0, 0, -1)
    child0 = jnp.where(Dm > 0, pick(fc, 0), -1)
    s0 = (jnp.int32(0), child0, jnp.int32(0), jnp.bool_(True), jnp.int32(0), f32(1), path0)
    cur, _, d, fresh, buf, rz, path = jax.lax.while_loop(cond, body, s0)

    target = plgpu.load(u_ref.at[b, jnp.int32(N)]) * rz

    def fpass(t, carry):
        pre, found, last = carry
        v, ok, vs, r = residual_block(t, cur, fresh, buf)
        r = jnp.where(ok, r, 0.0)
        cs = jnp.cumsum(r) + pre
        first = jnp.min(jnp.where((cs > target) & ok, v, V))
        found = jnp.where((found == V) & (first < V), first, found)
        last = jnp.maximum(last, jnp.max(jnp.where(r > 0, v, 0)))
        return pre + jnp.sum(r), found, last

    _, found, last = jax.lax.fori_loop(0, nblk, fpass, (f32(0), jnp.int32(V), jnp.int32(0)))
    plgpu.store(path_ref.at[b, jnp.where(kk <= Dm, kk, Dm + 1)], path, mask=kk <= Dm)
    len_ref[b] = d
    bonus_ref[b] = jnp.where(found < V, found, last)


@functools.partial(jax.jit, static_argnames=("max_depth", "proposal", "interpret", "block_v"))
def accept_sample_pallas(tokens, parents, p, q, key, *, max_depth=None, proposal="sample",
                         interpret: bool = False, block_v: int = 2048):
    Dm = _check(tokens, parents, max_depth)
    if proposal not in PROPOSALS:
        raise ValueError(f"accept_sample: proposal must be one of {PROPOSALS}, got {proposal!r}")
    B, N, V = p.shape
    Np, Dp = _pow2(max(16, N)), _pow2(max(16, Dm + 1))
    BV = min(block_v, _pow2(max(128, V)))
    u = _uniforms(key, B, N)
    sample = proposal == "sample"
    qq = q.astype(jnp.float32) if sample else jnp.zeros((1, 1, 1), jnp.float32)
    i32 = jnp.int32
    out_shape = (jax.ShapeDtypeStruct((B,), i32), jax.ShapeDtypeStruct((B, Dm + 1), i32),
                 jax.ShapeDtypeStruct((B,), i32), jax.ShapeDtypeStruct((B, 2, V), jnp.float32))
    kern = functools.partial(_sample_kernel, N=N, Np=Np, Dm=Dm, Dp=Dp, V=V, BV=BV, sample=sample,
                             barrier=not interpret)
    acc, path, bonus, _ = pl.pallas_call(
        kern, out_shape=out_shape, grid=(B,), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=2), name="accept_sample")(
        tokens.astype(i32), parents.astype(i32), p.astype(jnp.float32), qq, u)
    return acc, path, bonus


# Above this vocabulary the XLA reference beats the one-program-per-sequence kernel on an H200
# (B=4, N=64: V=32000 kernel 34-56 us vs reference 150-244 us; V=201088 kernel 200-446 us vs
# reference 178-216 us; experiments/results/kernels_h200.json).
SAMPLE_KERNEL_MAX_VOCAB = 65536


def accept_sample(tokens, parents, p, q, key, *, max_depth=None, proposal="sample",
                  interpret: bool | None = None):
    """Lossless tree sampling: the kernel on GPU for vocabularies up to SAMPLE_KERNEL_MAX_VOCAB (or
    with interpret=True), the reference elsewhere (same outputs for the same key)."""
    if interpret or (interpret is None and _on_gpu() and p.shape[-1] <= SAMPLE_KERNEL_MAX_VOCAB):
        return accept_sample_pallas(tokens, parents, p, q, key, max_depth=max_depth, proposal=proposal,
                                    interpret=bool(interpret))
    return accept_sample_reference(tokens, parents, p, q, key, max_depth=max_depth, proposal=proposal)
