"""One-shot all-reduce of a decode-sized residual update, fused with the residual add and RMSNorm
that follow it: Pallas Mosaic GPU, Hopper GPUs of one host, one process for them all or one a GPU.

`allreduce_add_rms_norm(x, residual, scale, mailbox, *, eps, axis)`, inside `jax.shard_map` over the
mesh axis `axis` (M devices): x [R, H] this device's partial sum (f32 or bf16), residual [R, H],
scale [H], mailbox this device's shards of a `Mailbox`. With t the sum of x over the M devices in
f32, in device order (every device computes the same bits): s = (t + residual) rounded to
residual.dtype, y = s * rsqrt(mean(s^2) + eps) * scale in f32, rounded likewise; returns (s, y).
`allreduce_add_rms_norm_reference` is the same through `lax.psum`, on any platform.

A row's blocks (one warpgroup each; `parts_for`: at H = 2880, 6 for up to 4 rows, over 4 devices
up to 21) issue every load at once (the Mailbox's addresses, the row of x straight from global
memory into registers, thread t the same elements on every device, zeros padding the row to a
multiple of 512), and each stores its share into slot `rank` of every peer's inbox, each element
beside a flag (the call's number) in one 8-byte half of a 16-byte volatile store, so data and
signal arrive together with no fence. Block 0 reloads the slots of its inbox whose peers are not
all in until every flag is this call's, sums them with its own x in device order, adds the
residual, normalizes and writes s and y from registers. Inboxes are memory outside XLA
(`peer_memory`), reached through a table of addresses in the `Mailbox` (directly in one process,
through CUDA IPC across processes), not `plgpu.remote_ref` or `lax.axis_index`: a kernel reading
XLA's collective metadata makes XLA launch a barrier kernel before every call. Calls alternate
between two slots, reused with no handshake (see `_exchange`). Every device must make the same calls
in the same order. A device that has waited the Mailbox's `timeout_ms` for a peer's row (the peer's
program stopped, never started, or made other calls) writes a failure record (its rank, the missing
peer's, the call and the row) into page-locked host memory and traps: the program fails with a CUDA
error instead of hanging, the device's context is lost (the process must end), and
`failure_report()` reads the records and names the reduction, the device and the missing peer.

Requires H % 64 == 0, R <= MAX_ROWS and model groups whose GPUs share memory
(`shared_memory_problem`). Figures against XLA's all-reduce + add + norm: docs/perf/multi_gpu.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import socket

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, llvm, memref, scf, vector

from eagle3_jax.pallas import peer_memory

F32 = jnp.float32
I32 = jnp.int32
LANES = 64  # a row is viewed as [H / LANES, LANES]
MAX_ROWS = 64  # decode (B) and verify (B x draft tokens) sizes
MAX_BLOCKS = 128  # blocks a call can have: all resident at once on a 132-SM Hopper GPU
SPREAD_BLOCKS = 24  # blocks a call's rows are spread over by default (`parts_for`)
THREADS = 128  # one warpgroup a block
MAX_PARTS = 8  # blocks a row can be sent from (each has its own calls counter)
DEFAULT_TIMEOUT_MS = 5000  # wait for a peer before failing; see Mailbox.timeout_ms
RECORD_WORDS = 8  # a device's failure record: int32 [failed, rank, missing rank, call, row, waited us, 0, 0]
VEC = 4  # f32 elements a thread holds contiguously (WG_STRIDED): elements 512 i + 4 t + j
SPLAT = plgpu.Layout.WG_SPLAT(())
COUNTER_WORDS = MAX_ROWS * MAX_PARTS * THREADS  # a device's calls counters after its inbox
FLOATS = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mailbox:
    """Where a mesh's devices meet (global arrays sharded on their first axis over every device of the
    mesh; a device's shards): table int32 [M + 2, 2], the (low, high) 32 bits of the addresses, in
    this device's address space, of the inboxes of its model group's devices k = 0 .. M - 1, then of
    its own calls counter, then of its failure record (RECORD_WORDS int32 of page-locked host memory,
    `peer_memory.host_mapped`, one a device for the process); rank int32 [1, 1], its index k in the
    group; width (static), the padded row width the inboxes hold; timeout_ms (static), how long a
    kernel waits for a peer's row before it records the failure and traps (milliseconds, measured
    on the GPU's global timer from the start of its wait; `dataclasses.replace` gives a Mailbox of
    the same memory with another). The default leaves room for processes that reach their first
    call seconds apart (one compiles longer); one process could take far less. Each device's inbox
    and counter (`peer_memory.allocate`, zeroed, never
    freed) are int32 [2, M, MAX_ROWS, 2 width]: [c % 2, k, b] device k's row b of x at call c of that
    row (counted from 0), element e as words 2e (its f32 bits) and 2e + 1 (c + 1); then int32
    [MAX_ROWS, MAX_PARTS, 128]: [b, p, t] the calls row b's block p's thread t has made. The kernel
    writes only that memory, never an XLA buffer, so a program may copy a Mailbox's arrays like any
    others."""
    table: jax.Array
    rank: jax.Array
    width: int = dataclasses.field(metadata={"static": True})
    timeout_ms: int = dataclasses.field(default=DEFAULT_TIMEOUT_MS, metadata={"static": True})

    def __post_init__(self):
        if not isinstance(self.timeout_ms, int) or isinstance(self.timeout_ms, bool) or self.timeout_ms < 1:
            raise ValueError(f"Mailbox: timeout_ms must be a positive int (milliseconds); got {self.timeout_ms!r}")


_RECORDS: dict = {}  # device -> (host address of its failure record, its model group's device ids, axis)


@functools.cache
def _record(device) -> tuple[int, int]:
    """(host, device) addresses of `device`'s failure record, made once a process."""
    return peer_memory.host_mapped(device, 4 * RECORD_WORDS)


