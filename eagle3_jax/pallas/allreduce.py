"""One-shot all-reduce of a decode-sized residual update, fused with the residual add and RMSNorm
that follow it: Pallas Mosaic GPU, Hopper GPUs of one host driven by one process.

`allreduce_add_rms_norm(x, residual, scale, mailbox, *, eps, axis)`, inside `jax.shard_map` over the
mesh axis `axis` (M devices): x [R, H] this device's partial sum (f32 or bf16), residual [R, H],
scale [H], mailbox this device's shard of a `Mailbox`. With t the sum of x over the M devices in
f32, in device order (every device computes the same bits): s = (t + residual) rounded to
residual.dtype, y = s * rsqrt(mean(s^2) + eps) * scale in f32, rounded likewise; returns (s, y).
`allreduce_add_rms_norm_reference` is the same through `lax.psum`, on any platform.

A row's blocks (one warpgroup each; `parts_for`: 6 at H = 2880 for up to 4 rows, 1 from 16): TMA
brings the row of x into shared memory ([H / 64, 64], zero rows padding to a multiple of 8: thread t
holds the same elements on every device); each block stores its share of the row into slot `rank`
of its own and every peer's inbox, each element beside a flag (the call's number) in one 8-byte
half of a 16-byte volatile store, so data and signal arrive together with no fence. Block 0 reloads
slot k of its own inbox, k = 0 .. M-1, until every flag is this call's, sums in device order, adds
the residual, normalizes and writes. Peers are reached through plain device addresses (a table in
the `Mailbox`; the GPUs of one process have peer access), not `plgpu.remote_ref` or
`lax.axis_index`: a kernel reading XLA's collective metadata makes XLA launch a barrier (5-7 us)
before every call. Calls alternate between two slots, reused with no handshake (a peer writes call
c + 2 only after reading our call c + 1). After MAX_SPINS reloads a kernel traps (an error, not a
hang). Every device must make the same calls in the same order, as one mesh's SPMD programs do.

4 H200s, JAX 0.11.2, loops as CUDA graphs (experiments/results/reduce_norm_parts_h200x4.json, chains
of 8 calls): 6.7 / 8.1 / 9.6 / 17.5 us a call at 1 / 4 / 16 / 64 rows over 2 devices, 8.8 / 11.0 /
16.6 / 42.1 over 4 (XLA's all-reduce + add + norm: 14.0-20.9 and 15.5-25.5). Requires H % 64 == 0,
R <= MAX_ROWS and every device of the mesh in this process.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, llvm, memref, scf, vector

F32 = jnp.float32
I32 = jnp.int32
LANES = 64  # a row is viewed as [H / LANES, LANES]
MAX_ROWS = 64  # decode (B) and verify (B x draft tokens) sizes
MAX_BLOCKS = 128  # blocks a call can have: all resident at once on a 132-SM Hopper GPU
SPREAD_BLOCKS = 24  # blocks a call's rows are spread over by default (`parts_for`)
THREADS = 128  # one warpgroup a block
MAX_SPINS = 1 << 25  # reloads of a slot before a kernel gives up on a peer (tens of seconds)
VEC = 4  # f32 elements a thread holds contiguously (WG_STRIDED): elements 512 i + 4 t + j
SPLAT = plgpu.Layout.WG_SPLAT(())


class Mailbox(NamedTuple):
    """Per device (global arrays sharded on their first axis over every device of the mesh):
    inbox int32 [2, M, MAX_ROWS, P * 64 * 2]: [c % 2, k, b] device k's row b of x at call c of that
    row (counted from 0), element e as words 2e (its f32 bits) and 2e + 1 (c + 1); calls int32
    [MAX_ROWS, 128]: [b, t] the calls row b's thread t has made; peers int32 [M, 2]: the (low, high)
    32 bits of the address of inbox on device k of this device's model group; rank int32 [1, 1]:
    this device's index k in its group. The kernel writes inbox and calls in place: a program must
    not copy them (`copied`), and the arrays must live as long as the programs that use them."""
    inbox: jax.Array
    calls: jax.Array
    peers: jax.Array
    rank: jax.Array


def new_mailbox(mesh, hidden: int, axis: str = "model") -> Mailbox:
    """A zeroed Mailbox for every device of `mesh` (model groups along `axis`), for rows of `hidden`,
    with each device's table of its group's inbox addresses. Raises ValueError unless every device of
    the mesh belongs to this process (the addresses are this process's)."""
    if mesh.is_multi_process:
        raise ValueError(f"new_mailbox: the mesh spans {jax.process_count()} processes; the one-shot kernel "
                         "needs every device in this process")
    M, n = mesh.shape[axis], mesh.size
    words = _padded(hidden // LANES) * LANES * 2
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    inbox = jax.jit(lambda: jnp.zeros((n * 2, M, MAX_ROWS, words), I32), out_shardings=sharding)()
    calls = jax.jit(lambda: jnp.zeros((n * MAX_ROWS, THREADS), I32), out_shardings=sharding)()
    address = {s.device: s.data.unsafe_buffer_pointer() for s in inbox.addressable_shards}
    names = list(mesh.axis_names)
    k_axis = names.index(axis)
    devices = mesh.devices  # order of the flattened mesh = the order of the shards along axis 0
    table = np.zeros((n, M, 2), np.int64)
    rank = np.zeros((n, 1), np.int32)
    for i, d in enumerate(devices.flat):
        idx = np.argwhere(devices == d)[0]
        rank[i] = idx[k_axis]
        for k in range(M):
            peer = tuple(idx[:k_axis]) + (k,) + tuple(idx[k_axis + 1:])
            a = address[devices[peer]]
            table[i, k] = (a & 0xFFFFFFFF, a >> 32)
    peers = jax.device_put(table.astype(np.uint32).view(np.int32).reshape(n * M, 2), sharding)
    return Mailbox(inbox, calls, peers, jax.device_put(rank, sharding))


def copied(hlo_text: str, mailbox: Mailbox) -> bool:
    """Whether a compiled program (its optimized HLO, `compiled.as_text()`) copies an array of the
    Mailbox's per-device shape. The kernel would then write a copy made when the program starts,
    which a peer that starts first may already have written: a lost message, a hang. Callers compile
    without the Mailbox (XLA's all-reduce) where this is True."""
    names = {jnp.float32: "f32", jnp.int32: "s32"}
    shapes = {f"{names[jnp.dtype(a.dtype).type]}[{','.join(map(str, a.sharding.shard_shape(a.shape)))}]"
              for a in (mailbox.inbox, mailbox.calls)}  # the kernel only reads peers and rank
    return any(m.group(1) in shapes for m in re.finditer(r"=\s*(\w+\[[\d,]*\])\{[^}]*\}\s+copy(?:-start)?\(",
                                                             hlo_text))


def row_width(mailbox: Mailbox) -> int:
    """The row width (a multiple of 64) a device's Mailbox shard (inside shard_map) carries with
    no more room than rows of its `new_mailbox` hidden size: that size padded as the kernel pads it."""
    return mailbox.inbox.shape[-1] // 2


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


def _int(v, bits=32):
    return arith.constant(ir.IntegerType.get_signless(bits), v)


def _address(ref):
    """The i64 address of a GMEM memref's first element."""
    return llvm.ptrtoint(ir.IntegerType.get_signless(64), mgu.memref_ptr(ref))


def _store_line(address, words):
    """One 16-byte store of four i32 words (volatile: straight to memory, here or over NVLink)."""
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [address, *words],
                    "st.volatile.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", has_side_effects=True)


def _load_line(address):
    """One volatile 16-byte load -> four i32 words."""
    i32 = ir.IntegerType.get_signless(32)
    out = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [address],
                          "ld.volatile.global.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                          has_side_effects=True)
    return [llvm.extractvalue(i32, out, [j]) for j in range(4)]


def _trap_if(cond):
    """Ends the kernel with an error (PTX trap) where cond holds: a peer that never writes (its
    program stopped, or it made different calls) fails the program instead of hanging it."""
    when = scf.IfOp(cond)
    with ir.InsertionPoint(when.then_block):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "trap;", "", has_side_effects=True)
        scf.yield_([])


