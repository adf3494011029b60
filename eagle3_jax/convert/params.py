"""Host arrays -> a module's parameters, including fused ones that several checkpoint tensors fill
side by side (the q, k, v projections share one [in, (Hq + 2 Hkv) * D] matrix)."""

from __future__ import annotations

import jax
import numpy as np


def qkv_columns(num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """{"q" | "k" | "v": (start, stop)}: each projection's columns of the fused qkv matrix."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}


class Filler:
    """Sets nnx variables from host arrays: whole, or column by column (`cols` = (start, stop) of the
    last axis). A variable set by columns is assembled on the host and goes to the device once all
    its columns are in; `finish()` raises if one was left incomplete."""

    def __init__(self):
        self._open = {}  # id(var) -> (var, host buffer, columns filled)

    def put(self, var, arr: np.ndarray, cols: tuple[int, int] | None = None) -> None:
        want = var.get_value()
        if cols is None:
            var.set_value(jax.device_put(np.ascontiguousarray(arr).astype(want.dtype, copy=False)))
            return
        _, buf, filled = self._open.get(id(var), (var, None, 0))
        if buf is None:
            buf = np.empty(want.shape, want.dtype)
        buf[..., cols[0]:cols[1]] = arr
        filled += cols[1] - cols[0]
        if filled == buf.shape[-1]:
            self._open.pop(id(var), None)
            var.set_value(jax.device_put(buf))
        else:
            self._open[id(var)] = (var, buf, filled)

    def finish(self) -> None:
        if self._open:
            raise RuntimeError(f"{len(self._open)} fused parameter(s) left with columns unset")


def columns(value, cols: tuple[int, int] | None):
    """A parameter's value, or the columns [start, stop) of its last axis, as a host numpy array."""
    return np.asarray(jax.device_get(value if cols is None else value[..., cols[0]:cols[1]]))
