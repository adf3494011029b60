"""Small helpers the Pallas kernels share: static sizes, the platform and its multiprocessors, masked
Triton loads and stores, and the padding the interpreter needs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

LOG2E = 1.4426950408889634
M_INIT = -1e30  # finite "minus infinity" for running maxima (masked logits use -inf)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1); static sizes only."""
    return 1 << max(0, int(n) - 1).bit_length()


def on_gpu() -> bool:
    """Whether the default backend is a GPU (the one way the package asks; `select.py` decides on it)."""
    return jax.default_backend() == "gpu"


def num_sms() -> int:
    """Multiprocessors of the default device (132, an H100 / H200's, where it does not say)."""
    return getattr(jax.devices()[0], "core_count", None) or 132


def load(ref, idx, *, mask=None, other=None, volatile=False):
    """plgpu.load of ref[idx] (Pallas Triton lowering); volatile: straight from memory (no L1 copy), for
    data other programs of the same launch wrote (see `arrive`)."""
    return plgpu.load(ref.at[idx], mask=mask, other=other, volatile=volatile)


def store(ref, idx, val, *, mask=None):
    """plgpu.store of val at ref[idx] (Pallas Triton lowering)."""
    plgpu.store(ref.at[idx], val, mask=mask)


def arrive(tickets_ref, idx, *, interpret: bool):
    """This program's arrival at the int32 counter tickets_ref[idx] -> the count before it (int32 scalar).

    Every thread's earlier stores and atomics are ordered before the count: a barrier of the program's
    threads, then one acq_rel atomic increment at GPU scope (release of what the program wrote, acquire
    of what the programs counted before it wrote). Of n programs arriving at one counter, the one that
    draws n - 1 runs after all the others' writes; it reads them with `load(..., volatile=True)`, and
    stores 0 back where the counter must be zero for the next launch. The interpreter runs one program
    at a time (no barrier there)."""
    if not interpret:
        plgpu.debug_barrier()
    return plgpu.atomic_add(tickets_ref, idx, jnp.int32(1))


def pad(a, shape, value=0):
    """Pads `a` at the end of each axis up to `shape` (the interpreter cannot read past an array's end;
    the Triton kernels mask such reads and get unpadded arrays)."""
    if tuple(a.shape) == tuple(shape):
        return a
    return jnp.pad(a, [(0, n - m) for m, n in zip(a.shape, shape)], constant_values=value)