def failure_report() -> str | None:
    """What the fused all-reduce's kernels of this process recorded before trapping (see the module
    docstring): one line a device that gave up on a peer, naming the reduction, the device, the
    missing peer (rank and device id in its model group), the call and row; None where none did.
    Readable after the device has failed (the records are host memory)."""
    lines = []
    for device, (host, group, axis) in _RECORDS.items():
        rec = np.ctypeslib.as_array((ctypes.c_int32 * RECORD_WORDS).from_address(host)).copy()
        if rec[0] != 1:
            continue
        rank, missing, call, row, waited = (int(v) for v in rec[1:6])
        peer = f"device {group[missing]}" if 0 <= missing < len(group) else "outside its group"
        lines.append(f"allreduce_add_rms_norm (the fused all-reduce over {axis!r}): device {device.id} (rank {rank} "
                     f"of its group {group}) waited {waited / 1000:.0f} ms at call {call}, row {row}, for rank "
                     f"{missing} ({peer}), which never sent: its program stopped or never started, or the devices "
                     f"made different calls")
    return "\n".join(lines) or None


def _memory_bytes(M: int, width: int) -> int:
    return 4 * (2 * M * MAX_ROWS * 2 * width + COUNTER_WORDS)


def shared_memory_problem(mesh, axis: str = "model", hosts=None) -> str | None:
    """Why the devices of some model group (along `axis`) of `mesh` cannot reach each other's memory,
    or None where every group can: its devices all in this process, or each in its own process with
    every process of the group on one host (CUDA IPC). hosts: a host name for each process index
    (`process_hosts`), needed only where the mesh spans processes."""
    if not mesh.is_multi_process:
        return None
    names = list(mesh.axis_names)
    groups = np.moveaxis(mesh.devices, names.index(axis), -1).reshape(-1, mesh.shape[axis])
    for group in groups:
        procs = [d.process_index for d in group]
        if len(set(procs)) == 1:
            continue
        if len(set(procs)) != len(procs):
            return (f"the model group {[d.id for d in group]} spans processes {sorted(set(procs))} with several of "
                    "its devices in one process; expected one process for the group or one a device")
        if len({hosts[p] for p in procs}) > 1:
            return (f"the model group {[d.id for d in group]} spans hosts {sorted({hosts[p] for p in procs})}; "
                    "GPUs share memory only within a host")
    return None


def process_hosts() -> list[str]:
    """The host name of every process (index order), gathered from all of them (a collective: every
    process must call it at the same point)."""
    name = np.frombuffer(socket.gethostname().encode()[:64].ljust(64, b"\0"), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(name))
    return [bytes(row).rstrip(b"\0").decode() for row in every.reshape(jax.process_count(), 64)]


