"""Device memory outside XLA's allocator that every GPU of a host can write: the one-shot all-reduce's
inboxes (pallas/allreduce.py), in one process for all local GPUs or in one process a GPU.

`allocate(device, nbytes)` -> the address of nbytes of zeroed memory on `device` (a jax Device):
`cuMemAlloc` in the device's primary context (the one XLA uses), through the CUDA driver library
(ctypes on libcuda.so.1). `export(device, address)` -> its 64-byte CUDA IPC handle; `open_handle(device,
handle)` -> the address at which `device`'s context reaches another process's allocation (peer access
enabled as it is mapped; the two GPUs need not both be visible to this process). XLA's own buffers
cannot be exported (`cuIpcGetMemHandle` refuses them: CUDA_ERROR_INVALID_VALUE on JAX 0.11.2), hence
this memory. On other platforms `allocate` returns the address of zeroed host memory, enough to trace
and lower programs that carry the addresses (the kernel runs only on GPUs). Memory is never freed: it
must outlive every compiled program that holds its address, which no one can tell; a Mailbox is
made once per mesh. `host_mapped(device, nbytes)` -> (host address, device address) of zeroed pinned
host memory a kernel on `device` can write and this process can read even after the device has
failed (the all-reduce's failure records). Errors raise RuntimeError naming the driver call and its
CUDA error."""

from __future__ import annotations

import ctypes
import functools

import numpy as np

HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
_LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_HOST_MAPPED = 0x01 | 0x02  # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
_KEPT: list = []  # every allocation (host buffers on other platforms), alive for the process's life


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * HANDLE_BYTES)]


@functools.cache
def _driver():
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"peer_memory: the CUDA driver library libcuda.so.1 cannot be loaded ({e})") from e
    _check(cuda, "cuInit", 0)
    return cuda


def _check(cuda, name, *args):
    rc = getattr(cuda, name)(*args)
    if rc:
        text = ctypes.c_char_p()
        cuda.cuGetErrorName(rc, ctypes.byref(text))
        raise RuntimeError(f"peer_memory: {name} failed with {(text.value or b'?').decode()} ({rc})")


@functools.cache
def _primary_context(ordinal: int) -> ctypes.c_void_p:
    """The primary context of CUDA device `ordinal` (the one XLA uses), retained once."""
    cuda = _driver()
    device, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(cuda, "cuDeviceGet", ctypes.byref(device), ordinal)
    _check(cuda, "cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
    return ctx


def _in_context(device, name, *args):
    """Driver call `name(*args)` with `device`'s primary context current."""
    cuda = _driver()
    _check(cuda, "cuCtxPushCurrent_v2", _primary_context(device.local_hardware_id))
    try:
        _check(cuda, name, *args)
    finally:
        _check(cuda, "cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))


def allocate(device, nbytes: int) -> int:
    """The address of nbytes (a multiple of 4) of zeroed memory on `device`, kept for the process's life."""
    if device.platform != "gpu":
        buf = np.zeros(nbytes // 4, np.int32)
        _KEPT.append(buf)
        return buf.ctypes.data
    address = ctypes.c_uint64()
    _in_context(device, "cuMemAlloc_v2", ctypes.byref(address), ctypes.c_size_t(nbytes))
    _KEPT.append(address.value)
    _in_context(device, "cuMemsetD32_v2", address, ctypes.c_uint(0), ctypes.c_size_t(nbytes // 4))
    _in_context(device, "cuCtxSynchronize")
    return address.value


def host_mapped(device, nbytes: int) -> tuple[int, int]:
    """(host address, device address) of nbytes of zeroed page-locked host memory that kernels on
    `device` reach at the device address (`cuMemHostAlloc`, mapped), kept for the process's life. The
    host reads it with plain loads, so what a kernel stored there before a trap stays readable after
    the device's context has failed. On other platforms both are the address of zeroed host memory."""
    if device.platform != "gpu":
        buf = np.zeros(-(-nbytes // 4), np.int32)
        _KEPT.append(buf)
        return buf.ctypes.data, buf.ctypes.data
    host, address = ctypes.c_void_p(), ctypes.c_uint64()
    _in_context(device, "cuMemHostAlloc", ctypes.byref(host), ctypes.c_size_t(nbytes), ctypes.c_uint(_HOST_MAPPED))
    _KEPT.append(host.value)
    ctypes.memset(host.value, 0, nbytes)
    _in_context(device, "cuMemHostGetDevicePointer_v2", ctypes.byref(address), host, ctypes.c_uint(0))
    return host.value, address.value


def export(device, address: int) -> bytes:
    """The CUDA IPC handle of the allocation at `address` (made by `allocate` on GPU `device`)."""
    handle = _Handle()
    _in_context(device, "cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(address))
    return bytes(handle.reserved)


def open_handle(device, handle: bytes) -> int:
    """The address at which `device` reaches the allocation another process exported as `handle`."""
    if len(handle) != HANDLE_BYTES:
        raise ValueError(f"peer_memory.open_handle: a handle of {HANDLE_BYTES} bytes expected, got {len(handle)}")
    h = _Handle()
    h.reserved = (ctypes.c_byte * HANDLE_BYTES).from_buffer_copy(handle)
    address = ctypes.c_uint64()
    _in_context(device, "cuIpcOpenMemHandle_v2", ctypes.byref(address), h, ctypes.c_uint(_LAZY_PEER_ACCESS))
    return address.value
