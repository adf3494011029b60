"""Validated, memory-mapped reading of safetensors checkpoints (one file or sharded with an index).

Tensors are memory-mapped one at a time, so host memory never holds a checkpoint twice;
`TensorInfo.read(index)` reads one block of a tensor (the byte runs it covers, nothing else), for
loaders that place each device's shard from the file (`jax.make_array_from_callback`). Every
problem (missing file, truncated file, bad header, unknown dtype, missing key) raises ValueError
naming the file and key. `load_progress` is the bar the loaders show over a big checkpoint's bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np

from eagle3_jax.convert import folders

DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "U8": np.uint8,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_,
}
INDEX = "model.safetensors.index.json"
EXPECTED = "expected a folder with config.json and *.safetensors files"
# progress=None shows a bar for checkpoints past this size or in several shards (gpt-oss-120b: 65 GB in 15)
PROGRESS_MIN_BYTES = 1 << 30
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


class TensorInfo:
    __slots__ = ("file", "key", "dtype", "shape", "offset", "nbytes")

    def __init__(self, file, key, dtype, shape, offset, nbytes):
        self.file, self.key, self.dtype, self.shape, self.offset, self.nbytes = file, key, dtype, shape, offset, nbytes

    def load(self) -> np.ndarray:
        """The tensor as a read-only memory map (no copy)."""
        if self.nbytes == 0:
            return np.zeros(self.shape, DTYPES[self.dtype])
        raw = np.memmap(self.file, dtype=np.uint8, mode="r", offset=self.offset, shape=(self.nbytes,))
        return raw.view(DTYPES[self.dtype]).reshape(self.shape)

    def read(self, index=()) -> np.ndarray:
        """The block `index` of the tensor as a new array, read from the file: `index` is a tuple of
        slices of step 1 (or None), one per leading axis (missing axes: whole). Only the bytes of
        the block are read: one read per contiguous run (the block's rows when it cuts the leading
        axis, one run per outer position when it cuts an inner axis). Raises ValueError for a
        step other than 1 or more slices than axes."""
        bounds = block_bounds(self.shape, index, f"{self.file}: {self.key}")
        dtype = np.dtype(DTYPES[self.dtype])
        out = np.empty([b - a for a, b in bounds], dtype)
        if out.size == 0:
            return out
        cut = [i for i, (a, b) in enumerate(bounds) if (a, b) != (0, self.shape[i])]
        k = cut[-1] if cut else 0  # axes after k are whole: each run is bounds[k] x the rest
        strides = [int(np.prod(self.shape[i + 1:], dtype=np.int64)) for i in range(len(self.shape))]
        run = (bounds[k][1] - bounds[k][0]) * strides[k] * dtype.itemsize if self.shape else dtype.itemsize
        flat = out.reshape(-1).view(np.uint8)
        with open(self.file, "rb") as f:
            fd = f.fileno()
            for n, outer in enumerate(np.ndindex(*[b - a for a, b in bounds[:k]])):
                start = sum((bounds[i][0] + j) * strides[i] for i, j in enumerate(outer))
                start = (start + (bounds[k][0] * strides[k] if self.shape else 0)) * dtype.itemsize
                got = os.pread(fd, run, self.offset + start)
                if len(got) != run:
                    raise ValueError(f"{self.file}: {self.key}: truncated while reading")
                flat[n * run:(n + 1) * run] = np.frombuffer(got, np.uint8)
        return out


def block_bounds(shape: tuple, index, where: str = "index") -> list[tuple[int, int]]:
    """[(start, stop)] per axis of `shape` for `index` (a tuple of step-1 slices or None, one per
    leading axis; missing axes whole), as `jax.make_array_from_callback` passes them."""
    index = tuple(index or ())
    if len(index) > len(shape):
        raise ValueError(f"{where}: {len(index)} slices for shape {list(shape)}")
    out = []
    for n, s in zip(shape, index + (slice(None),) * (len(shape) - len(index))):
        a, b, step = (s if s is not None else slice(None)).indices(n)
        if step != 1:
            raise ValueError(f"{where}: slice step {step}, only 1 is read")
        out.append((a, max(a, b)))
    return out


def read_header(file: str) -> dict[str, TensorInfo]:
    """Parses and validates one .safetensors file's header: key -> TensorInfo.

    Checked as safetensors itself checks a file, each failure a ValueError naming the file (and the
    key where one is at fault): an 8-byte length, then a JSON object of at most MAX_HEADER_BYTES;
    every entry {"dtype": one of DTYPES, "shape": [ints >= 0], "data_offsets": [start, end]} with
    end - start the bytes of that shape and dtype; the entries' byte ranges, in order, cover the
    data after the header exactly (no gap, no overlap, nothing past the end, no byte left over);
    no key twice."""
    file = os.fspath(file)
    if not os.path.isfile(file):
        raise ValueError(f"{file}: file not found")
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{file}: truncated: {size} bytes, no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"{file}: header length {n} bytes is over safetensors' limit of {MAX_HEADER_BYTES} "
                                 "(not a safetensors file?)")
            if 8 + n > size:
                raise ValueError(f"{file}: truncated: the header's length says {n} bytes, the file has "
                                 f"{size - 8} after the length")
            raw = f.read(n)
    except OSError as e:
        raise ValueError(f"{file}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, a key twice
        raise ValueError(f"{file}: malformed safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: malformed safetensors header: expected a JSON object, found "
                         f"{type(header).__name__}")
    base = 8 + n
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise ValueError(f"{file}: __metadata__: expected an object of strings, found {meta!r}")
            continue
        dtype, shape, start, end = _entry(file, key, meta)
        nbytes = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize  # exact: a huge shape cannot overflow
        if end - start != nbytes:
            raise ValueError(f"{file}: {key}: header gives {end - start} bytes for shape {list(shape)} {dtype}, "
                             f"expected {nbytes}")
        if base + end > size:
            raise ValueError(f"{file}: truncated: {key} needs bytes up to {base + end}, file has {size}")
        out[key] = TensorInfo(file, key, dtype, shape, base + start, nbytes)
    at, last = base, None
    for info in sorted(out.values(), key=lambda t: (t.offset, t.nbytes)):
        if info.offset != at:
            start, what = info.offset - base, "overlap" if info.offset < at else "leave a gap after"
            raise ValueError(f"{file}: {info.key}: data_offsets [{start}, {start + info.nbytes}] {what} "
                             f"{last or 'the header'} (which ends at {at - base})")
        at, last = at + info.nbytes, info.key
    if at != size:
        raise ValueError(f"{file}: {size - at} bytes after the last tensor's data (the header's data_offsets do not "
                         "cover the file)")
    return out


def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return dict(pairs)


def _entry(file: str, key: str, meta) -> tuple[str, tuple, int, int]:
    """(dtype, shape, start, end) of one header entry, each checked for type and range."""
    if not isinstance(meta, dict):
        raise ValueError(f"{file}: {key}: malformed header entry {meta!r} (expected dtype, shape, data_offsets)")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in meta:
            raise ValueError(f"{file}: {key}: header entry has no {field}")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"{file}: {key}: unsupported dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_natural(s) for s in shape):
        raise ValueError(f"{file}: {key}: shape {shape!r}, expected a list of integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise ValueError(f"{file}: {key}: data_offsets {offsets!r}, expected [start, end] with 0 <= start <= end")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _natural(v) -> bool:
    return type(v) is int and v >= 0


def open_checkpoint(path: str) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint folder: via `model.safetensors.index.json` when present, else every
    *.safetensors file in it (or `path` itself when it is a file).

    Raises ValueError for a writer's leftover temporary folder (`folders.is_temporary`; a folder
    missing after an interrupted replacement names the previous version left beside it), an index
    that is not {"weight_map": {key: file name}}, a folder with an index and a *.safetensors file
    the index does not name (a stale file beside the index: which weights are meant is unclear), a
    key a shard holds that the index places elsewhere or not at all, or a key in two files."""
    path = os.fspath(path)
    if folders.is_temporary(path):
        raise ValueError(f"{path}: an unfinished or replaced checkpoint a writer left behind, not a checkpoint")
    if os.path.isfile(path):
        return read_header(path)
    if not os.path.isdir(path):
        previous = folders.previous_versions(path)
        hint = f"; an interrupted save left the previous checkpoint in {previous[-1]}" if previous else ""
        raise ValueError(f"{path}: checkpoint folder not found ({EXPECTED}){hint}")
    index = os.path.join(path, INDEX)
    present = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if os.path.exists(index):
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
        stale = [f for f in present if f not in weight_map.values()]
        if stale:
            raise ValueError(f"{path}: holds {INDEX} and {', '.join(stale)}, which the index does not name; remove "
                             "the stale file or the index (a checkpoint is one or the other)")
    else:
        weight_map = None
        files = present
        if not files:
            raise ValueError(f"{path}: no *.safetensors files and no {INDEX} ({EXPECTED})")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        for key, info in read_header(os.path.join(path, name)).items():
            if key in tensors:
                raise ValueError(f"{info.file}: {key}: also stored in {tensors[key].file}")
            if weight_map is not None and weight_map.get(key) != name:
                where = f"places it in {weight_map[key]}" if key in weight_map else "does not list it"
                raise ValueError(f"{info.file}: {key}: {INDEX} {where}")
            tensors[key] = info
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in tensors:
                raise ValueError(f"{os.path.join(path, name)}: {key}: listed in {INDEX} but not in the file")
    return tensors


