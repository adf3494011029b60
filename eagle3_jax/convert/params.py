"""Host arrays -> a module's parameters, including fused ones that several checkpoint tensors fill
side by side along one axis (the target's q, k, v projections share one [(Hq + 2 Hkv) * D, in]
matrix, the draft's one [in, (Hq + 2 Hkv) * D]): whole (`Filler`), or placed shard by shard on a
mesh from blocks read out of the checkpoint (`place`, `Source`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.convert import safetensors_io as stio

FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def float_dtype(fn: str, dtype) -> jnp.dtype:
    """`dtype` as a jnp.dtype when it is one of FLOAT_DTYPES (the dtypes a model computes in), else
    ValueError naming `fn`, the argument, expected and found (an integer dtype would load weights
    that are all zeros)."""
    try:
        d = jnp.dtype(dtype) if dtype is not None else None
    except TypeError:
        d = None
    if d is None or d.name not in FLOAT_DTYPES:
        found = d.name if d is not None else repr(dtype)
        raise ValueError(f"{fn}: dtype: expected a floating dtype ({', '.join(FLOAT_DTYPES)}), found {found}")
    return d


def expect_module(fn: str, module, cls) -> None:
    """ValueError naming `fn`, the expected class and the given one unless `module` is a `cls`
    (a writer checks this before it creates or touches anything)."""
    if not isinstance(module, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise ValueError(f"{fn}: expected {article} {cls.__name__} model, got {type(module).__name__}")


def qkv_columns(num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """{"q" | "k" | "v": (start, stop)}: each projection's outputs along the fused qkv axis."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}


class Filler:
    """Sets nnx variables from host arrays: whole, or part by part (`cols` = (start, stop) along
    `axis`, by default the last). A variable set by parts is assembled on the host and goes to the
    device once all of them are in; `finish()` raises if one was left incomplete."""

    def __init__(self):
        self._open = {}  # id(var) -> (var, host buffer, columns filled)

    def put(self, var, arr: np.ndarray, cols: tuple[int, int] | None = None, axis: int = -1) -> None:
        want = var.get_value()
        if cols is None:
            var.set_value(jax.device_put(np.ascontiguousarray(arr).astype(want.dtype, copy=False)))
            return
        _, buf, filled = self._open.get(id(var), (var, None, 0))
        if buf is None:
            buf = np.empty(want.shape, want.dtype)
        np.moveaxis(buf, axis, -1)[..., cols[0]:cols[1]] = np.moveaxis(arr, axis, -1)
        filled += cols[1] - cols[0]
        if filled == buf.shape[axis]:
            self._open.pop(id(var), None)
            var.set_value(jax.device_put(buf))
        else:
            self._open[id(var)] = (var, buf, filled)

    def finish(self) -> None:
        if self._open:
            raise RuntimeError(f"{len(self._open)} fused parameter(s) left with columns unset")


def columns(value, cols: tuple[int, int] | None, axis: int = -1):
    """A parameter's value, or [start, stop) of it along `axis` (by default the last), as a host
    numpy array."""
    if cols is not None:
        value = jax.lax.slice_in_dim(value, cols[0], cols[1], axis=axis)
    return np.asarray(jax.device_get(value))


class Source(NamedTuple):
    """One checkpoint tensor that fills (part of) a parameter. read(index) -> the checkpoint
    tensor's block `index` (a tuple of (start, stop) slices, one per axis; safetensors_io's
    TensorInfo.read); transpose: the parameter holds it with its last two axes swapped; cols:
    (start, stop) along the parameter's `axis` it fills (fused qkv), None: all of it."""
    read: Callable
    transpose: bool = False
    cols: tuple[int, int] | None = None
    axis: int = -1


def block(shape: tuple, dtype, sources, bounds: list[tuple[int, int]]) -> np.ndarray:
    """The block `bounds` ([(start, stop)] per axis) of a parameter of `shape` / `dtype` assembled
    from `sources` (Source): each reads only its tensor's part of the block (the part of the
    block inside its `cols` along its `axis`; axes swapped back through `transpose`), cast to
    `dtype` as `Filler` casts, so every block equals the same slice of the whole parameter exactly."""
    out = None
    for src in sources:
        b = list(bounds)
        ax = src.axis % len(bounds)
        lo, hi, at = b[ax][0], b[ax][1], 0
        if src.cols is not None:
            lo, hi = max(lo, src.cols[0]), min(hi, src.cols[1])
            if lo >= hi:
                continue
            at = lo - bounds[ax][0]
            b[ax] = (lo - src.cols[0], hi - src.cols[0])
        if src.transpose:
            b[-2], b[-1] = b[-1], b[-2]
        a = src.read(tuple(slice(x, y) for x, y in b))
        a = np.swapaxes(a, -1, -2) if src.transpose else a
        if src.cols is None:
            return np.ascontiguousarray(a).astype(dtype, copy=False)
        if out is None:
            out = np.empty([y - x for x, y in bounds], dtype)
        np.moveaxis(out, ax, -1)[..., at:at + hi - lo] = np.moveaxis(a, ax, -1)
    if out is None:
        raise RuntimeError(f"no source fills the block {bounds} of a parameter of shape {list(shape)}")
    return out


def place(shape: tuple, dtype, sharding: jax.sharding.Sharding, sources) -> jax.Array:
    """A parameter of `shape` / `dtype` laid out by `sharding`, built by
    `jax.make_array_from_callback`: each device's shard is `block` of it, read from `sources`
    (Source); a block several local devices share (replicated axes) is read once. Only the blocks
    of this process's devices are read (under jax.distributed, each process reads its own)."""
    done = {}

    def shard(index):
        bounds = stio.block_bounds(shape, index)
        key = tuple(bounds)
        if key not in done:
            done[key] = block(shape, dtype, sources, bounds)
        return done[key]

    return jax.make_array_from_callback(tuple(shape), sharding, shard, dtype=dtype)


def place_all(groups: dict, variable, sharding, bar) -> None:
    """Sets each parameter of `groups` ({path tuple: [(TensorInfo, Source), ...]}, its sources) to
    `place` of them: `variable(path)` is the nnx variable to set (its value gives shape and dtype),
    `sharding(path)` its sharding; `bar` (a progress bar) advances by the bytes of each group."""
    for path, group in groups.items():
        var = variable(path)
        want = var.get_value()
        var.set_value(place(want.shape, want.dtype, sharding(path), [src for _, src in group]))
        bar.update(sum(info.nbytes for info, _ in group))