def new_mailbox(mesh, hidden: int, axis: str = "model", hosts=None) -> Mailbox:
    """A Mailbox for every device of `mesh` (model groups along `axis`), for rows of `hidden`: each
    device's zeroed inbox and counter, and each device's table of its group's inboxes, reached
    directly in one process and through CUDA IPC handles across processes (gathered from every
    process: a collective where the mesh spans processes; every process must call it alike). hosts:
    `process_hosts()` where the caller has it already (gathered here otherwise). Raises ValueError
    where a group's devices cannot share memory (`shared_memory_problem`)."""
    if mesh.is_multi_process and any(d.platform != "gpu" for d in mesh.devices.flat):
        raise ValueError(f"new_mailbox: a mesh across {jax.process_count()} processes shares memory only on "
                         f"GPUs (CUDA IPC); found {mesh.devices.flat[0].platform} devices")
    if mesh.is_multi_process and hosts is None:
        hosts = process_hosts()
    problem = shared_memory_problem(mesh, axis, hosts)
    if problem:
        raise ValueError(f"new_mailbox: {problem}")
    M, n = mesh.shape[axis], mesh.size
    width = _padded(hidden // LANES) * LANES
    nbytes = _memory_bytes(M, width)
    flat = list(mesh.devices.flat)  # the order of the shards along axis 0
    local = [d for d in flat if d.process_index == jax.process_index()]
    memory = {d: peer_memory.allocate(d, nbytes) for d in local}
    handles = {}
    if mesh.is_multi_process:
        mine = np.zeros((n, peer_memory.HANDLE_BYTES), np.uint8)
        for d in local:
            mine[flat.index(d)] = np.frombuffer(peer_memory.export(d, memory[d]), np.uint8)
        every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), n, -1)
        handles = {d: bytes(every[d.process_index, i]) for i, d in enumerate(flat)}
    k_axis = list(mesh.axis_names).index(axis)
    tables, ranks = [], []
    for d in local:
        idx = tuple(np.argwhere(mesh.devices == d)[0])
        group = [mesh.devices[idx[:k_axis] + (k,) + idx[k_axis + 1:]] for k in range(M)]
        addresses = [memory[p] if p in memory else peer_memory.open_handle(d, handles[p]) for p in group]
        host, record = _record(d)
        _RECORDS[d] = (host, [p.id for p in group], axis)
        addresses += [memory[d] + nbytes - 4 * COUNTER_WORDS, record]
        table = np.array([(a & 0xFFFFFFFF, a >> 32) for a in addresses], np.int64).astype(np.uint32).view(np.int32)
        tables.append(jax.device_put(table, d))
        ranks.append(jax.device_put(np.full((1, 1), idx[k_axis], np.int32), d))
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return Mailbox(jax.make_array_from_single_device_arrays((n * (M + 2), 2), sharding, tables),
                   jax.make_array_from_single_device_arrays((n, 1), sharding, ranks), width)


def row_width(mailbox: Mailbox) -> int:
    """The row width (a multiple of 64) a Mailbox carries with no more room than rows of its
    `new_mailbox` hidden size: that size padded as the kernel pads it."""
    return mailbox.width


def _padded(h_rows: int) -> int:
    """Rows of LANES a padded row occupies: a multiple of 8 (128 threads x 4 f32 each)."""
    return -(-h_rows // 8) * 8


def check_shapes(x, residual, scale):
    """Raises ValueError unless x and residual are [R, H] with H % 64 == 0, R <= MAX_ROWS, scale [H],
    each float32, bfloat16 or float16 (the kernel moves 4 elements a thread as 2 or 4 words)."""
    if x.ndim != 2 or residual.shape != x.shape or scale.shape != (x.shape[1],):
        raise ValueError(f"allreduce_add_rms_norm: expected x [R, H], residual [R, H], scale [H]; got x "
                         f"{x.shape}, residual {residual.shape}, scale {scale.shape}")
    if x.shape[1] % LANES or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"allreduce_add_rms_norm: H must be a multiple of {LANES} and R in [1, {MAX_ROWS}]; "
                         f"got R={x.shape[0]}, H={x.shape[1]}")
    for name, a in (("x", x), ("residual", residual), ("scale", scale)):
        if jnp.dtype(a.dtype) not in FLOATS:
            raise ValueError(f"allreduce_add_rms_norm: {name} must be float32, bfloat16 or float16; got {a.dtype}")


def _int(v, bits=32):
    return arith.constant(ir.IntegerType.get_signless(bits), v)


