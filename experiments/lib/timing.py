"""Timing on the device, shared by the benchmarks: median per-call time and the copy roofline.

`time_fn` dispatches `calls` back-to-back calls of a jitted function (JAX dispatch is
asynchronous, so the device runs them back to back), blocks once, and reports the median over
`repeats` such batches divided by `calls`. `copy_bandwidth` is bytes read + written per second of
a large device-to-device copy measured in the same process: the denominator of every roofline.
`memory_stats` and `program_memory` are the device allocator's figures and a compiled program's
buffer sizes, in bytes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax._src.lib import _profiler  # the profiler session whose CUPTI records `kernel_records` reads
from jax.profiler import ProfileData

from eagle3_jax.pallas import select


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


def is_oom(e: BaseException) -> bool:
    """Whether an XLA error is the device (or its allocator) running out of memory."""
    msg = str(e)
    return "RESOURCE_EXHAUSTED" in msg or "Out of memory" in msg or "out of memory" in msg


def first_line(e: BaseException) -> str:
    """An error's first line (its type's name if it has none), at most 300 characters."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def copy_bandwidth(nbytes: int = 4 << 30, flag: str = "--copy_bytes") -> float:
    """Bytes per second (read + write) of copying an nbytes bf16 buffer on the default device. A
    buffer the device cannot hold (with its random fill and the copy) raises ValueError naming the
    size, the device and `flag`, the script's option that sets it."""
    copy = jax.jit(lambda a: a * jnp.bfloat16(1.0001))  # forces a read and a write of every element
    try:
        x = jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)
        t = time_fn(copy, x, calls=5, repeats=5)
    except jax.errors.JaxRuntimeError as e:
        if not is_oom(e):
            raise
        raise ValueError(f"{flag} {nbytes}: the copy-bandwidth buffer does not fit on {jax.devices()[0]} "
                         f"({first_line(e)}); pass a smaller {flag}") from None
    del x
    return 2 * nbytes / t


def device_info() -> dict:
    """The first device's kind and platform, the JAX version, today's date, the command line and
    "xla_flags": the XLA_FLAGS environment variable the run saw (None if unset; XLA options such
    as command buffers change timings without changing the command), and "compiler_options": the
    XLA options decode's programs and the timed loops compile with (`select.compiler_options`)."""
    d = jax.devices()[0]
    return dict(device=d.device_kind, platform=d.platform, jax_version=jax.__version__,
                date=datetime.date.today().isoformat(), command=" ".join(["python"] + sys.argv),
                xla_flags=os.environ.get("XLA_FLAGS"), compiler_options=select.compiler_options())


def memory_stats(device=None) -> dict | None:
    """The allocator's figures of `device` (default: the first local device) in bytes: "bytes_in_use"
    (now), "peak_bytes_in_use" (the most in use at once since the process started; never reset, so
    it only grows) and "bytes_limit" (what the allocator may hold), those the backend reports; None
    where it keeps none (CPU)."""
    d = jax.local_devices()[0] if device is None else device
    s = d.memory_stats()
    if not s:
        return None
    return {k: int(s[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in s}


def live_array_bytes(device=None) -> int:
    """Bytes that live jax.Arrays (`jax.live_arrays()`) hold on `device` (default: the first local
    device): against `memory_stats()["bytes_in_use"]`, what the allocator holds that no Python array
    references."""
    d = jax.local_devices()[0] if device is None else device
    # from each array's shard shape: reading its shards' data would make new (aliasing) live arrays
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * getattr(a.dtype, "itemsize", 0)
               for a in jax.live_arrays() if d in a.sharding.device_set)


def program_memory(compiled) -> dict | None:
    """A compiled program's buffers in bytes, from XLA's buffer assignment (`compiled.memory_analysis()`):
    "argument", "output", "alias" (outputs that reuse a donated argument's buffer), "temp" (scratch
    live inside the program), "code" (generated code), and "peak" = argument + output - alias + temp:
    what the program holds at once while it runs, its arguments (parameters included) counted. None
    where the backend reports nothing."""
    try:
        m = compiled.memory_analysis()
    except (NotImplementedError, jax.errors.JaxRuntimeError):  # a backend without buffer-assignment stats
        return None
    if m is None:
        return None
    out = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, alias=m.alias_size_in_bytes,
               temp=m.temp_size_in_bytes, code=m.generated_code_size_in_bytes)
    out = {k: int(v) for k, v in out.items()}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(compiled) -> dict:
    """Collective operations in a compiled program's HLO, by kind (COLLECTIVES; an async pair counts
    once): for a program that is one jitted loop (`step_timing.loop_time`), the collectives one
    iteration makes. Zeros on one device."""
    text = compiled.as_text() or ""
    return {op: len(re.findall(rf"\s{op}(?:-start)?\(", text)) for op in COLLECTIVES}


