"""Device memory of a `generate` / `decode` call, checked before it compiles and before it allocates.

Two checks, each a ValueError that names the batch, the cache slots a row, what is needed and what
is free a device, and the largest batch that fits:

- `check_state`, before compiling: the decode state's bytes a device (`state_bytes`: the KV caches,
  the output buffer and the per-row fields; exact, from shapes alone) against the free memory. A
  batch x context whose caches alone cannot fit fails here without compiling anything.
- `check_program`, after compiling and before running: the compiled program's bytes a device from
  XLA's buffer assignment (`program_bytes`: its temporaries, the state among them, and its outputs)
  against the free memory. This one is exact for the program; a program that passes may still fail
  to allocate where the free memory is fragmented.

Free memory (`free_bytes`) is what each device's allocator reports: memory_stats()["bytes_limit"] -
["bytes_in_use"], the fewest bytes over the devices of the run (on a mesh: this process's devices
of it), on a mesh over several processes the fewest over them (`fewest_over_processes`: every
process decides alike).
A device that reports no figures (CPU: `memory_stats()` is None) is not checked, unless the caller
names a limit itself (`generate(..., memory_limit=...)`). On a mesh every figure is a
device's share: the target's caches split over data x model, the rest of the state over data.
"""

from __future__ import annotations

import collections
import weakref

import jax
import numpy as np

from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.spec import adaptive
from eagle3_jax.spec.state import Plan

ROW_SCALARS = 3 * 4 + 1  # a row's lengths, root, n_out (int32) and done (bool) in DecodeState
_ROWS: collections.OrderedDict = collections.OrderedDict()  # `row_bytes` of the last few configs and plans
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # `program_bytes` of live executables


def free_bytes(devices) -> int | None:
    """The fewest bytes free on any of `devices` (jax devices): bytes_limit - bytes_in_use of each
    one's allocator (`jax.Device.memory_stats()`); None where a device reports no such figures (CPU)."""
    free = []
    for d in devices:
        stats = d.memory_stats()
        if not stats or "bytes_limit" not in stats or "bytes_in_use" not in stats:
            return None
        free.append(int(stats["bytes_limit"]) - int(stats["bytes_in_use"]))
    return min(free) if free else None


def fewest_over_processes(free: int | None) -> int | None:
    """The fewest of every process's `free` (None where any process passes None), so that the
    processes of a run refuse a call together rather than some wait in a collective for the others.
    A collective over the processes: every one must call it (as they all run a call on a mesh that
    spans them)."""
    from jax.experimental import multihost_utils

    mine = np.array([-1, 0] if free is None else [free >> 31, free & (2 ** 31 - 1)], np.int32)  # int32 halves
    every = np.asarray(multihost_utils.process_allgather(mine)).astype(np.int64)
    return None if (every[:, 0] < 0).any() else int((every[:, 0] << 31 | every[:, 1]).min())


def run_devices(mesh, params) -> list:
    """The devices of this process a run uses: those of `mesh` (a jax.sharding.Mesh) that are local,
    or without a mesh the devices the first array of `params` (a pytree) is on."""
    if mesh is not None:
        return list(mesh.local_devices)
    leaves = jax.tree.leaves(params)
    return sorted(leaves[0].devices(), key=lambda d: d.id) if leaves else []


def _nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _split(mesh) -> tuple[int, int]:
    """(data, model) sizes of `mesh` (1, 1 without one)."""
    return (1, 1) if mesh is None else (mesh.shape["data"], mesh.shape["model"])


def row_bytes(models, plan: Plan, mesh=None) -> int:
    """Bytes one row (sequence) of the decode state takes on a device: its share of the target's KV
    caches (kv heads split over the mesh's "model" axis), the draft's caches and hidden state (plan
    depth >= 1), its out_len output ids (twice with plan.trace: the trace), its scalars, and with
    plan.auto its acceptance estimates (spec/adaptive.py). models: (target, draft or None). Kept for
    the last few (configs, dtypes, plan, model axis): they depend on nothing else."""
    target, draft = models
    _, model = _split(mesh)
    key = (target.config, np.dtype(target.dtype), plan, model) + (
        (draft.config, np.dtype(draft.dtype)) if plan.depth else ())
    if key not in _ROWS:
        _ROWS[key] = _row_bytes(target, draft, plan, model)
        while len(_ROWS) > 64:
            _ROWS.popitem(last=False)
    return _ROWS[key]