def _table_address(table, k):
    """The i64 address in row k (an index value) of a Mailbox table (GMEM ref)."""
    i64, index = ir.IntegerType.get_signless(64), ir.IndexType.get()
    lo, hi = (arith.extui(i64, memref.load(table, [k, arith.constant(index, j)])) for j in (0, 1))
    return arith.ori(lo, arith.shli(hi, _int(32, 64)))


def _rank(rank):
    """This device's index in its group (the Mailbox's rank ref) as an index value."""
    zero = arith.constant(ir.IndexType.get(), 0)
    return arith.index_cast(ir.IndexType.get(), memref.load(rank, [zero, zero]))


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


def _load_word(address):
    """One volatile 4-byte load -> an i32."""
    i32 = ir.IntegerType.get_signless(32)
    return llvm.inline_asm(i32, [address], "ld.volatile.global.u32 $0, [$1];", "=r,l", has_side_effects=True)


def _store_word(address, word):
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [address, word], "st.volatile.global.u32 [$0], $1;", "l,r",
                    has_side_effects=True)


def _global_time():
    """The GPU's global timer (i64 nanoseconds)."""
    return llvm.inline_asm(ir.IntegerType.get_signless(64), [], "mov.u64 $0, %globaltimer;", "=l",
                           has_side_effects=True)


def _record_and_trap(record, words):
    """Stores the i32 `words` at the failure record `record` (i64 address; word 0, "failed", last,
    after the others are visible system-wide), then ends the kernel with an error (PTX trap): a peer
    that never writes fails the program instead of hanging it."""
    void = ir.Type.parse("!llvm.void")
    for j, w in enumerate(words[1:], 1):
        _store_word(arith.addi(record, _int(4 * j, 64)), w)
    llvm.inline_asm(void, [], "membar.sys;", "", has_side_effects=True)
    _store_word(record, words[0])
    llvm.inline_asm(void, [], "membar.sys;\n\ttrap;", "", has_side_effects=True)


def _line(base, parity, k, row64, t, i, half, M, words):
    """Byte address of thread t's 16-byte line (register i, half) of row `row64` in slot k of the
    inbox at `base` (i64 values; M, words static): elements 512 i + 4 t + 2 half + (0, 1)."""
    i64 = ir.IntegerType.get_signless(64)
    slot = arith.addi(arith.muli(arith.extui(i64, parity), _int(M, 64)), k)
    off = arith.muli(arith.addi(arith.muli(slot, _int(MAX_ROWS, 64)), row64), _int(words * 4, 64))
    lane = arith.muli(arith.index_cast(i64, t), _int(VEC * 8, 64))
    return arith.addi(base, arith.addi(off, arith.addi(lane, _int(i * THREADS * VEC * 8 + 16 * half, 64))))


def _ptr(ref):
    """The i64 address of a GMEM ref's first element."""
    return llvm.ptrtoint(ir.IntegerType.get_signless(64), mgpu.utils.memref_ptr(ref))


def _words(size: int) -> int:
    """i32 words a register of VEC elements of `size` bytes spans (2 for bf16 and f16, 4 for f32)."""
    return VEC * size // 4


def _element(i: int, t):
    """The first of the VEC elements (i32) thread t (i32) holds in register i: 512 i + 4 t."""
    return arith.addi(_int(i * THREADS * VEC), arith.muli(t, _int(VEC)))


def _address(base, e, size: int):
    """The i64 address of element e (i32) of a row of `size`-byte elements at `base` (i64)."""
    return arith.addi(base, arith.muli(arith.extui(ir.IntegerType.get_signless(64), e), _int(size, 64)))


def _load_registers(base, t, H: int, dtype, V: int, live):
    """Thread t's (i32) V registers (vector<VEC x dtype>) of a row of H `dtype` elements at `base`
    (i64): register i the elements 512 i + 4 t + (0 .. 3), loaded straight from global memory where
    live (i1) holds and they lie within H; zeros elsewhere (the padding)."""
    i32 = ir.IntegerType.get_signless(32)
    size = jnp.dtype(dtype).itemsize
    nw = _words(size)
    element = ir.VectorType.get((VEC,), mgpu.utils.dtype_to_ir_type(dtype))
    regs = []
    for i in range(V):
        e = _element(i, t)
        inside = arith.andi(live, arith.cmpi(arith.CmpIPredicate.slt, e, _int(H)))
        load = scf.IfOp(inside, [i32] * nw, has_else=True)
        with ir.InsertionPoint(load.then_block):
            scf.yield_(_load_vec(_address(base, e, size), nw))
        with ir.InsertionPoint(load.else_block):
            scf.yield_([_int(0)] * nw)
        regs.append(vector.bitcast(element, vector.from_elements(ir.VectorType.get((nw,), i32), list(load.results))))
    return regs


