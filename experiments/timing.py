"""Timing on the device, shared by the benchmarks: median per-call time and the copy roofline.

`time_fn` dispatches `calls` back-to-back calls of a jitted function (JAX dispatch is
asynchronous, so the device runs them back to back), blocks once, and reports the median over
`repeats` such batches divided by `calls`. `copy_bandwidth` is bytes read + written per second of
a large device-to-device copy measured in the same process: the denominator of every roofline.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def time_fn(fn, *args, calls: int = 20, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds per call of `fn(*args)` (fn should be jitted; its compile is excluded)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t0) / calls)
    return statistics.median(per)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes per second (read + write) of copying an nbytes bf16 buffer on the default device."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * jnp.bfloat16(1.0001))  # forces a read and a write of every element
    t = time_fn(copy, x, calls=5, repeats=5)
    del x
    return 2 * nbytes / t


def device_info() -> dict:
    import datetime
    import sys

    d = jax.devices()[0]
    return dict(device=d.device_kind, platform=d.platform, jax_version=jax.__version__,
                date=datetime.date.today().isoformat(), command=" ".join(["python"] + sys.argv))