def _weight_map(index: str) -> dict[str, str]:
    """The index's weight_map, checked: keys to plain *.safetensors file names of the same folder."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError, OSError) as e:
        raise ValueError(f"{index}: malformed index, expected {{\"weight_map\": {{key: file}}}} ({e!r})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map: expected an object, found {type(weight_map).__name__}")
    for key, name in weight_map.items():
        if not (isinstance(name, str) and name.endswith(".safetensors") and os.path.basename(name) == name
                and name not in (".", "..")):
            raise ValueError(f"{index}: weight_map: {key}: {name!r} is not a *.safetensors file name of this folder")
    return weight_map


class _NoBar:
    def update(self, n=1):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def load_progress(tensors: dict[str, TensorInfo], progress: bool | None, desc: str):
    """A context manager giving a bar to `.update(nbytes)` as tensors load: a tqdm.auto bar over the
    bytes of `tensors` when `progress` is True, or None and the checkpoint is big enough to wait for
    (more than PROGRESS_MIN_BYTES or more than one file); else a no-op (tqdm is not even imported)."""
    total = sum(t.nbytes for t in tensors.values())
    if progress is None:
        progress = total > PROGRESS_MIN_BYTES or len({t.file for t in tensors.values()}) > 1
    if not progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True)


def get(tensors: dict[str, TensorInfo], key: str, shape: tuple, where: str, kinds: str = "f") -> np.ndarray:
    """The memory-mapped tensor `key`, checked against the expected shape and dtype kind
    ('f' floating, 'u' uint8, 'i' integer, 'b' bool; several letters allow several)."""
    return check(tensors, key, shape, where, kinds).load()


def check(tensors: dict[str, TensorInfo], key: str, shape: tuple, where: str, kinds: str = "f") -> TensorInfo:
    """The TensorInfo of `key` once checked as `get` checks it (nothing of the tensor is read)."""
    if key not in tensors:
        raise ValueError(f"{where}: missing tensor {key} (expected shape {list(shape)})")
    info = tensors[key]
    if tuple(info.shape) != tuple(shape):
        raise ValueError(f"{info.file}: {key}: expected shape {list(shape)}, found {list(info.shape)}")
    kind = {"BF16": "f", "F16": "f", "F32": "f", "F64": "f", "U8": "u", "BOOL": "b"}.get(info.dtype, "i")
    if kind not in kinds:
        raise ValueError(f"{info.file}: {key}: unexpected dtype {info.dtype}")
    return info


def check_all_used(tensors: dict[str, TensorInfo], used, where: str, what: str) -> None:
    """Raises ValueError naming the checkpoint tensors outside `used` (rotary `inv_freq` buffers
    aside): weights a model built from the config would silently leave out."""
    unused = sorted(set(tensors) - set(used) - {k for k in tensors if k.endswith("rotary_emb.inv_freq")})
    if unused:
        more = f" (and {len(unused) - 6} more)" if len(unused) > 6 else ""
        raise ValueError(f"{where}: tensors this {what} has no place for: {', '.join(unused[:6])}{more}; "
                         "config.json does not match the checkpoint")