def _row_bytes(target, draft, plan, model):
    caches = jax.eval_shape(lambda: gpt_oss.init_cache(target, 1, plan.cache_len, max_step_tokens=plan.step_tokens))
    n = _nbytes(caches) // model + plan.out_len * 4 * (1 + plan.trace) + ROW_SCALARS
    if plan.auto:
        _, _, families, positions = adaptive.shape_arrays(plan.auto)
        n += families * positions * (4 + 4) + len(plan.auto) * 4  # est, seen, expected: float32
        width = len(plan.feature_ids) * target.config.hidden_size  # the held inputs: count, tokens, features
        n += 4 + adaptive.HOLD * (4 + width * np.dtype(target.dtype).itemsize)
    if plan.depth:
        caches = jax.eval_shape(lambda: eagle3.init_cache(draft, 1, plan.cache_len, max_step_tokens=plan.step_tokens))
        n += _nbytes(caches) + draft.config.hidden_size * np.dtype(draft.dtype).itemsize
    return n


def local_rows(batch: int, mesh=None) -> int:
    """Rows of a batch a device holds: batch over the mesh's "data" axis, rounded up (the batch is
    padded to a multiple of it)."""
    return -(-batch // _split(mesh)[0])


def state_bytes(models, plan: Plan, batch: int, mesh=None) -> int:
    """Bytes a device holds of the `DecodeState` of `batch` rows under `plan` (its arrays, the
    caches first of all; the few it holds once for the batch left out: budget, key, counters, ...),
    from shapes alone: nothing is compiled or allocated."""
    return local_rows(batch, mesh) * row_bytes(models, plan, mesh)


def program_bytes(compiled) -> int | None:
    """Bytes a device needs to run `compiled` (a jax.stages.Compiled) beyond its arguments: XLA's
    temporaries (the decode state among them: the loop makes it) and outputs, outputs aliasing an
    argument counted once (`memory_analysis()`, read once an executable); None where the backend
    gives no analysis."""
    if compiled not in _PROGRAMS:
        m = compiled.memory_analysis()
        _PROGRAMS[compiled] = None if m is None else int(m.temp_size_in_bytes + m.output_size_in_bytes -
                                                         m.alias_size_in_bytes)
    return _PROGRAMS[compiled]


def size(n: int) -> str:
    """n bytes for a message: bytes below a MiB, MiB below a GiB, GiB above."""
    if abs(n) < 2 ** 20:
        return f"{n} bytes"
    return f"{n / 2 ** 20:.1f} MiB" if abs(n) < 2 ** 30 else f"{n / 2 ** 30:.2f} GiB"


def _refuse(batch, plan, free, source, need, largest):
    raise ValueError(f"prompts: a batch of {batch} with {plan.cache_len} cache slots a row does not fit device "
                     f"memory: {need}, {size(free)} is free a device ({source}); the largest batch that fits is "
                     f"{largest}")


def check_state(models, plan: Plan, batch: int, free: int, mesh=None, source: str = "memory_limit") -> None:
    """Raises ValueError unless the decode state of `batch` rows (`state_bytes`) fits `free` bytes a
    device; the message gives both figures and the largest batch whose state fits (a multiple of the
    mesh's data axis). source: where `free` came from, for the message."""
    need = state_bytes(models, plan, batch, mesh)
    if need > free:
        row = row_bytes(models, plan, mesh)
        _refuse(batch, plan, free, source, f"its decode state (KV caches and outputs) needs {size(need)} a device",
                _split(mesh)[0] * max(free // row, 0))


def check_program(compiled, models, plan: Plan, batch: int, free: int, mesh=None, source: str = "memory_limit",
                  host_bytes: int = 0) -> None:
    """Raises ValueError unless `compiled` (the call's program, for `batch` rows under `plan`) fits
    `free` bytes a device with `host_bytes` of arguments still to be copied there (`program_bytes`;
    nothing is checked where XLA gives no analysis). The largest batch that fits is estimated: the
    state exactly, the program's other bytes taken to grow in proportion to the rows."""
    need = program_bytes(compiled)
    if need is None or need + host_bytes <= free:
        return
    need += host_bytes
    rows, state = local_rows(batch, mesh), state_bytes(models, plan, batch, mesh)
    other = max(need - state, 0)
    per_row = row_bytes(models, plan, mesh) + other / rows
    _refuse(batch, plan, free, source, f"the compiled program needs {size(need)} a device (XLA's buffer "
            f"assignment: the decode state {size(state)}, other temporaries, outputs and arguments "
            f"{size(other)})", f"about {_split(mesh)[0] * max(int(free // per_row), 0)} (the other bytes taken to grow "
            "with the batch)")
