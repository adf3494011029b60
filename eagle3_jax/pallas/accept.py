"""Acceptance of a verified speculative tree, on device: greedy and lossless sampling.

Tree (tree_mask.py): N nodes a sequence, `parents [B, N]` (parents[:, 0] = -1, parents before children),
`tokens [B, N]` int32 (tokens[:, 0] the root, the last committed token; the rest the drafts). The
target's prediction after node i: `target [B, N]` (greedy: argmax ids) or `p [B, N, V]` (sampling:
probabilities, rows summing to 1). Outputs of both modes: accept_len int32 [B] (accepted drafts, root
excluded; accept_len + 1 tokens are committed), path int32 [B, max_depth + 1] (path[:, d] the
accepted node at depth d, path[:, 0] = 0, -1 past accept_len), bonus int32 [B] (the token the target
adds after the path). `max_depth` (static, default N - 1): deeper nodes are never accepted.

Greedy (docs/reference.md 6): node i is accepted iff every node on its root path equals the target argmax
at its parent; the deepest accepted node wins (the smallest index among equals); bonus = the argmax
there. Lossless sampling, recursive rejection over siblings (SpecInfer; EAGLE's tree sampling): from
the root with residual r = p[root], child x with proposal q_x is accepted with probability
min(1, r(x) / q_x(x)) (then r = p[x], its children next); on rejection r <- norm(max(r - q_x, 0)) and
the next sibling is tried; with no child left the bonus is drawn from r. The tokens are distributed
exactly as the target's whenever each draft was drawn from its q_x. proposal="sample": children are
i.i.d. draws from q[c] (q [B, N, V]; a chain accepts with min(1, p/q), resamples from
norm(max(p - q, 0))); proposal="deterministic": top-k children, q_x the point mass (a rejection removes
x from r, EAGLE's evaluate_posterior; q unused). u = `uniforms(key, B, N)` (or `key` given as u, as
spec/step.py hands each device its rows): child i's test uses u[:, i], the bonus (inverse CDF over r)
u[:, N]; kernel and reference agree token for token (up to float rounding of sums at a boundary).

Kernels (Pallas Triton): greedy, one program a sequence on [N, N] tiles (`tree_mask.closure`);
sampling, three launches: the walk (a sampled rejection is one pass over the vocabulary, shared by
SMs / B programs a sequence, see `_walk_kernel`), the residual's sums over vocabulary chunks, the bonus
draw. Figures against the jnp references, and what was tried: docs/perf/accept.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle3_jax.pallas import select, util
from eagle3_jax.pallas.tree_mask import closure, links, pick, tree_mask_reference

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
    Np, Dp = util.pow2(max(16, N)), util.pow2(max(16, Dm + 1))
    i32 = jnp.int32
    out_shape = (jax.ShapeDtypeStruct((B,), i32), jax.ShapeDtypeStruct((B, Dm + 1), i32),
                 jax.ShapeDtypeStruct((B,), i32))
    kern = functools.partial(_greedy_kernel, N=N, Np=Np, Dm=Dm, Dp=Dp)
    # outputs in kernel-argument order: (tokens, parents, target) -> (len, path, bonus)
    return pl.pallas_call(kern, out_shape=out_shape, grid=(B,), interpret=interpret,
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                          name="accept_greedy")(tokens.astype(i32), parents.astype(i32), target.astype(i32))


def accept_greedy(tokens, parents, target, *, max_depth=None, policy: select.KernelPolicy = select.AUTO):
    """Greedy acceptance: the kernel where `select.spec_ops` says so under `policy` (a GPU, or
    policy.interpret: the interpreter), the reference elsewhere."""
    if select.spec_ops(policy=policy) == "kernel":
        return accept_greedy_pallas(tokens, parents, target, max_depth=max_depth, interpret=policy.interpret)
    return accept_greedy_reference(tokens, parents, target, max_depth=max_depth)


# ----------------------------------------------------------------------------------------------
# lossless sampling
# ----------------------------------------------------------------------------------------------

def uniforms(key, B: int, N: int):
    """The acceptance's draws for B sequences of N nodes: f32 [B, N + 1] = uniform(key, [B, N + 1])."""
    return jax.random.uniform(key, (B, N + 1), jnp.float32)


