"""What the kernel benchmarks share (bench_moe.py, bench_attention.py, bench_spec_ops.py,
bench_gemv.py): their common flags, the run over a script's sections (`main`), a section's failure
recorded in its own dict (`guard`), device profiles that may fail (`safe_profile`,
`profile_program`), the copy bandwidth measured once (`copy_bw`), timing a jitted function
(`jit_seconds`, `stream`), random trees and whether outputs agree (`same`).

A script defines its sections, `{name: function returning a dict}`, and calls `define_flags` and then
`cli.run(main(sections))`: `--only` picks sections (default: all), `--out` writes the JSON
{device_info..., "<section>": {...}, each with its "section_seconds"}, and a section's "table" (a list
of lines) is printed at the end. On a CPU the kernels run in the Pallas interpreter (`policy`).
"""

from __future__ import annotations

import functools
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from eagle3_jax.pallas.select import KernelPolicy

from . import timing

FLAGS = flags.FLAGS


def define_flags(sections) -> None:
    """--only (of `sections`), --out and --copy_bytes (idempotent: scripts that tests import side by
    side may each call it)."""
    if "only" in FLAGS:
        return
    flags.DEFINE_list("only", None, f"sections to run, of {','.join(sections)} (default: all)")
    flags.DEFINE_string("out", None, "JSON output path")
    flags.DEFINE_integer("copy_bytes", None, "bytes of the copy-bandwidth measurement (default: 4 GiB on GPUs, "
                         "256 MiB elsewhere)", lower_bound=1 << 10)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def policy(**choices) -> KernelPolicy:
    """A KernelPolicy forcing `choices` (e.g. spec_ops="kernel"), the kernels interpreted off a GPU
    (CPU smoke runs)."""
    return KernelPolicy(interpret=not on_gpu(), **choices)


_BW = {}


def copy_bw() -> float:
    """The copy bandwidth of this process's first device (`timing.copy_bandwidth` of --copy_bytes),
    measured on first use."""
    if "bw" not in _BW:
        size = FLAGS.copy_bytes or (4 << 30 if on_gpu() else 1 << 28)
        _BW["bw"] = timing.copy_bandwidth(size, "--copy_bytes")
    return _BW["bw"]


def jit_seconds(fn, *args, calls=3, repeats=5) -> float:
    """Median seconds per call of jax.jit(fn)(*args) (`timing.time_fn`); off a GPU (kernels interpreted:
    a smoke run, not a measurement) one call after one warm-up call."""
    if not on_gpu():
        return timing.time_fn(jax.jit(fn), *args, calls=1, repeats=1, warmup=1)
    return timing.time_fn(jax.jit(fn), *args, calls=calls, repeats=repeats)


def stream(fn, sets, repeats=5):
    """(seconds a call of fn in a stream of the sets' calls, as `timing.time_calls` times it: one jitted
    program calling fn on every set; fn's outputs on the first set, from that program). Off a GPU one
    repeat after one warm-up program (a smoke run)."""
    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    sets = list(sets)
    warm, repeats = (2, repeats) if on_gpu() else (1, 1)
    return timing.time_fn(many, sets, calls=3, repeats=repeats, warmup=warm) / len(sets), many(sets)[0]


def guard(fn):
    """A section whose failure is recorded in its dict ("error", and a FAILED line in its "table")
    instead of ending the other sections."""
    @functools.wraps(fn)
    def run():
        try:
            return fn()
        except Exception:  # noqa: BLE001
            err = traceback.format_exc()[-3000:]
            print(err, flush=True)
            return dict(error=err, table=[f"{fn.__name__}: FAILED {err.strip().splitlines()[-1][:200]}"])
    return run


def safe_profile(fn, sets) -> dict:
    """`timing.profile_calls(fn, sets)`, or {"profile_error": ...} where profiling fails; {} off a GPU
    (no device records to read)."""
    if not on_gpu():
        return {}
    try:
        return timing.profile_calls(fn, sets)
    except Exception as e:  # noqa: BLE001
        return dict(profile_error=repr(e)[:300])


def profile_program(run, calls) -> dict:
    """Device kernel time per call of one profiled `run()` holding `calls` calls (CUPTI records):
    {"kernel_seconds", "kernels": {name: launches}}, or {"profile_error": ...}."""
    try:
        recs = timing.kernel_records(run, repeats=1)
        names = {}
        for name, _, _ in recs:
            names[name] = names.get(name, 0) + 1
        return dict(kernel_seconds=sum(r[2] for r in recs) * 1e-9 / calls, kernels=names)
    except Exception as e:  # noqa: BLE001
        return dict(profile_error=repr(e)[:300])


def random_trees(rng, B, N, n_sets):
    """n_sets parent arrays int32 [B, N] (parents[:, 0] = -1): node i's parent among the 4 before it."""
    out = []
    for _ in range(n_sets):
        par = np.full((B, N), -1, np.int32)
        for i in range(1, N):
            par[:, i] = rng.integers(max(0, i - 4), i, B)
        out.append(jnp.asarray(par))
    return out


def same(a, b) -> bool:
    """Whether two pytrees of arrays (of one structure) are equal element for element."""
    return all(bool(jnp.all(x == y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def main(sections, after=None):
    """The script's main: the sections --only names (ValueError for others), the JSON to --out, then
    `after(result)` (a script's own summary) and each section's "table"."""
    def run(argv):
        del argv
        names = FLAGS.only or list(sections)
        unknown = [n for n in names if n not in sections]
        if unknown:
            raise ValueError(f"--only: unknown sections {unknown}; known: {sorted(sections)}")
        result = dict(timing.device_info())
        for name in names:
            t0 = time.perf_counter()
            result[name] = sections[name]()
            result[name]["section_seconds"] = time.perf_counter() - t0
        if FLAGS.out:
            os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
            with open(FLAGS.out, "w") as f:
                f.write(json.dumps(result, indent=1, default=float))
        if after is not None:
            after(result)
        for name in names:  # sections that bring their own table print it last
            if isinstance(result[name], dict) and result[name].get("table"):
                print("\n".join(result[name]["table"]))

    return run
