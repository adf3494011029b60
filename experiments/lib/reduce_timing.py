"""The fused sum + residual add + RMSNorm of a tensor-parallel sublayer (pallas/allreduce.py) timed
alone, shared by bench_reduce_norm.py and bench_tp.py: the one-shot kernel (its Mailbox an
argument) or its reference (XLA's all-reduce, then the add and the norm), [rows, hidden] f32
partials and a bf16 residual on each device of a (data 1, model n) mesh.

`inputs` makes the arguments; `fused(mesh, kernel)` gives (once, loop) jitted programs: `once(x, r,
w[, mailbox])` one call, (s, y) stacked per device; `loop(x, r, w, k[, mailbox])` k iterations of `chain` calls
each, every call fed by the last (s the next residual; the next partial by `feed`: "direct", y itself
(bf16, as o_proj's partial; nothing runs between two calls, as in the model, where a projection
kernel writes the partial), or "scaled", y times a per-device factor in f32 (a multiply kernel
between calls, counted in each call's time: the figures before 2026-11-28)), compiled as decode's
programs are (`select.compiler_options`: on GPUs the loop one CUDA graph) unless `options` says
otherwise ({}: XLA's defaults, whose kernels a profiler sees).
`per_call`: (best of 3 at `iters` iterations - best of 3 at none) / (iters x chain) seconds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.pallas import allreduce, select
from lib import timing

EPS = 1e-5


def inputs(mesh, rows: int, hidden: int, rng: np.random.Generator):
    """(x f32 [n, rows, hidden] sharded over "model", residual bf16 [rows, hidden], scale bf16 [hidden])
    as a layer passes them: normal partials and residual, scale 1 + 0.1 normal."""
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    n = mesh.shape["model"]
    return (put(rng.normal(size=(n, rows, hidden)).astype(np.float32), P("model")),
            put(jnp.asarray(rng.normal(size=(rows, hidden)), jnp.bfloat16), P()),
            put(jnp.asarray(1 + 0.1 * rng.normal(size=hidden), jnp.bfloat16), P()))


FEEDS = ("direct", "scaled")


def fused(mesh, kernel: bool, chain: int = 8, parts: int | None = None, options: dict | None = None,
          feed: str = "direct"):
    """(once, loop) for the kernel (with the Mailbox as a trailing argument; `parts` blocks a row,
    None: the kernel's default) or the reference; feed: one of FEEDS."""
    if feed not in FEEDS:
        raise ValueError(f"reduce_timing.fused: feed {feed!r}, expected one of {FEEDS}")
    n, every = mesh.shape["model"], P(tuple(mesh.axis_names))

    def op(x, r, w, mb):
        if kernel:
            return allreduce.allreduce_add_rms_norm(x, r, w, *mb, eps=EPS, axis="model", parts=parts)
        return allreduce.allreduce_add_rms_norm_reference(x, r, w, eps=EPS, axis="model")

    def once(x, r, w, *mb):
        s, y = op(x[0], r, w, mb)
        return s[None], y[None]

    def loop(x, r, w, k, *mb):
        c = (lax.axis_index("model") + 1).astype(jnp.float32) / n

        def step(i, carry):
            s, y = carry
            for _ in range(chain):
                s, y = op(y if feed == "direct" else y.astype(jnp.float32) * c, s, w, mb)
            return s, y

        return lax.fori_loop(0, k, step, op(x[0], r, w, mb))[1][None]

    extra = (every,) if kernel else ()
    return (jax.jit(jax.shard_map(once, mesh=mesh, in_specs=(P("model"), P(), P()) + extra,
                                  out_specs=(P("model"), P("model")), check_vma=False)),
            jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(P("model"), P(), P(), P()) + extra,
                                  out_specs=P("model"), check_vma=False),
                    compiler_options=select.compiler_options() if options is None else options))


def per_call(loop, args, mailbox=None, iters: int = 200, chain: int = 8) -> float:
    """Seconds a call of `loop` (from `fused`, made with the same chain; mailbox: the kernel's):
    (best of 3 at `iters` iterations - best of 3 at none) / (iters x chain)."""
    boxes = () if mailbox is None else (mailbox,)

    def best(k):
        return timing.best_seconds(lambda: loop(*args, jnp.int32(k), *boxes))

    return (best(iters) - best(0)) / (iters * chain)