def _load_row(H: int, shape, dtype, layout, per_row: bool = True):
    """(ref, row, on) -> row `row` of a GMEM ref [R, H / 64, 64] (per_row False: [H / 64, 64], row
    unused) of `dtype` in registers (`shape` [P, 64] in `layout`, thread t's register i the elements
    512 i + 4 t + (0 .. 3)), loaded straight from global memory where on != 0 and the elements lie
    within H; zeros elsewhere (the padding rows)."""
    arg_types = (plgpu.RefType(), SPLAT, SPLAT)

    @plgpu.inline_mgpu(arg_types=arg_types, return_type=plgpu.ShapeDtypeStruct(shape, dtype, layout=layout))
    def f(ctx, ref, row, on):
        del ctx
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        t = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        base = _ptr(ref)
        if per_row:
            size = jnp.dtype(dtype).itemsize
            base = arith.addi(base, arith.muli(arith.extui(i64, row.registers.item()), _int(H * size, 64)))
        live = arith.cmpi(arith.CmpIPredicate.ne, on.registers.item(), _int(0))
        regs = _load_registers(base, t, H, dtype, shape[0] * shape[1] // (THREADS * VEC), live)
        registers = layout.to_mgpu().registers_shape(shape)
        return mgpu.FragmentedArray(_registers=np.array(regs, dtype=object).reshape(registers),
                                    _layout=layout.to_mgpu(), _is_signed=None)

    return f


def _store_row(H: int, layout):
    """(ref, row, value) -> nothing: value [P, 64] (`layout`) into row `row` of a GMEM ref [R, H / 64,
    64] of its dtype, straight from registers, the elements within H."""
    arg_types = (plgpu.RefType(), SPLAT, layout)

    @plgpu.inline_mgpu(arg_types=arg_types)
    def f(ctx, ref, row, value):
        del ctx
        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        t = arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x))
        size = mgpu.utils.bitwidth(value.mlir_dtype) // 8
        nw = _words(size)
        base = arith.addi(_ptr(ref), arith.muli(arith.extui(i64, row.registers.item()), _int(H * size, 64)))
        vec_i32 = ir.VectorType.get((nw,), i32)
        for i, r in enumerate(value.registers.flat):
            e = _element(i, t)
            inside = scf.IfOp(arith.cmpi(arith.CmpIPredicate.slt, e, _int(H)))
            with ir.InsertionPoint(inside.then_block):
                words = vector.bitcast(vec_i32, r)
                _store_vec(_address(base, e, size), [vector.extract(words, [], [j]) for j in range(nw)])
                scf.yield_([])

    return f


def _load_vec(address, nw):
    """One (non-volatile) load of nw = 2 or 4 i32 words -> the words."""
    i32 = ir.IntegerType.get_signless(32)
    outs = ", ".join(f"${j}" for j in range(nw))
    out = llvm.inline_asm(llvm.StructType.get_literal([i32] * nw), [address],
                          f"ld.global.v{nw}.u32 {{{outs}}}, [${nw}];", ",".join(["=r"] * nw) + ",l",
                          has_side_effects=False)
    return [llvm.extractvalue(i32, out, [j]) for j in range(nw)]


def _store_vec(address, words):
    """One (non-volatile) store of 2 or 4 i32 words."""
    nw = len(words)
    ins = ", ".join(f"${j + 1}" for j in range(nw))
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [address, *words], f"st.global.v{nw}.u32 [$0], {{{ins}}};",
                    "l" + ",r" * nw, has_side_effects=True)


