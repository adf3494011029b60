"""The speculative step's small kernels (eagle3_jax/pallas/{tree_mask,accept,kv_rewind}.py) against
their references, each through the library's dispatcher under a `KernelPolicy` forcing one or the
other (spec_ops "kernel" | "reference"), as the step calls them.

  python experiments/bench_spec_ops.py --out experiments/results/spec_ops_<device>.json
  python experiments/bench_spec_ops.py --only accept

Sections (--only): tree_mask, accept (greedy, and the sampling walk at proposals "sample" and
"deterministic"), kv_rewind (K and V of every layer moved in place). Each times --sets distinct
inputs back to back in one program (wall time per call in that stream; with the device profile on
GPUs: kernel time per call), checks the kernel's outputs against the reference's ("matches_reference")
and returns {"rows", "table"}. On a CPU the kernels run in the Pallas interpreter at small shapes
(--kernels_quick on any device).
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from lib import cli, kernel_bench
from lib.kernel_bench import guard, on_gpu, policy, random_trees, safe_profile, same

from eagle3_jax.pallas.accept import accept_greedy, accept_greedy_reference, accept_sample
from eagle3_jax.pallas.kv_rewind import kv_rewind
from eagle3_jax.pallas.tree_mask import tree_mask

flags.DEFINE_bool("kernels_quick", False, "small shapes (CPU runs always take them)")
flags.DEFINE_integer("sets", None, "distinct inputs a timed program cycles through (default: 32 trees for "
                     "tree_mask and greedy accept, 8 draws for sampled accept, 16 paths for kv_rewind)", lower_bound=1)
FLAGS = flags.FLAGS

KERNEL, REFERENCE = policy(spec_ops="kernel"), policy(spec_ops="reference")


def _sets(default):
    return FLAGS.sets or default


def _quick():
    return FLAGS.kernels_quick or not on_gpu()


def _line(dev, t, tr):
    return (f"kernel {dev.get('kernel_seconds', float('nan')) * 1e6:.1f} on device, {t * 1e6:.1f} per call in a "
            f"stream; jnp reference {tr * 1e6:.1f}")


def _compare(kern, ref, sets):
    """(kernel seconds a call, reference seconds a call, device profile, kernel == reference on the
    first set, the kernel's outputs there) of two functions over `sets`."""
    (t, out), (tr, want) = kernel_bench.stream(kern, sets), kernel_bench.stream(ref, sets)
    return t, tr, safe_profile(kern, sets), same(out, want), out


@guard
def bench_tree_mask():
    rng = np.random.default_rng(0)
    rows, table = [], [f"tree_mask (us per call, {_sets(32)} distinct trees back to back in one program)"]
    for B, N in [(1, 8), (4, 64)]:
        lengths = jnp.full((B,), 1000, jnp.int32)
        sets = [(p,) for p in random_trees(rng, B, N, _sets(32))]
        t, tr, dev, match, _ = _compare(functools.partial(tree_mask, lengths=lengths, policy=KERNEL),
                                        functools.partial(tree_mask, lengths=lengths, policy=REFERENCE), sets)
        rows.append(dict(B=B, N=N, seconds=t, reference_seconds=tr, matches_reference=match, device=dev))
        table.append(f"B={B} N={N}: {_line(dev, t, tr)}; match={match}")
    return dict(rows=rows, table=table)


def _greedy_sets(rng, B, N):
    """Greedy accept's inputs (tokens, parents, the target's choices): long accepted paths."""
    sets = []
    for p in random_trees(rng, B, N, _sets(32)):
        tok = rng.integers(0, 8, (B, N)).astype(np.int32)
        tgt = rng.integers(0, 8, (B, N)).astype(np.int32)
        pn = np.asarray(p)
        for b in range(B):
            for i in range(1, N):
                if rng.random() < 0.7:
                    tgt[b, pn[b, i]] = tok[b, i]
        sets.append((jnp.asarray(tok), p, jnp.asarray(tgt)))
    return sets


def _sample_rows(parents, B, N, Dm, rows, table):
    """The sampling walk (`accept_sample`) at proposals "sample" and "deterministic" per vocabulary."""
    for V in ([32000, 201088] if not _quick() else [64]):
        logits = jax.random.normal(jax.random.key(0), (B, N, V), jnp.float32) * 3
        p = jax.nn.softmax(logits, -1)
        q = jax.nn.softmax(logits + jax.random.normal(jax.random.key(1), (B, N, V)) * 2, -1)
        tok = jnp.argmax(q, -1).astype(jnp.int32)  # plausible drafts
        sets = [(tok, parents, p, q, jax.random.key(10 + i)) for i in range(_sets(8))]
        for prop in ("sample", "deterministic"):
            run = functools.partial(accept_sample, max_depth=Dm, proposal=prop)
            t, tr, dev, match, o = _compare(functools.partial(run, policy=KERNEL),
                                            functools.partial(run, policy=REFERENCE), sets)
            acc = np.asarray(o[0]).tolist()
            rows.append(dict(kind=f"sample/{prop}", B=B, N=N, V=V, seconds=t, reference_seconds=tr,
                             matches_reference=match, accept_len=acc, device=dev))
            table.append(f"sample/{prop} B={B} N={N} V={V}: {_line(dev, t, tr)}  match={match} acc={acc}")
        del p, q, logits


@guard
def bench_accept():
    rng = np.random.default_rng(0)
    rows, table = [], ["accept (us per call, distinct inputs back to back in one program)"]
    B, N, Dm = 4, 64, 16
    sets = _greedy_sets(rng, B, N)
    run = functools.partial(accept_greedy, max_depth=Dm)
    t, tr, dev, match, o = _compare(functools.partial(run, policy=KERNEL), functools.partial(run, policy=REFERENCE),
                                    sets)
    acc = np.asarray(o[0]).tolist()
    rows.append(dict(kind="greedy", B=B, N=N, max_depth=Dm, seconds=t, reference_seconds=tr,
                     matches_reference=match, accept_len=acc, device=dev))
    table.append(f"greedy B={B} N={N}: {_line(dev, t, tr)}; match={match} acc={acc}")
    _sample_rows(sets[0][1], B, N, Dm, rows, table)
    return dict(rows=rows, table=table)


@guard
def bench_kv_rewind():
    layers, B, Hkv, S, D, N = (4, 2, 2, 256, 64, 16) if _quick() else (36, 4, 8, 8192, 64, 64)
    Dm = 8
    rng = np.random.default_rng(0)
    k = tuple(jax.random.normal(jax.random.key(i), (B, Hkv, S, D), jnp.bfloat16) for i in range(layers))
    v = tuple(jax.random.normal(jax.random.key(1000 + i), (B, Hkv, S, D), jnp.bfloat16) for i in range(layers))
    lengths = jnp.asarray(rng.integers(100, S - N, B), jnp.int32)
    paths = []
    for p in random_trees(rng, B, N, _sets(16)):
        zeros = jnp.zeros((B, N), jnp.int32)
        acc, path, _ = accept_greedy_reference(zeros, p, zeros, max_depth=Dm)  # everything matches: deepest path
        paths.append((path, acc))
    match = same(*(jax.jit(functools.partial(kv_rewind, policy=pol))(k, v, lengths, *paths[0])
                   for pol in (REFERENCE, KERNEL)))
    d = jnp.arange(1, Dm + 1)
    moved = int(jnp.sum((paths[0][0][:, 1:] != d) & (d <= paths[0][1][:, None])))

    def chain(k, v):  # the rewinds in one program, in place (donated), each with its own path
        for pth, a in paths:
            k, v = kv_rewind(k, v, lengths, pth, a, policy=KERNEL)
        return k, v

    t, dev = _donated_seconds(jax.jit(chain, donate_argnums=(0, 1)), k, v, len(paths))
    row = dict(layers=layers, B=B, Hkv=Hkv, S=S, D=D, N=N, max_depth=Dm, seconds=t, matches_reference=match,
               device=dev, moved_rows_per_head_first_tree=moved,
               bytes_moved_first_tree=2 * moved * 2 * layers * Hkv * D * 2)
    return dict(rows=[row], table=[f"kv_rewind {layers} layers K+V, B={B} Hkv={Hkv} N={N}: "
                                   f"{dev.get('kernel_seconds', float('nan')) * 1e6:.1f} us on device, "
                                   f"{t * 1e6:.1f} us "
                                   f"per call (in place, {len(paths)} in one program; {moved} moved rows/head/layer "
                                   f"in tree 0); match={match}"])


def _donated_seconds(f, k, v, calls):
    """(median seconds a call, device profile) of f(k, v) -> (k, v), which takes its caches over."""
    k, v = f(k, v)
    jax.block_until_ready((k, v))
    times = []
    for _ in range(5 if on_gpu() else 1):
        t0 = time.perf_counter()
        k, v = f(k, v)
        jax.block_until_ready((k, v))
        times.append((time.perf_counter() - t0) / calls)
    box = [(k, v)]

    def again():
        box[0] = f(*box[0])
        return box[0]

    return float(np.median(times)), kernel_bench.profile_program(again, calls) if on_gpu() else {}


SECTIONS = {"tree_mask": bench_tree_mask, "accept": bench_accept, "kv_rewind": bench_kv_rewind}
kernel_bench.define_flags(SECTIONS)

if __name__ == "__main__":
    cli.run(kernel_bench.main(SECTIONS))