def allreduce_seconds(mesh, rows: int, width: int, axis: str = "model", dtype=jnp.bfloat16, iters: int = 100,
                      repeats: int = 3) -> float:
    """Seconds of one XLA all-reduce (`lax.psum` over `axis` of `mesh`) of a [rows, width] array, as a
    tensor-parallel layer makes it: n of them in one jitted fori_loop (`jax.shard_map`, the array
    whole on each device), (best time of n - best time of none) / n, the trip count an argument."""
    size = mesh.shape[axis]

    def loop(x, n):
        return jax.lax.fori_loop(0, n, lambda i, y: jax.lax.psum(y, axis) / size, x)

    run = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec()),
                                out_specs=jax.sharding.PartitionSpec(), check_vma=False))
    x = jax.device_put(jnp.ones((rows, width), dtype), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def best(n):
        n = jax.device_put(jnp.int32(n), x.sharding)
        return best_seconds(lambda: run(x, n), repeats)

    return (best(iters) - best(0)) / iters


def best_seconds(call, repeats: int = 3) -> float:
    """The fastest of `repeats` blocked calls of `call()` in wall-clock seconds, after one untimed call
    (compilation and first-touch out of the figure)."""
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return min(times)


def gib(nbytes) -> str:
    """nbytes as 'X.XX GiB'; '-' for None."""
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def time_calls(fn, arg_sets, *, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds per call of `fn` for short kernels (~5-50 us), host dispatch amortized.

    `arg_sets` is a list of argument tuples, all distinct (so XLA cannot merge identical calls;
    rotate several large inputs so that no call finds its data in L2). One jitted program calls
    `fn` once per set, back to back on the device, and returns every output; three programs are
    queued per measurement, so the figure is the per-call time in a stream of calls (what the kernel
    costs inside a jitted step), launch gaps and any per-launch host cost included.
    """
    n = len(arg_sets)
    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    return time_fn(many, list(arg_sets), calls=3, repeats=repeats, warmup=warmup) / n


def kernel_records(thunk, repeats: int = 3) -> list[tuple[str, int, int]]:
    """(name, start_ns, duration_ns) of every device kernel and device-side copy (MemcpyD2D, ...) run
    by `repeats` calls of `thunk()` (blocked on each), from the profiler's CUPTI records; [] where
    none exist (CPU). Call `thunk` once beforehand so that compilation stays out of the trace."""
    sess = _profiler.ProfilerSession()
    for _ in range(repeats):
        jax.block_until_ready(thunk())
    xspace = sess.stop()
    out = []
    for plane in ProfileData.from_serialized_xspace(xspace).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            out.extend((e.name, e.start_ns, e.duration_ns) for e in line.events)
    return out


def kernel_group(name: str) -> str:
    """A kernel's family: cuBLAS/cuDNN GEMMs -> "gemm", XLA fusions without their numeric suffix
    ("loop_fusion_12" -> "loop_fusion"), Pallas kernels by their name."""
    low = name.lower()
    if any(t in low for t in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        return "gemm"
    if low.startswith(("memcpy", "memset")):
        return name
    return re.sub(r"(_\d+)+$", "", name.split(".")[0])


def profile_calls(fn, arg_sets, *, repeats: int = 3) -> dict:
    """Device kernel time per call of `fn` from the profiler (CUPTI kernel records), same program
    as `time_calls`. Returns {"kernel_seconds": summed kernel time per call, "kernels": {name:
    seconds per call}, "span_seconds": first kernel start to last kernel end per call (launch gaps
    included, host gaps between the `repeats` programs excluded)}; {} where no device records exist
    (CPU)."""
    n = len(arg_sets)
    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    sets = list(arg_sets)
    jax.block_until_ready(many(sets))
    recs = kernel_records(lambda: many(sets), repeats)
    if not recs:
        return {}
    kernels, spans = {}, []
    for name, _, dur in recs:
        kernels[name] = kernels.get(name, 0.0) + dur * 1e-9
    starts = [r[1] for r in recs]
    ends = [r[1] + r[2] for r in recs]
    # spans: split the records into the `repeats` programs by the largest gaps between kernels
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    gaps = sorted(((starts[order[j + 1]] - ends[order[j]], j) for j in range(len(order) - 1)), reverse=True)
    cuts = sorted(j for _, j in gaps[:repeats - 1])
    lo = 0
    for c in cuts + [len(order) - 1]:
        idx = order[lo:c + 1]
        spans.append((max(ends[i] for i in idx) - min(starts[i] for i in idx)) * 1e-9)
        lo = c + 1
    per = n * repeats
    return dict(kernel_seconds=sum(kernels.values()) / per, span_seconds=float(sorted(spans)[len(spans) // 2]) / n,
                kernels={k: v / per for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]})


def write_json(path, result: dict) -> None:
    """Writes a benchmark's result dict (creating the folder); no-op when path is None."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