def _uniforms(key, B, N):
    """`uniforms(key, B, N)`, or key itself where it already is those draws (float [B, N + 1])."""
    if not jnp.issubdtype(key.dtype, jnp.floating):
        return uniforms(key, B, N)
    if key.shape != (B, N + 1):
        raise ValueError(f"accept_sample: uniforms of shape {key.shape}, expected [B, N + 1] = {[B, N + 1]}")
    return key.astype(jnp.float32)


def accept_sample_reference(tokens, parents, p, q, key, *, max_depth=None, proposal="sample"):
    """Plain-jnp lossless tree sampling (see the module docstring).

    tokens, parents int32 [B, N]; p float32 [B, N, V] target probabilities after each node; q float32
    [B, N, V] draft probabilities at each node (None for proposal="deterministic"); key a PRNG key,
    or the draws themselves (`uniforms`: f32 [B, N + 1]).
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
            if sample:
                rbuf = jnp.maximum(r - s["rz"] * qb[cur], 0)
                rz = jnp.sum(rbuf)
            else:  # x leaves the residual and its mass
                rbuf, rz = jnp.where(vocab == x, f32(0), r), s["rz"] - r[x]
            d = s["d"] + 1
            nxt = jnp.where(d < Dm, fc[child], -1)
            return dict(
                cur=jnp.where(accept, child, cur),
                child=jnp.where(accept, nxt, ns[child]),
                d=jnp.where(accept, d, s["d"]),
                fresh=accept,
                rbuf=jnp.where(accept, s["rbuf"], rbuf),
                rz=jnp.where(accept, f32(1), rz),
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


_CHUNK_PROGRAMS = 264  # chunk programs in all by default: about 2 per multiprocessor of an H100 / H200


def _walk_kernel(tok_ref, par_ref, p_ref, q_ref, u_ref, cnt_in_ref, len_ref, path_ref, cur_ref, w_ref, rz_ref, rej_ref,
                 part_ref, cnt_ref, *, N, Np, Dm, Dp, V, BV, CB, P, Pp, sample):
    """One sequence a program: the walk down the tree. Outputs the accepted path and the residual the
    bonus is drawn from, at node cur, of mass rz: max(p - w q, 0) (sample; w = 0: p itself) or p without
    the tokens in rej (deterministic). With i.i.d. proposals the residual after k rejections at a node is
    max(p - w_k q, 0) / rz_k, w_0 = 0, w_{k+1} = w_k + rz_k (max(max(a, 0) - b, 0) = max(a - b, 0) for b >= 0):
    a rejection is one pass summing it over the vocabulary, nothing written. Grid (B, P): the P programs of
    a sequence walk it alike and share each pass, program j summing vocabulary chunk j (CB blocks): its
    partial to part [b, k, j] (pass k), then a release-acquire count in cnt [b, k] (zeroed) that each
    program waits to see reach P (so all B * P programs must be resident: P <= multiprocessors / B);
    each sums the P partials in one order. Program 0 writes the outputs."""
    del cnt_in_ref  # aliased to cnt_ref
    f32 = jnp.float32
    b, j = pl.program_id(0), pl.program_id(1)
    idx = jnp.arange(Np, dtype=jnp.int32)
    valid = idx < N
    safe = jnp.minimum(idx, N - 1)
    par = jnp.where(valid, plgpu.load(par_ref.at[b, safe]), -1)
    tok = plgpu.load(tok_ref.at[b, safe])
    ub = jnp.where(valid, plgpu.load(u_ref.at[b, safe]), 0.0)
    fc, ns = links(par, N, Np)
    pp = jnp.arange(Pp, dtype=jnp.int32)
    lane = jnp.arange(BV, dtype=jnp.int32)
    kk = jnp.arange(Dp, dtype=jnp.int32)
    none = jnp.full((Np,), -1, jnp.int32)

    def cond(s):
        return s[1] >= 0

    def body(s):
        cur, child, d, w, rz, path, rej, nrej = s
        x = pick(tok, child)
        px = plgpu.load(p_ref.at[b, cur, x])
        if sample:
            qx = plgpu.load(q_ref.at[b, cur, x])
            rx = jnp.maximum(px - w * qx, 0.0)
        else:
            seen = jnp.max(jnp.where(rej == x, 1, 0)) > 0  # x was rejected already: r(x) = 0
            rx = jnp.where(seen, 0.0, px)
            qx = f32(1)
        accept = pick(ub, child) * qx < rx / rz

        def on_accept(_):
            d1 = d + 1
            nxt = jnp.where(d1 < Dm, pick(fc, child), -1)
            # (lax.cond's results must be traced values for the Triton lowering, not literals)
            return (child, nxt, d1, w * 0, rz * 0 + 1, jnp.where(kk == d1, child, path), none,
                    nrej if sample else nrej * 0)  # (a sample walk counts all its passes in nrej)

        def on_reject(_):
            if not sample:  # x leaves the residual: no pass over the vocabulary
                add = jnp.logical_not(seen)
                rej1 = jnp.where(add & (idx == nrej), x, rej)
                return (cur, pick(ns, child), d, w, rz - rx, path, rej1, nrej + add.astype(jnp.int32))
            w1 = w + rz

            def rpass(t, z):
                v = (j * CB + t) * BV + lane
                return z + jnp.sum(_residual(p_ref, q_ref, b, cur, w1, none, v, V=V, Np=Np, sample=True))

            z = jax.lax.fori_loop(0, CB, rpass, f32(0))
            if P > 1:  # share the pass: k = passes so far (a sample walk's rejections)
                k = nrej
                part_ref[b, k, j] = z
                count = plgpu.atomic_add(cnt_ref, (b, k), jnp.int32(1)) + 1
                jax.lax.while_loop(lambda c: c < P, lambda c: plgpu.atomic_add(cnt_ref, (b, k), jnp.int32(0)), count)
                z = jnp.sum(plgpu.load(part_ref.at[b, k, jnp.minimum(pp, P - 1)], mask=pp < P, other=0.0))
            return (cur, pick(ns, child), d, w1, z, path, rej, nrej + 1)

        return jax.lax.cond(accept, on_accept, on_reject, None)

    path0 = jnp.where(kk == 0, 0, -1)
    child0 = jnp.where(Dm > 0, pick(fc, 0), -1)
    s0 = (jnp.int32(0), child0, jnp.int32(0), f32(0), f32(1), path0, none, jnp.int32(0))
    cur, _, d, w, rz, path, rej, _ = jax.lax.while_loop(cond, body, s0)

    @pl.when(j == 0)
    def _():
        plgpu.store(path_ref.at[b, jnp.where(kk <= Dm, kk, Dm + 1)], path, mask=kk <= Dm)
        plgpu.store(rej_ref.at[b, idx], rej)
        len_ref[b] = d
        cur_ref[b] = cur
        w_ref[b] = w
        rz_ref[b] = rz


def _residual(p_ref, q_ref, b, cur, w, rej, v, *, V, Np, sample):
    """The unnormalized residual at node cur, vocabulary ids v [BV] (0 past V)."""
    ok = v < V
    vs = jnp.minimum(v, V - 1)
    r = plgpu.load(p_ref.at[b, cur, vs], mask=ok, other=0.0)
    if sample:
        return jnp.maximum(r - w * plgpu.load(q_ref.at[b, cur, vs], mask=ok, other=0.0), 0.0)
    nrej = jnp.sum(jnp.where(rej >= 0, 1, 0))
    return jax.lax.fori_loop(jnp.int32(0), nrej, lambda k, r: jnp.where(v == pick(rej, k), 0.0, r), r)


def _state(cur_ref, w_ref, rej_ref, b, Np):
    """Sequence b's residual as the walk left it: (node cur, weight w, rejected tokens rej [Np])."""
    return cur_ref[b], w_ref[b], plgpu.load(rej_ref.at[b, jnp.arange(Np, dtype=jnp.int32)])


