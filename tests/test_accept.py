"""accept (eagle3_jax/pallas/accept.py): greedy and lossless sampling.

- greedy: reference vs a numpy brute force; kernel (interpret / GPU) vs reference.
- sampling: kernel vs reference on the same key (token for token); the reference's output law
  against the exact target law on a small vocabulary (first committed token ~ p(root); second
  token given the first accepted draft a ~ p(a)), for a sampled tree, a deterministic (top-k) tree
  and a sampled chain.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.pallas.accept import (
    accept_greedy,
    accept_greedy_pallas,
    accept_greedy_reference,
    accept_sample,
    accept_sample_pallas,
    accept_sample_reference,
    uniforms,
)


def random_tree(rng, B, N, fan=3):
    par = np.full((B, N), -1, np.int32)
    for i in range(1, N):
        par[:, i] = rng.integers(max(0, i - fan), i, B)
    return par


def greedy_inputs(seed, B, N, V=4, match=0.6):
    rng = np.random.default_rng(seed)
    par = random_tree(rng, B, N)
    tok = rng.integers(0, V, (B, N)).astype(np.int32)
    tgt = rng.integers(0, V, (B, N)).astype(np.int32)
    for b in range(B):
        for i in range(1, N):
            if rng.random() < match:
                tgt[b, par[b, i]] = tok[b, i]
    return tok, par, tgt


def brute_greedy(tok, par, tgt, Dm):
    B, N = par.shape
    acc, paths, bonus = [], [], []
    for b in range(B):
        best, bi = 0, 0
        for i in range(N):
            path, j, ok = [], i, True
            while j > 0:
                path.append(j)
                ok &= tok[b, j] == tgt[b, par[b, j]]
                j = par[b, j]
            if ok and len(path) <= Dm and len(path) > best:
                best, bi = len(path), i
        p = [0] + [None] * Dm
        j = bi
        for d in range(best, 0, -1):
            p[d] = j
            j = par[b, j]
        acc.append(best)
        paths.append([x if x is not None else -1 for x in p])
        bonus.append(tgt[b, bi])
    return np.array(acc), np.array(paths), np.array(bonus)


@pytest.mark.parametrize("B,N,Dm", [(4, 9, None), (3, 40, None), (2, 20, 3), (2, 1, None)])
def test_greedy_reference_matches_brute_force(B, N, Dm):
    tok, par, tgt = greedy_inputs(N, B, N)
    got = jax.jit(accept_greedy_reference, static_argnames="max_depth")(tok, par, tgt, max_depth=Dm)
    exp = brute_greedy(tok, par, tgt, N - 1 if Dm is None else Dm)
    for g, e in zip(got, exp):
        np.testing.assert_array_equal(np.asarray(g), e)


@pytest.mark.parametrize("B,N,Dm", [(4, 9, None), (3, 40, 12), (2, 1, None)])
def test_greedy_kernel_matches_reference_interpret(B, N, Dm):
    tok, par, tgt = greedy_inputs(100 + N, B, N)
    ref = jax.jit(accept_greedy_reference, static_argnames="max_depth")(tok, par, tgt, max_depth=Dm)
    out = accept_greedy_pallas(tok, par, tgt, max_depth=Dm, interpret=True)
    for o, r in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(o), np.asarray(r))
    assert N == 1 or int(jnp.max(ref[0])) >= 2


@pytest.mark.parametrize("proposal,V,ov", [("sample", 37, {}), ("deterministic", 37, {}),
                                           ("sample", 1000, dict(block_v=128, chunks=3)),
                                           ("deterministic", 1000, dict(block_v=128, chunks=3))])
def test_sample_kernel_matches_reference_interpret(proposal, V, ov):
    """V=1000 in 128-id blocks: three vocabulary chunks of three blocks, the last one partial."""
    rng = np.random.default_rng(7)
    B, N = 3, 12
    par = random_tree(rng, B, N)
    p = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, N, V)) * 2, jnp.float32), -1)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, N, V)) * 2, jnp.float32) + jnp.log(p), -1)
    tok = jnp.asarray(rng.integers(0, V, (B, N)), jnp.int32)
    for seed in range(2):
        key = jax.random.key(seed)
        ref = jax.jit(accept_sample_reference, static_argnames=("max_depth", "proposal"))(
            tok, par, p, q, key, max_depth=6, proposal=proposal)
        out = accept_sample_pallas(tok, par, p, q, key, max_depth=6, proposal=proposal, interpret=True, **ov)
        for o, r in zip(out, ref):
            np.testing.assert_array_equal(np.asarray(o), np.asarray(r))
        # the draws passed instead of the key (a device's rows of the batch's draws): the same outputs
        u = uniforms(key, B, N)
        for o, r in zip(accept_sample_pallas(tok, par, p, q, u, max_depth=6, proposal=proposal, interpret=True, **ov),
                        ref):
            np.testing.assert_array_equal(np.asarray(o), np.asarray(r))
        first = accept_sample_reference(tok[:1], par[:1], p[:1], q[:1], u[:1], max_depth=6, proposal=proposal)
        for o, r in zip(first, ref):
            np.testing.assert_array_equal(np.asarray(o), np.asarray(r[:1]))
    with pytest.raises(ValueError, match=r"uniforms of shape \(3, 12\), expected \[B, N \+ 1\] = \[3, 13\]"):
        accept_sample_reference(tok, par, p, q, u[:, :-1], max_depth=6, proposal=proposal)


def test_dispatch_cpu_is_reference():
    tok, par, tgt = greedy_inputs(3, 2, 7)
    for a, b in zip(accept_greedy(tok, par, tgt), accept_greedy_reference(tok, par, tgt)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ the law of the committed tokens

V = 5
TREE = np.array([-1, 0, 0, 0, 1, 1, 2], np.int32)  # root: 3 children; node 1: 2 children; node 2: 1
CHAIN = np.array([-1, 0, 1, 2], np.int32)


def _laws(seed):
    rng = np.random.default_rng(seed)
    d = lambda *s: rng.dirichlet(np.ones(V) * 0.7, size=s)  # noqa: E731
    return dict(P0=d(1)[0], P1=d(V), P2=d(V, V), Q0=d(1)[0], Q1=d(V), Q2=d(V, V))


def _trials(parents, laws, proposal, T, seed):
    """T independent speculative steps: draft tokens drawn (or chosen) per the proposal, p and q
    given by the token path (a consistent 'language model' of depth <= 3)."""
    rng = np.random.default_rng(seed)
    N = len(parents)
    tok = np.zeros((T, N), np.int64)
    p = np.zeros((T, N, V))
    q = np.zeros((T, N, V))

    def law(kind, i):  # [T, V]: the law after node i (depends on the tokens of its root path)
        path = _ancestors(parents, i)
        if not path:
            return np.broadcast_to(laws[kind + "0"], (T, V))
        if len(path) == 1:
            return laws[kind + "1"][tok[:, path[0]]]
        return laws[kind + "2"][tok[:, path[0]], tok[:, path[1]]]

    for i in range(N):  # parents precede children: the parent's law is known when i is drafted
        if i:
            qq = q[:, parents[i]]
            if proposal == "sample":
                u = rng.random((T, 1))
                tok[:, i] = np.minimum((np.cumsum(qq, -1) < u).sum(-1), V - 1)
            else:  # siblings: distinct tokens by draft rank
                rank = sum(1 for s_ in range(1, i) if parents[s_] == parents[i])
                tok[:, i] = np.argsort(-qq, -1)[:, rank]
        p[:, i] = law("P", i)
        q[:, i] = law("Q", i)
    return tok.astype(np.int32), p.astype(np.float32), q.astype(np.float32)


def _ancestors(parents, i):
    out = []
    while i > 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def _check_law(samples, law, what):
    n = len(samples)
    assert n > 500, f"{what}: too few samples ({n})"
    freq = np.bincount(samples, minlength=V) / n
    z = np.abs(freq - law) / np.sqrt(law * (1 - law) / n + 1e-12)
    assert z.max() < 5.0, f"{what}: empirical {freq.round(4)} vs exact {law.round(4)} (n={n}, max z {z.max():.1f})"


def _committed(tok, path, acc, bonus):
    tok, path, acc, bonus = map(np.asarray, (tok, path, acc, bonus))
    T = len(acc)
    seq = np.full((T, 3), -1)
    for t in range(T):
        toks = [tok[t, path[t, d]] for d in range(1, acc[t] + 1)] + [bonus[t]]
        seq[t, :min(3, len(toks))] = toks[:3]
    return seq


@pytest.mark.parametrize("parents,proposal", [(TREE, "sample"), (TREE, "deterministic"), (CHAIN, "sample")],
                         ids=["tree-sample", "tree-deterministic", "chain-sample"])
def test_sampling_is_lossless(parents, proposal):
    T = 30000
    laws = _laws(11)
    tok, p, q = _trials(parents, laws, proposal, T, seed=5)
    par = np.broadcast_to(parents, (T, len(parents)))
    acc, path, bonus = jax.jit(accept_sample_reference, static_argnames=("max_depth", "proposal"))(
        jnp.asarray(tok), jnp.asarray(par), jnp.asarray(p), jnp.asarray(q), jax.random.key(3), proposal=proposal)
    seq = _committed(tok, path, acc, bonus)
    _check_law(seq[:, 0], laws["P0"], "first token")
    first_accepted = np.asarray(acc) >= 1
    for a in range(V):
        sel = first_accepted & (seq[:, 0] == a)
        if sel.sum() > 1500:
            _check_law(seq[sel, 1], laws["P1"][a], f"second token | first = {a}")
    assert np.mean(np.asarray(acc)) > 0.3  # the drafts do get accepted


# ------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("B,N,Dm", [(4, 64, 16), (16, 33, None), (2, 1, None)])
def test_greedy_kernel_matches_reference_gpu(B, N, Dm):
    tok, par, tgt = greedy_inputs(200 + N, B, N, match=0.8)
    ref = jax.jit(accept_greedy_reference, static_argnames="max_depth")(tok, par, tgt, max_depth=Dm)
    for o, r in zip(accept_greedy(tok, par, tgt, max_depth=Dm), ref):
        np.testing.assert_array_equal(np.asarray(o), np.asarray(r))


@pytest.mark.gpu
@pytest.mark.parametrize("proposal", ["sample", "deterministic"])
def test_sample_kernel_matches_reference_gpu(proposal):
    rng = np.random.default_rng(8)
    B, N, V_ = 4, 64, 5000
    par = random_tree(rng, B, N)
    logits = jnp.asarray(rng.normal(size=(B, N, V_)) * 3, jnp.float32)
    p = jax.nn.softmax(logits, -1)
    q = jax.nn.softmax(logits + jnp.asarray(rng.normal(size=(B, N, V_)), jnp.float32), -1)
    tok = jnp.argmax(q, -1).astype(jnp.int32)
    agree = 0
    for seed in range(5):
        key = jax.random.key(seed)
        ref = jax.jit(accept_sample_reference, static_argnames=("max_depth", "proposal"))(
            tok, par, p, q, key, max_depth=16, proposal=proposal)
        out = accept_sample(tok, par, p, q, key, max_depth=16, proposal=proposal)
        agree += all(bool(jnp.all(o == r)) for o, r in zip(out, ref))
    assert agree >= 4  # token for token, barring a cumulative-sum rounding tie


@pytest.mark.gpu
@pytest.mark.parametrize("parents,proposal", [(TREE, "sample"), (TREE, "deterministic")])
def test_sampling_kernel_is_lossless_gpu(parents, proposal):
    T = 30000
    laws = _laws(12)
    tok, p, q = _trials(parents, laws, proposal, T, seed=6)
    par = np.broadcast_to(parents, (T, len(parents)))
    acc, path, bonus = accept_sample(jnp.asarray(tok), jnp.asarray(par), jnp.asarray(p), jnp.asarray(q),
                                     jax.random.key(4), proposal=proposal)
    seq = _committed(tok, path, acc, bonus)
    _check_law(seq[:, 0], laws["P0"], "first token")
