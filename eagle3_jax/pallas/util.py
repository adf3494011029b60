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


def load(ref, idx, *, mask=None, other=None):
    """plgpu.load of ref[idx] (Pallas Triton lowering)."""
    return plgpu.load(ref.at[idx], mask=mask, other=other)


def store(ref, idx, val, *, mask=None):
    """plgpu.store of val at ref[idx] (Pallas Triton lowering)."""
    plgpu.store(ref.at[idx], val, mask=mask)


def pad(a, shape, value=0):
    """Pads `a` at the end of each axis up to `shape` (the interpreter cannot read past an array's end;
    the Triton kernels mask such reads and get unpadded arrays)."""
    if tuple(a.shape) == tuple(shape):
        return a
    return jnp.pad(a, [(0, n - m) for m, n in zip(a.shape, shape)], constant_values=value)