def _exchange(M: int, parts: int, width: int, H: int, shape, layout, dtype, timeout_ms: int):
    """(table, x_ref, rank, row, part) -> in block 0 of the row, the sum over the M devices of row
    `row` of x_ref (GMEM [R, H / 64, 64] of `dtype`; the sum f32, `shape` in `layout`) in device
    order; zeros in the other blocks.

    Every block first issues all its independent loads at once (the table's M + 1 addresses, the
    rank, its row of x), so the only waits before it sends are those loads and its calls count.
    Thread t's count c of the calls its (row, part) made is its own word (one counter a row, part and
    thread: each block reads and writes only its own). Block `part` sends the registers i of its
    share (i * parts // V == part of V) into slot `rank` of every peer's inbox (table rows 0 .. M - 1
    but its own), each element beside the flag c + 1 in one 8-byte half of a 16-byte volatile store,
    so data and signal arrive together with no fence. Block 0 then waits (`_receive`) and sums the
    peers' rows with its own x (never sent to itself) in device order. Then each block records the
    call (c + 1), block 0 also for the parts this call lacks (parts .. MAX_PARTS - 1), so a row's
    counters stay equal whatever parts the calls use. Calls alternate between two slots by c % 2: a
    device's blocks send call c + 2 only after its kernel of call c + 1 has ended, whose block 0
    read every peer's call c + 1, which each peer sent after its kernel of call c, and its reading of
    slot c % 2, had ended. Block 0 waits at most `timeout_ms` (then records the failure and traps)."""
    arg_types = (plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), SPLAT, SPLAT)

    @plgpu.inline_mgpu(arg_types=arg_types, return_type=plgpu.ShapeDtypeStruct(shape, F32, layout=layout))
    def f(ctx, table, x_ref, rank, row, part):
        del ctx
        i1, i32 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(32)
        i64, index = ir.IntegerType.get_signless(64), ir.IndexType.get()
        t = gpu.thread_id(gpu.Dimension.x)
        row64 = arith.extui(i64, row.registers.item())
        part = part.registers.item()
        addresses = [_table_address(table, arith.constant(index, k)) for k in range(M + 2)]
        me = _rank(rank)
        size = jnp.dtype(dtype).itemsize
        x_row = arith.addi(_ptr(x_ref), arith.muli(row64, _int(H * size, 64)))
        V = shape[0] * shape[1] // (THREADS * VEC)
        loaded = _load_registers(x_row, arith.index_cast(i32, t), H, dtype, V, arith.constant(i1, 1))
        vec_i32, vec_f32 = ir.VectorType.get((VEC,), i32), ir.VectorType.get((VEC,), ir.F32Type.get())
        own = [r if size == 4 else arith.extf(vec_f32, r) for r in loaded]

        def counter(p):  # the address of thread t's count of (row, part p)'s calls
            slot = arith.addi(arith.muli(arith.addi(arith.muli(row64, _int(MAX_PARTS, 64)), p), _int(THREADS, 64)),
                              arith.index_cast(i64, t))
            return arith.addi(addresses[M], arith.muli(slot, _int(4, 64)))

        mine = counter(arith.extui(i64, part))
        count = _load_word(mine)
        parity, flag = arith.andi(count, _int(1)), arith.addi(count, _int(1))
        me64 = arith.index_cast(i64, me)
        for k in range(M):
            peer = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ne, me, arith.constant(index, k)))
            with ir.InsertionPoint(peer.then_block):
                for i, r in enumerate(own):
                    b = [vector.extract(arith.bitcast(vec_i32, r), [], [j]) for j in range(VEC)]
                    share = scf.IfOp(arith.cmpi(arith.CmpIPredicate.eq, part, _int(i * parts // V)))
                    with ir.InsertionPoint(share.then_block):
                        for half in range(2):
                            _store_line(_line(addresses[k], parity, me64, row64, t, i, half, M, 2 * width),
                                        [b[2 * half], flag, b[2 * half + 1], flag])
                        scf.yield_([])
                scf.yield_([])
        inbox = addresses[0]
        for k in range(1, M):
            inbox = arith.select(arith.cmpi(arith.CmpIPredicate.eq, me, arith.constant(index, k)), addresses[k], inbox)
        lead = arith.cmpi(arith.CmpIPredicate.eq, part, _int(0))
        zero = arith.constant(vec_f32, ir.DenseElementsAttr.get_splat(vec_f32, ir.FloatAttr.get_f32(0.0)))
        receive = scf.IfOp(lead, [vec_f32] * V, has_else=True)
        with ir.InsertionPoint(receive.then_block):
            total = _receive(inbox, own, me, row64, t, parity, flag, M, width, addresses[M + 1], timeout_ms)
            scf.yield_(total)
        with ir.InsertionPoint(receive.else_block):
            scf.yield_([zero] * V)
        _store_word(mine, flag)
        rest = scf.IfOp(lead)
        with ir.InsertionPoint(rest.then_block):
            for p in range(parts, MAX_PARTS):
                _store_word(counter(_int(p, 64)), flag)
            scf.yield_([])
        registers = layout.to_mgpu().registers_shape(shape)
        return mgpu.FragmentedArray(_registers=np.array(list(receive.results), dtype=object).reshape(registers),
                                    _layout=layout.to_mgpu(), _is_signed=None)

    return f


def _receive(inbox, own, me, row64, t, parity, flag, M: int, width: int, record, timeout_ms: int):
    """Block 0's wait (see `_exchange`): -> the V registers (vector<4xf32>) of the sum in device order,
    its own x at `me`. Each try loads, at once, the lines of every peer's slot of the inbox at `inbox`
    not yet complete (its own slot never), and marks a slot complete when every flag of the try says
    `flag`: one round trip a try, each line loaded again only while its peer's row is incomplete.
    After `timeout_ms` of tries (the global timer), the thread writes the failure record at `record`
    (its rank, the first peer whose row it lacks, the call, the row, the microseconds waited) and
    traps."""
    i1, i32, index = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(32), ir.IndexType.get()
    vec_i32, vec_f32 = ir.VectorType.get((VEC,), i32), ir.VectorType.get((VEC,), ir.F32Type.get())
    V = len(own)
    if M == 1:
        return own
    true = arith.constant(i1, 1)
    n = V * VEC  # words of one slot a thread holds
    itself = [arith.cmpi(arith.CmpIPredicate.eq, me, arith.constant(index, k)) for k in range(M)]
    types = [i32] * (M * n) + [i1] * M
    start = _global_time()
    wait = scf.WhileOp(types, [_int(0)] * (M * n) + itself)
    tries = wait.before.blocks.append(*types)
    with ir.InsertionPoint(tries):
        args = list(tries.arguments)
        values, done = [], []
        for k in range(M):
            poll = scf.IfOp(args[M * n + k], [i32] * n + [i1], has_else=True)
            with ir.InsertionPoint(poll.then_block):
                scf.yield_(args[k * n:(k + 1) * n] + [true])
            with ir.InsertionPoint(poll.else_block):
                got, ok = [], true
                for i in range(V):
                    for half in range(2):
                        w = _load_line(_line(inbox, parity, _int(k, 64), row64, t, i, half, M, 2 * width))
                        got += [w[0], w[2]]
                        for word in (w[1], w[3]):
                            ok = arith.andi(ok, arith.cmpi(arith.CmpIPredicate.eq, word, flag))
                scf.yield_(got + [ok])
            values += list(poll.results)[:n]
            done.append(poll.results[n])
        every = functools.reduce(arith.andi, done)
        scf.condition(arith.xori(every, true), values + done)
    after = wait.after.blocks.append(*types)
    with ir.InsertionPoint(after):
        waited = arith.subi(_global_time(), start)
        late = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ugt, waited, _int(timeout_ms * 1_000_000, 64)))
        with ir.InsertionPoint(late.then_block):
            missing = _int(M)
            for k in reversed(range(M)):
                missing = arith.select(after.arguments[M * n + k], missing, _int(k))
            _record_and_trap(record, [_int(1), arith.index_cast(i32, me), missing, flag, arith.trunci(i32, row64),
                                      arith.trunci(i32, arith.divui(waited, _int(1000, 64)))])
            scf.yield_([])
        scf.yield_(list(after.arguments))
    got = list(wait.results)[:M * n]
    total = None
    for k in range(M):  # device order: the same sum on every device
        vecs = [arith.select(itself[k], own[i], arith.bitcast(vec_f32, vector.from_elements(
            vec_i32, got[k * n + VEC * i:k * n + VEC * (i + 1)]))) for i in range(V)]
        total = vecs if total is None else [arith.addf(a, b) for a, b in zip(total, vecs)]
    return total


def max_parts(hidden: int) -> int:
    """The most blocks a row of `hidden` can be sent from: the registers a thread holds of the padded
    row (6 for 2880: 48 rows of 64 over 128 threads, 4 f32 a register), each sent whole, at most
    MAX_PARTS."""
    return min(MAX_PARTS, _padded(hidden // LANES) // 8)


def parts_for(rows: int, hidden: int, devices: int) -> int:
    """Blocks a row's message is sent from by default: `max_parts`, at most SPREAD_BLOCKS // rows
    blocks a call over 2 devices (where spreading helped 1 and 4 rows and hurt 16 and 64),
    MAX_BLOCKS // rows over more (where 16 rows over 4 devices were fastest from 6 blocks a row; the
    sweeps: docs/perf/multi_gpu.md)."""
    spread = SPREAD_BLOCKS if devices <= 2 else MAX_BLOCKS
    return max(1, min(max_parts(hidden), spread // rows))


def _body(x_ref, r_ref, w_ref, table, rank, s_ref, y_ref, *, M, H, eps, parts, width, timeout_ms):
    """Block (row, part) of the call: x_ref / r_ref / s_ref / y_ref [R, H/64, 64], w_ref [H/64, 64] in
    GMEM; table, rank: the Mailbox's shards. Every block loads the row of x into registers (thread t
    the same elements on every device, zeros padding the row to `width`) and sends its share; block
    0 also loads the residual and the scale, sums, adds, normalizes and writes s and y from
    registers."""
    row, part = lax.axis_index("row"), lax.axis_index("part")
    shape = (width // LANES, LANES)
    layout = plgpu.Layout.WG_STRIDED(shape, vec_size=VEC)
    lead = (part == 0).astype(I32)
    r = _load_row(H, shape, r_ref.dtype, layout)(r_ref, row, lead)
    w = _load_row(H, shape, w_ref.dtype, layout, per_row=False)(w_ref, row, lead)
    t = _exchange(M, parts, width, H, shape, layout, x_ref.dtype, timeout_ms)(table, x_ref, rank, row, part)

    @pl.when(part == 0)
    def _():
        s = (t + r.astype(F32)).astype(s_ref.dtype)
        s32 = s.astype(F32)
        inv = lax.rsqrt(jnp.sum(s32 * s32) / H + eps)
        _store_row(H, layout)(s_ref, row, s)
        _store_row(H, layout)(y_ref, row, (s32 * inv * w.astype(F32)).astype(y_ref.dtype))


def allreduce_add_rms_norm(x, residual, scale, mailbox: Mailbox, *, eps: float, axis: str | None,
                           parts: int | None = None):
    """See the module docstring. Inside shard_map over `axis`, mailbox the device's shards of a
    `new_mailbox` for the mesh; GPU only (the Mosaic GPU interpreter has no peer memory). parts:
    blocks a row is sent from (1 to `max_parts(H)`, rows x parts <= MAX_BLOCKS); by default
    `parts_for`. axis None: the group's size is the Mailbox's (its table's rows), unchecked against
    a mesh, for one device calling outside shard_map (its peers in other programs)."""
    check_shapes(x, residual, scale)
    M = mailbox.table.shape[0] - 2 if axis is None else lax.axis_size(axis)
    R, H = x.shape
    n = H // LANES
    Pr = _padded(n)
    if mailbox.table.shape != (M + 2, 2) or mailbox.rank.shape != (1, 1) or mailbox.width != Pr * LANES:
        raise ValueError(f"allreduce_add_rms_norm: a mailbox with table {mailbox.table.shape}, rank "
                         f"{mailbox.rank.shape} and rows of {mailbox.width} is not for H={H} over {M} devices "
                         f"(expected new_mailbox(mesh, {H}): table ({M + 2}, 2), rows of {Pr * LANES})")
    G = parts_for(R, H, M) if parts is None else parts
    if not 1 <= G <= max_parts(H) or R * G > MAX_BLOCKS:
        raise ValueError(f"allreduce_add_rms_norm: parts={G} for R={R}, H={H}; expected 1 to {max_parts(H)} with "
                         f"R x parts <= {MAX_BLOCKS}")
    dt = residual.dtype
    out = jax.ShapeDtypeStruct((R, n, LANES), dt)
    s, y = plgpu.kernel(
        functools.partial(_body, M=M, H=H, eps=float(eps), parts=G, width=Pr * LANES, timeout_ms=mailbox.timeout_ms),
        out_type=(out, out), grid=(R, G), grid_names=("row", "part"),
    )(x.reshape(R, n, LANES), residual.reshape(R, n, LANES), scale.reshape(n, LANES), mailbox.table, mailbox.rank)
    return s.reshape(R, H), y.reshape(R, H)


def allreduce_add_rms_norm_reference(x, residual, scale, *, eps: float, axis: str):
    """`allreduce_add_rms_norm` through `lax.psum` (XLA's all-reduce) and jnp."""
    t = lax.psum(x.astype(F32), axis)
    s = (t + residual.astype(F32)).astype(residual.dtype)
    s32 = s.astype(F32)
    y = s32 * lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + eps) * scale.astype(F32)
    return s, y.astype(residual.dtype)