def _chunk_kernel(p_ref, q_ref, cur_ref, w_ref, rej_ref, sum_ref, last_ref, *, V, Np, BV, CB, sample):
    """Program (b, j): the residual's sum and its last nonzero id over vocabulary chunk j (CB blocks)."""
    b, j = pl.program_id(0), pl.program_id(1)
    cur, w, rej = _state(cur_ref, w_ref, rej_ref, b, Np)
    lane = jnp.arange(BV, dtype=jnp.int32)

    def blk(t, carry):
        z, last = carry
        v = (j * CB + t) * BV + lane
        r = _residual(p_ref, q_ref, b, cur, w, rej, v, V=V, Np=Np, sample=sample)
        return z + jnp.sum(r), jnp.maximum(last, jnp.max(jnp.where(r > 0, v, 0)))

    z, last = jax.lax.fori_loop(0, CB, blk, (jnp.float32(0), jnp.int32(0)))
    sum_ref[b, j] = z
    last_ref[b, j] = last


def _bonus_kernel(p_ref, q_ref, u_ref, cur_ref, w_ref, rz_ref, rej_ref, sum_ref, last_ref, bonus_ref, *, N, V, Np,
                  BV, CB, NC, NCp, sample):
    """One sequence a program: the first id whose cumulative residual exceeds u[N] * rz (inverse CDF), its
    chunk found from the chunk sums."""
    b = pl.program_id(0)
    cur, w, rej = _state(cur_ref, w_ref, rej_ref, b, Np)
    target = plgpu.load(u_ref.at[b, jnp.int32(N)]) * rz_ref[b]
    c = jnp.arange(NCp, dtype=jnp.int32)
    cok = c < NC
    sums = plgpu.load(sum_ref.at[b, jnp.minimum(c, NC - 1)], mask=cok, other=0.0)
    lasts = plgpu.load(last_ref.at[b, jnp.minimum(c, NC - 1)], mask=cok, other=0)
    ends = jnp.cumsum(sums)
    j = jnp.min(jnp.where(cok & (ends > target), c, NC))  # the chunk holding the target (NC: none)
    pre0 = pick(ends - sums, jnp.minimum(j, NC - 1))
    lane = jnp.arange(BV, dtype=jnp.int32)

    def blk(t, carry):
        pre, found = carry
        v = (j * CB + t) * BV + lane
        r = _residual(p_ref, q_ref, b, cur, w, rej, v, V=V, Np=Np, sample=sample)
        cs = jnp.cumsum(r) + pre
        first = jnp.min(jnp.where((cs > target) & (v < V), v, V))
        return pre + jnp.sum(r), jnp.where(found == V, first, found)

    nb = jnp.where(j < NC, jnp.int32(CB), jnp.int32(0))  # (loop bounds of one type for the Triton lowering)
    _, found = jax.lax.fori_loop(jnp.int32(0), nb, blk, (pre0, jnp.int32(V)))
    # no id found (a rounding tie at the end): the last nonzero id of the chunk, or of all
    bonus_ref[b] = jnp.where(found < V, found, jnp.where(j < NC, pick(lasts, j), jnp.max(lasts)))


