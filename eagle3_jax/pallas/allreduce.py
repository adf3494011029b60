"""One-shot all-reduce of a decode-sized residual update, fused with the residual add and RMSNorm
that follow it: Pallas Mosaic GPU, Hopper GPUs of one host driven by one process.

`allreduce_add_rms_norm(x, residual, scale, mailbox, *, eps, axis)`, inside `jax.shard_map` over the
mesh axis `axis` (M devices): x [R, H] this device's partial sum (f32 or bf16), residual [R, H],
scale [H], mailbox this device's shard of a `Mailbox`. With t the sum of x over the M devices in
f32, in device order (every device computes the same bits): s = (t + residual) rounded to
residual.dtype, y = s * rsqrt(mean(s^2) + eps) * scale in f32, rounded likewise; returns (s, y).
`allreduce_add_rms_norm_reference` is the same through `lax.psum`, on any platform.

One block (one warpgroup) a row, grid (R,): TMA brings the row of x and of the residual into shared
memory (viewed as [H / 64, 64], zero rows padding it to a multiple of 8, so that thread t holds the
same elements on every device); each thread writes its elements into slot `me` of every peer's
inbox (`plgpu.remote_ref`), fences, adds 1 to its flag on every peer, spins until every peer's flag
for it has counted this call, sums the M slots, tells each peer it has read its slot, and
normalizes; s and y leave by TMA. The inbox and flags are a `Mailbox`, buffers made once
(`new_mailbox`) and passed to every program as an argument: they outlive the calls, flags count
calls and are never reset, so no handshake precedes the exchange (a kernel output as the inbox
would need one: a peer may not write a buffer of a call that has not started). Every device must
make the same calls in the same order, as the SPMD programs of one mesh do.

2 H200s, JAX 0.11.2, chains of 8 calls in a jitted loop (experiments/results/
reduce_norm_probe_h200x2.json): 13.1 / 14.4 / 15.1 / 17.5 us a call at R = 1 / 4 / 16 / 64; the
reference 25.6 / 19.0 / 19.2 / 21.0 us (what was tried: docs/perf/multi_gpu.md).

Requires H % 64 == 0, R <= MAX_ROWS, the mesh's devices in this process in device-id order, and a
shard_map over the concrete `Mesh` (under an abstract one Mosaic GPU records no device ids and the
call fails at run time: "No replica ids found").
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, llvm, memref, scf

F32 = jnp.float32
LANES = 64  # a row is viewed as [H / LANES, LANES]
MAX_ROWS = 64  # one block a row: decode (B) and verify (B x draft tokens) sizes
THREADS = 128  # one warpgroup a block
SPLAT = plgpu.Layout.WG_SPLAT(())
FLAG_LAYOUT = plgpu.Layout.WG_STRIDED((THREADS,), vec_size=1)  # element t: thread t


class Mailbox(NamedTuple):
    """Per device (global arrays sharded on their first axis over every device of the mesh):
    data f32 [M, MAX_ROWS, P, 64], slot k of row b: device k's row of x; flags int32
    [MAX_ROWS, 3, M, 128]: [b, 0, k, t] messages arrived from device k, [b, 1, k, t] our messages
    device k has read, [b, 2, 0, t] calls made (thread t of row b's block)."""
    data: jax.Array
    flags: jax.Array


def new_mailbox(mesh, hidden: int, axis: str = "model") -> Mailbox:
    """A zeroed Mailbox for every device of `mesh` (model groups along `axis`), for rows of `hidden`."""
    M, n = mesh.shape[axis], mesh.size
    Pr = _padded(hidden // LANES)
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    data = jax.jit(lambda: jnp.zeros((n * M, MAX_ROWS, Pr, LANES), F32), out_shardings=sharding)()
    flags = jax.jit(lambda: jnp.zeros((n * MAX_ROWS, 3, M, THREADS), jnp.int32), out_shardings=sharding)()
    return Mailbox(data, flags)


def copied(hlo_text: str, mailbox: Mailbox) -> bool:
    """Whether a compiled program (its optimized HLO, `compiled.as_text()`) copies an array of the
    Mailbox's per-device shape. The kernel would then write a copy made when the program starts,
    which a peer that starts first may already have written: a lost flag, a hang. Callers compile
    without the Mailbox (XLA's all-reduce) where this is True."""
    names = {jnp.float32: "f32", jnp.int32: "s32"}
    shapes = {f"{names[jnp.dtype(a.dtype).type]}[{','.join(map(str, a.sharding.shard_shape(a.shape)))}]"
              for a in mailbox}
    return any(m.group(1) in shapes for m in re.finditer(r"=\s*(\w+\[[\d,]*\])\{[^}]*\}\s+copy(?:-start)?\(",
                                                             hlo_text))


def _padded(h_rows: int) -> int:
    """Rows of LANES a padded row occupies: a multiple of 8 (128 threads x 4 f32 each)."""
    return -(-h_rows // 8) * 8


def check_shapes(x, residual, scale):
    """Raises ValueError unless x and residual are [R, H] with H % 64 == 0, R <= MAX_ROWS, scale [H]."""
    if x.ndim != 2 or residual.shape != x.shape or scale.shape != (x.shape[1],):
        raise ValueError(f"allreduce_add_rms_norm: expected x [R, H], residual [R, H], scale [H]; got x "
                         f"{x.shape}, residual {residual.shape}, scale {scale.shape}")
    if x.shape[1] % LANES or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"allreduce_add_rms_norm: H must be a multiple of {LANES} and R in [1, {MAX_ROWS}]; "
                         f"got R={x.shape[0]}, H={x.shape[1]}")


def _load(ref, layout):
    """ref[...] in registers with `layout` (the index argument: JAX 0.10 requires it, 0.11 warns)."""
    return plgpu.load(ref, (), layout=layout)


def _i32(v):
    return arith.constant(ir.IntegerType.get_signless(32), v)


def _index(v):
    return arith.index_cast(ir.IndexType.get(), v)


def _spin_until_at_least(ptr, value):
    """This thread spins until the i32 at ptr (acquire, system scope) is >= value (unsigned)."""
    i32 = ir.IntegerType.get_signless(32)
    loop = scf.WhileOp([], [])
    with ir.InsertionPoint(loop.before.blocks.append()):
        v = llvm.inline_asm(i32, [ptr], "ld.acquire.sys.global.b32 $0, [$1];", "=r,l", has_side_effects=True)
        scf.condition(arith.cmpi(arith.CmpIPredicate.ult, v, value), [])
    with ir.InsertionPoint(loop.after.blocks.append()):
        scf.yield_([])


def _wait(kind: int, ahead: int, M: int):
    """Each thread t waits until flags[kind, k, t] >= calls + ahead for every peer k, where calls =
    flags[2, 0, t] (the calls this block made before this one). flags: this row's [3, M, 128]."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), SPLAT))
    def f(ctx, ref, me):
        del ctx
        me = me.registers.item()
        t = gpu.thread_id(gpu.Dimension.x)
        e = arith.addi(memref.load(ref, [_index(_i32(2)), _index(_i32(0)), t]), _i32(ahead))
        for off in range(1, M):
            k = _index(arith.remui(arith.addi(me, _i32(off)), _i32(M)))
            _spin_until_at_least(mgu.memref_ptr(mgu.memref_slice(ref, (kind, k, t))), e)
    return f


@plgpu.inline_mgpu()
def _fence_release(ctx):
    """Every thread: its earlier loads and stores are performed before its later ones (system scope)."""
    del ctx
    mgu.fence_release_sys()


def _body(x_ref, r_ref, w_ref, data, flags, s_ref, y_ref, xs, rs, ss, ys, bar, *, axis, M, H, eps):
    """Row `row` of the call. x_ref / r_ref / s_ref / y_ref [R, H/64, 64] in GMEM; w_ref f32 [P, 64]
    (scale, zero rows after H/64); data, flags: the Mailbox shards (inputs written in place); xs,
    rs, ss, ys [P, 64] shared memory; bar: the two loads' TMA barrier. Thread t of every device holds
    the same elements, so each thread synchronizes on flags of its own."""
    row, me = lax.axis_index("row"), lax.axis_index(axis)
    n, Pr = H // LANES, xs.shape[0]
    layout = plgpu.Layout.WG_STRIDED((Pr, LANES), vec_size=4)
    zeros = plgpu.layout_cast(jnp.zeros((Pr, LANES), F32), layout)
    ones = plgpu.layout_cast(jnp.ones((THREADS,), jnp.int32), FLAG_LAYOUT)
    xs[...] = zeros.astype(xs.dtype)  # the padding rows stay zero
    rs[...] = zeros.astype(rs.dtype)
    plgpu.commit_smem()
    plgpu.copy_gmem_to_smem(x_ref.at[row], xs.at[pl.ds(0, n)], bar)
    plgpu.copy_gmem_to_smem(r_ref.at[row], rs.at[pl.ds(0, n)], bar)
    fl = flags.at[row]
    peers = [{axis: lax.rem(me + off, M)} for off in range(1, M)]  # mesh coordinates along `axis`
    _wait(1, 0, M)(fl, me)  # every peer has read our previous message
    plgpu.barrier_wait(bar)
    x = _load(xs, layout).astype(F32)
    data.at[me, row][...] = x
    for p in peers:
        plgpu.remote_ref(data, p).at[me, row][...] = x
    _fence_release()
    for p in peers:
        plgpu.atomic_add(plgpu.remote_ref(flags, p).at[row, 0, me], ones)
    _wait(0, 1, M)(fl, me)  # every peer's message of this call has arrived
    t = _load(data.at[0, row], layout)
    for k in range(1, M):  # device order: the same sum on every device
        t = t + _load(data.at[k, row], layout)
    _fence_release()
    for p in peers:  # their slots are read: they may write the next message
        plgpu.atomic_add(plgpu.remote_ref(flags, p).at[row, 1, me], ones)
    fl.at[2, 0][...] = plgpu.load(fl.at[2, 0], (), layout=FLAG_LAYOUT) + ones
    s = (t + _load(rs, layout).astype(F32)).astype(ss.dtype)
    s32 = s.astype(F32)
    inv = lax.rsqrt(jnp.sum(s32 * s32) / H + eps)
    ss[...] = s
    ys[...] = (s32 * inv * _load(w_ref, layout)).astype(ys.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ss.at[pl.ds(0, n)], s_ref.at[row])
    plgpu.copy_smem_to_gmem(ys.at[pl.ds(0, n)], y_ref.at[row])
    plgpu.wait_smem_to_gmem(0)


def allreduce_add_rms_norm(x, residual, scale, mailbox: Mailbox, *, eps: float, axis: str):
    """See the module docstring. Inside shard_map over `axis`, mailbox this device's shard; GPU
    only (the Mosaic GPU interpreter has no peer memory)."""
    check_shapes(x, residual, scale)
    M = lax.axis_size(axis)
    R, H = x.shape
    n = H // LANES
    Pr = _padded(n)
    data, flags = mailbox
    if data.shape[1:] != (MAX_ROWS, Pr, LANES) or flags.shape[1:] != (3, M, THREADS):
        raise ValueError(f"allreduce_add_rms_norm: mailbox data {data.shape} / flags {flags.shape} are not for "
                         f"H={H} over {M} devices (new_mailbox(mesh, {H}))")
    dt = residual.dtype
    w = jnp.pad(scale.astype(F32).reshape(n, LANES), ((0, Pr - n), (0, 0)))
    out = jax.ShapeDtypeStruct((R, n, LANES), dt)
    smem = [plgpu.SMEM((Pr, LANES), t) for t in (x.dtype, dt, dt, dt)]
    s, y = plgpu.kernel(
        functools.partial(_body, axis=axis, M=M, H=H, eps=float(eps)),
        out_type=(out, out), scratch_types=(*smem, plgpu.Barrier(num_arrivals=2)),
        grid=(R,), grid_names=("row",),
    )(x.reshape(R, n, LANES), residual.reshape(R, n, LANES), w, data, flags)
    return s.reshape(R, H), y.reshape(R, H)


def allreduce_add_rms_norm_reference(x, residual, scale, *, eps: float, axis: str):
    """`allreduce_add_rms_norm` through `lax.psum` (XLA's all-reduce) and jnp."""
    t = lax.psum(x.astype(F32), axis)
    s = (t + residual.astype(F32)).astype(residual.dtype)
    s32 = s.astype(F32)
    y = s32 * lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + eps) * scale.astype(F32)
    return s, y.astype(residual.dtype)