def _line(base, parity, k, row64, t, i, half, M, words):
    """Byte address of thread t's 16-byte line (register i, half) of row `row64` in slot k of the
    inbox at `base` (i64 values; M, words static): elements 512 i + 4 t + 2 half + (0, 1)."""
    i64 = ir.IntegerType.get_signless(64)
    slot = arith.addi(arith.muli(arith.extui(i64, parity), _int(M, 64)), k)
    off = arith.muli(arith.addi(arith.muli(slot, _int(MAX_ROWS, 64)), row64), _int(words * 4, 64))
    lane = arith.muli(arith.index_cast(i64, t), _int(VEC * 8, 64))
    return arith.addi(base, arith.addi(off, arith.addi(lane, _int(i * THREADS * VEC * 8 + 16 * half, 64))))


def _call(calls, row):
    """(thread id, row as i64, the calls thread t of this row made, their parity) at a kernel's start."""
    t = gpu.thread_id(gpu.Dimension.x)
    row32 = row.registers.item()
    count = memref.load(calls, [arith.index_cast(ir.IndexType.get(), row32), t])
    return t, arith.extui(ir.IntegerType.get_signless(64), row32), count, arith.andi(count, _int(1))


def _send(M: int, parts: int, layout):
    """(inbox, calls, peers, x, me, row, part) -> nothing: thread t of the row's block `part` writes
    its registers i with i * parts // V == part (V registers in all: each of the row's `parts` blocks
    sends its share) into slot `me` of every inbox of its group (peers[k], its own among them), each
    element beside the flag c + 1 (c: the calls the row made before) in one 8-byte half of a
    16-byte store, so data and signal arrive together with no fence and no separate signal."""
    arg_types = (plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), layout, plgpu.RefType(), SPLAT, SPLAT)

    @plgpu.inline_mgpu(arg_types=arg_types)
    def f(ctx, inbox, calls, peers, x, me, row, part):
        del ctx
        i32, i64, index = (ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64),
                           ir.IndexType.get())
        words = ir.MemRefType(inbox.type).shape[-1]
        t, row64, count, parity = _call(calls, row)
        flag = arith.addi(count, _int(1))
        zero = arith.constant(index, 0)
        me64 = arith.extui(i64, memref.load(me, [zero, zero]))
        part = part.registers.item()
        vec_i32 = ir.VectorType.get((VEC,), i32)
        regs = list(x.registers.flat)

        def peer_address(k):
            lo, hi = (arith.extui(i64, memref.load(peers, [arith.constant(index, k), arith.constant(index, j)]))
                      for j in (0, 1))
            return arith.ori(lo, arith.shli(hi, _int(32, 64)))

        bases = [peer_address(k) for k in range(M)]
        for i, r in enumerate(regs):
            b = [vector.extract(arith.bitcast(vec_i32, r), [], [j]) for j in range(VEC)]
            mine = scf.IfOp(arith.cmpi(arith.CmpIPredicate.eq, part, _int(i * parts // len(regs))))
            with ir.InsertionPoint(mine.then_block):
                for base in bases:
                    for half in range(2):
                        _store_line(_line(base, parity, me64, row64, t, i, half, M, words),
                                    [b[2 * half], flag, b[2 * half + 1], flag])
                scf.yield_([])

    return f


def _receive(M: int, shape, layout):
    """(inbox, calls, row) -> the sum over the M devices of the row's x (f32, `shape` in `layout`), in
    device order: thread t reads slot k of its own inbox for k = 0 .. M - 1, loading its lines again
    until every flag says c + 1, then records the call (c + 1 in calls). Calls alternate between two
    slots by c % 2: a device writes call c + 2 only after its own receiving block read this device's
    call c + 1, that is after this device's kernel of call c has finished reading. The count a
    sending block reads cannot be the new one: the receiver records it only after reading that
    block's own writes, made after it read the count."""
    arg_types = (plgpu.RefType(), plgpu.RefType(), SPLAT)

    @plgpu.inline_mgpu(arg_types=arg_types, return_type=plgpu.ShapeDtypeStruct(shape, F32, layout=layout))
    def f(ctx, inbox, calls, row):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        words = ir.MemRefType(inbox.type).shape[-1]
        t, row64, count, parity = _call(calls, row)
        flag = arith.addi(count, _int(1))
        own = _address(inbox)
        V = shape[0] * shape[1] // (THREADS * VEC)
        vec_i32 = ir.VectorType.get((VEC,), i32)
        true = arith.constant(ir.IntegerType.get_signless(1), 1)
        total = None
        for k in range(M):  # device order: the same sum on every device
            n = V * VEC
            wait = scf.WhileOp([i32] * (n + 1), [_int(0)])
            tries = wait.before.blocks.append(i32)
            with ir.InsertionPoint(tries):
                values, ok = [], true
                for i in range(V):
                    for half in range(2):
                        w = _load_line(_line(own, parity, _int(k, 64), row64, t, i, half, M, words))
                        values += [w[0], w[2]]
                        for word in (w[1], w[3]):
                            ok = arith.andi(ok, arith.cmpi(arith.CmpIPredicate.eq, word, flag))
                scf.condition(arith.xori(ok, true), values + [tries.arguments[0]])
            after = wait.after.blocks.append(*[i32] * (n + 1))
            with ir.InsertionPoint(after):
                spins = arith.addi(after.arguments[n], _int(1))
                _trap_if(arith.cmpi(arith.CmpIPredicate.ugt, spins, _int(MAX_SPINS)))
                scf.yield_([spins])
            got = list(wait.results)[:n]
            vecs = [arith.bitcast(ir.VectorType.get((VEC,), ir.F32Type.get()),
                                  vector.from_elements(vec_i32, got[VEC * i:VEC * (i + 1)]))
                    for i in range(V)]
            total = vecs if total is None else [arith.addf(a, b) for a, b in zip(total, vecs)]
        memref.store(flag, calls, [arith.index_cast(ir.IndexType.get(), row.registers.item()), t])
        registers = layout.to_mgpu().registers_shape(shape)
        return mgpu.FragmentedArray(_registers=np.array(total, dtype=object).reshape(registers),
                                    _layout=layout.to_mgpu(), _is_signed=None)

    return f


def max_parts(hidden: int) -> int:
    """The most blocks a row of `hidden` can be sent from: the registers a thread holds of the padded
    row (6 for 2880: 48 rows of 64 over 128 threads, 4 f32 a register), each sent whole."""
    return _padded(hidden // LANES) // 8


def parts_for(rows: int, hidden: int) -> int:
    """Blocks a row's message is sent from by default: `max_parts`, at most SPREAD_BLOCKS // rows
    blocks a call (reduce_norm_parts_h200x4.json: 1 and 4 rows gained from 6 blocks a row, 16 and
    64 rows lost)."""
    return max(1, min(max_parts(hidden), SPREAD_BLOCKS // rows))


def _body(x_ref, r_ref, w_ref, inbox, calls, peers, rank, s_ref, y_ref, xs, rs, ws, ss, ys, bar_x, bar_rw, *, M,
          H, eps, parts):
    """Block (row, part) of the call. x_ref / r_ref / s_ref / y_ref [R, H/64, 64], w_ref [H/64, 64] in
    GMEM; inbox, calls, peers, rank: the Mailbox shards (inbox and calls written in place); xs, rs,
    ws, ss, ys [P, 64] shared memory; bar_x, bar_rw: the loads' TMA barriers. Thread t of every
    device holds the same elements (padding rows zero), so each thread exchanges its own elements
    only. Every block sends its share of the row; block 0 receives, adds, normalizes and writes."""
    row, part = lax.axis_index("row"), lax.axis_index("part")
    n, Pr = H // LANES, xs.shape[0]
    layout = plgpu.Layout.WG_STRIDED((Pr, LANES), vec_size=VEC)
    zeros = plgpu.layout_cast(jnp.zeros((Pr, LANES), F32), layout)
    for buf in (xs, rs, ws):
        buf[...] = zeros.astype(buf.dtype)
    plgpu.commit_smem()
    plgpu.copy_gmem_to_smem(x_ref.at[row], xs.at[pl.ds(0, n)], bar_x)

    @pl.when(part == 0)
    def _():
        plgpu.copy_gmem_to_smem(r_ref.at[row], rs.at[pl.ds(0, n)], bar_rw)
        plgpu.copy_gmem_to_smem(w_ref, ws.at[pl.ds(0, n)], bar_rw)

    plgpu.barrier_wait(bar_x)
    _send(M, parts, layout)(inbox, calls, peers, _load(xs, layout).astype(F32), rank, row, part)

    @pl.when(part == 0)
    def _():
        plgpu.barrier_wait(bar_rw)
        t = _receive(M, (Pr, LANES), layout)(inbox, calls, row)
        s = (t + _load(rs, layout).astype(F32)).astype(ss.dtype)
        s32 = s.astype(F32)
        inv = lax.rsqrt(jnp.sum(s32 * s32) / H + eps)
        ss[...] = s
        ys[...] = (s32 * inv * _load(ws, layout).astype(F32)).astype(ys.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ss.at[pl.ds(0, n)], s_ref.at[row])
        plgpu.copy_smem_to_gmem(ys.at[pl.ds(0, n)], y_ref.at[row])
        plgpu.wait_smem_to_gmem(0)


def allreduce_add_rms_norm(x, residual, scale, mailbox: Mailbox, *, eps: float, axis: str, parts: int | None = None):
    """See the module docstring. Inside shard_map over `axis`, mailbox this device's shard; GPU
    only (the Mosaic GPU interpreter has no peer memory). parts: blocks a row is sent from (1 to
    `max_parts(H)`, rows x parts <= MAX_BLOCKS); by default `parts_for`."""
    check_shapes(x, residual, scale)
    M = lax.axis_size(axis)
    R, H = x.shape
    n = H // LANES
    Pr = _padded(n)
    inbox, calls, peers, rank = mailbox
    if (inbox.shape[1:] != (M, MAX_ROWS, Pr * LANES * 2) or calls.shape != (MAX_ROWS, THREADS)
            or peers.shape != (M, 2) or rank.shape != (1, 1)):
        raise ValueError(f"allreduce_add_rms_norm: mailbox inbox {inbox.shape} / calls {calls.shape} / peers "
                         f"{peers.shape} / rank {rank.shape} are not for H={H} over {M} devices "
                         f"(new_mailbox(mesh, {H}))")
    G = parts_for(R, H) if parts is None else parts
    if not 1 <= G <= max_parts(H) or R * G > MAX_BLOCKS:
        raise ValueError(f"allreduce_add_rms_norm: parts={G} for R={R}, H={H}; expected 1 to {max_parts(H)} with "
                         f"R x parts <= {MAX_BLOCKS}")
    dt = residual.dtype
    out = jax.ShapeDtypeStruct((R, n, LANES), dt)
    smem = [plgpu.SMEM((Pr, LANES), t) for t in (x.dtype, dt, scale.dtype, dt, dt)]
    s, y = plgpu.kernel(
        functools.partial(_body, M=M, H=H, eps=float(eps), parts=G),
        out_type=(out, out), scratch_types=(*smem, plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=2)),
        grid=(R, G), grid_names=("row", "part"),
    )(x.reshape(R, n, LANES), residual.reshape(R, n, LANES), scale.reshape(n, LANES), inbox, calls, peers,
      rank)
    return s.reshape(R, H), y.reshape(R, H)


def allreduce_add_rms_norm_reference(x, residual, scale, *, eps: float, axis: str):
    """`allreduce_add_rms_norm` through `lax.psum` (XLA's all-reduce) and jnp."""
    t = lax.psum(x.astype(F32), axis)
    s = (t + residual.astype(F32)).astype(residual.dtype)
    s32 = s.astype(F32)
    y = s32 * lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + eps) * scale.astype(F32)
    return s, y.astype(residual.dtype)