@functools.partial(jax.jit, static_argnames=("max_depth", "proposal", "interpret", "block_v", "chunks"))
def accept_sample_pallas(tokens, parents, p, q, key, *, max_depth=None, proposal="sample",
                         interpret: bool = False, block_v: int = 2048, chunks: int | None = None):
    """Three launches: the walk (one program a sequence), the residual's sums over `chunks` vocabulary
    chunks (default: about 2 programs per multiprocessor in all), the bonus draw (one program a sequence,
    one chunk scanned)."""
    Dm = _check(tokens, parents, max_depth)
    if proposal not in PROPOSALS:
        raise ValueError(f"accept_sample: proposal must be one of {PROPOSALS}, got {proposal!r}")
    B, N, V = p.shape
    Np, Dp = util.pow2(max(16, N)), util.pow2(max(16, Dm + 1))
    BV = min(block_v, util.pow2(max(128, V)))
    nblk = -(-V // BV)
    want = chunks or max(1, _CHUNK_PROGRAMS // B)
    CB = -(-nblk // max(1, min(want, nblk)))  # blocks a chunk
    NC = -(-nblk // CB)
    u = _uniforms(key, B, N)
    sample = proposal == "sample"
    p = p.astype(jnp.float32)
    qq = q.astype(jnp.float32) if sample else jnp.zeros((1, 1, 1), jnp.float32)
    i32, f32 = jnp.int32, jnp.float32
    sds = jax.ShapeDtypeStruct
    params = plgpu.CompilerParams(num_warps=8, num_stages=2)
    # the walk's programs a sequence: all resident (see _walk_kernel); one in the interpreter (it runs them in turn)
    PW = 1 if interpret or not sample else max(1, min(nblk, util.num_sms() // B))
    CBW = -(-nblk // PW)
    kern = functools.partial(_walk_kernel, N=N, Np=Np, Dm=Dm, Dp=Dp, V=V, BV=BV, CB=CBW, P=PW,
                             Pp=util.pow2(max(16, PW)), sample=sample)
    acc, path, cur, w, rz, rej, _, _ = pl.pallas_call(
        kern, grid=(B, PW), interpret=interpret, compiler_params=params, name="accept_sample",
        input_output_aliases={5: 7},
        out_shape=(sds((B,), i32), sds((B, Dm + 1), i32), sds((B,), i32), sds((B,), f32), sds((B,), f32),
                   sds((B, Np), i32), sds((B, N, PW), f32), sds((B, N), i32)))(
        tokens.astype(i32), parents.astype(i32), p, qq, u, jnp.zeros((B, N), i32))
    kw = dict(V=V, Np=Np, BV=BV, CB=CB, sample=sample)
    sums, last = pl.pallas_call(
        functools.partial(_chunk_kernel, **kw), grid=(B, NC), interpret=interpret, compiler_params=params,
        name="accept_sample_chunks", out_shape=(sds((B, NC), f32), sds((B, NC), i32)))(p, qq, cur, w, rej)
    bonus = pl.pallas_call(
        functools.partial(_bonus_kernel, N=N, NC=NC, NCp=util.pow2(max(16, NC)), **kw), grid=(B,), interpret=interpret,
        compiler_params=params, name="accept_sample_bonus", out_shape=sds((B,), i32))(
        p, qq, u, cur, w, rz, rej, sums, last)
    return acc, path, bonus


def accept_sample(tokens, parents, p, q, key, *, max_depth=None, proposal="sample",
                  policy: select.KernelPolicy = select.AUTO):
    """Lossless tree sampling: the kernels where `select.spec_ops` says so under `policy` (a GPU, or
    policy.interpret: the interpreter), the reference elsewhere (same outputs for the same key)."""
    if select.spec_ops(policy=policy) == "kernel":
        return accept_sample_pallas(tokens, parents, p, q, key, max_depth=max_depth, proposal=proposal,
                                    interpret=policy.interpret)
    return accept_sample_reference(tokens, parents, p, q, key, max_depth=max_depth, proposal=proposal)
