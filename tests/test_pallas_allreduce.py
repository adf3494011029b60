"""pallas/allreduce.py: the fused all-reduce + add + RMSNorm against a float64 numpy function written
from its contract; the kernel on the GPUs of this machine (4, 2 or 1, one process), called once and then
thousands of times in a loop whose every sum is exact (integer-valued partials), so that a message
read too early, a slot overwritten before its peer read it or a lost flag fails the test."""

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import local_processes
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax import parallel
from eagle3_jax.pallas import allreduce, select

EPS = 1e-5


def reduce_add_norm_np(parts, residual, scale, dtype):
    """parts [M, R, H] -> (s, y) by the contract, in float64 with the two roundings to dtype."""
    t = parts.astype(np.float64).sum(0)
    s = np.asarray(jnp.asarray(t + residual.astype(np.float64), jnp.float32).astype(dtype), np.float64)
    y = s / np.sqrt((s * s).mean(-1, keepdims=True) + EPS) * scale.astype(np.float64)
    return s, y


def mesh_fn(mesh, fn, with_mailbox):
    """fn(x [R, H], residual, scale, *mailbox) on each device of mesh's "model" axis; x stacked [M, R, H]."""
    def body(x, r, w, *mb):
        s, y = fn(x[0], r, w, *mb)
        return s[None], y[None]

    specs = (P("model"), P(), P()) + ((P(tuple(mesh.axis_names)),) if with_mailbox else ())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("model"), P("model")),
                                 check_vma=False))


def inputs(mesh, M, R, H, dtype, seed):
    rng = np.random.default_rng(seed)
    parts = rng.normal(size=(M, R, H)).astype(np.float32)
    residual = np.asarray(jnp.asarray(rng.normal(size=(R, H)), dtype))
    scale = (1 + 0.1 * rng.normal(size=H)).astype(np.float32)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    return (parts, residual, scale), (put(parts, P("model")), put(residual, P()), put(scale, P()))


@pytest.mark.parametrize("R,H,dtype", [(1, 2880, jnp.bfloat16), (5, 64, jnp.float32), (3, 96, jnp.bfloat16)])
def test_reference_matches_numpy(R, H, dtype):
    """The psum reference on a one-device mesh (this process) against float64 numpy."""
    mesh = parallel.make_mesh(model=1, devices=jax.devices()[:1])
    host, dev = inputs(mesh, 1, R, H, dtype, R + H)
    run = mesh_fn(mesh, lambda x, r, w: allreduce.allreduce_add_rms_norm_reference(x, r, w, eps=EPS, axis="model"),
                  False)
    s, y = (np.asarray(a[0], np.float64) for a in run(*dev))
    s_want, y_want = reduce_add_norm_np(*host, dtype)
    np.testing.assert_array_equal(s, s_want)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(y, y_want, rtol=tol, atol=tol)


def test_bad_input_and_dispatch():
    """Shapes the kernel cannot take are refused by name; the dispatch needs a mailbox and bf16 on a GPU
    (the pick's, a mailbox on a GPU), and rows x peers <= 64."""
    z = jnp.zeros
    with pytest.raises(ValueError, match=r"H must be a multiple of 64 and R in \[1, 64\]; got R=1, H=100"):
        allreduce.check_shapes(z((1, 100)), z((1, 100)), z((100,)))
    with pytest.raises(ValueError, match=r"got R=65, H=128"):
        allreduce.check_shapes(z((65, 128)), z((65, 128)), z((128,)))
    with pytest.raises(ValueError, match=r"expected x \[R, H\], residual \[R, H\], scale \[H\]; got x \(2, 128\), "
                                         r"residual \(2, 64\)"):
        allreduce.check_shapes(z((2, 128)), z((2, 64)), z((128,)))
    with pytest.raises(ValueError, match=r"residual must be float32, bfloat16 or float16; got int8"):
        allreduce.check_shapes(z((2, 128)), z((2, 128), jnp.int8), z((128,)))
    x = z((2, 3, 2880), jnp.bfloat16)
    box = object()
    assert select.tp_reduce(x, 6, 2, box, platform="gpu") == "kernel"
    assert select.tp_reduce(x, 64, 2, box, platform="gpu") == "kernel"  # rows x peers <= 64
    assert select.tp_reduce(x, 65, 2, box, platform="gpu") == "reference"  # MAX_ROWS
    assert select.tp_reduce(x, 21, 4, box, platform="gpu") == "kernel"
    assert select.tp_reduce(x, 22, 4, box, platform="gpu") == "reference"
    assert select.tp_reduce(x, 6, 2, None, platform="gpu") == "reference"
    assert select.tp_reduce(x.astype(jnp.float32), 6, 2, box, platform="gpu") == "reference"
    assert select.tp_reduce(x, 6, 2, box, platform="cpu") == "reference"
    assert select.tp_reduce(z((1, 1, 2880 + 32), jnp.bfloat16), 1, 2, box, platform="gpu") == "reference"
    assert select.tp_kernel(2880, "gpu") and not select.tp_kernel(2912, "gpu") and not select.tp_kernel(2880, "cpu")
    # the pick: any dtype, the same row limits, the Mailbox's padded width (3072 for H = 2880)
    mesh = parallel.make_mesh(model=1, devices=jax.devices()[:1])
    mailbox = allreduce.new_mailbox(mesh, 2880)
    shard = types.SimpleNamespace(width=3072)
    assert allreduce.row_width(shard) == allreduce.row_width(mailbox) == jax.jit(lambda mb: mb)(mailbox).width == 3072
    assert [select.tp_pick(r, m, shard, platform="gpu") for r, m in ((1, 4), (21, 4), (22, 4), (64, 2), (65, 2))] == [
        "kernel", "kernel", "reference", "kernel", "reference"]
    assert select.tp_pick(1, 4, None, platform="gpu") == select.tp_pick(1, 4, shard, platform="cpu") == "reference"
    # blocks a row is sent from: a thread's registers of the padded row (6 at 2880: 48 rows of 64 / 8),
    # at most SPREAD_BLOCKS (24) // rows over 2 devices, MAX_BLOCKS (128) // rows over more; 1 for a row
    # of one register
    assert [allreduce.parts_for(r, 2880, 2) for r in (1, 4, 5, 8, 12, 13, 16, 64)] == [6, 6, 4, 3, 2, 1, 1, 1]
    assert [allreduce.parts_for(r, 2880, 4) for r in (1, 16, 21, 22, 32, 64)] == [6, 6, 6, 5, 4, 2]
    assert allreduce.parts_for(1, 64, 4) == allreduce.parts_for(64, 512, 2) == 1
    assert [allreduce.max_parts(h) for h in (64, 512, 576, 2880)] == [1, 1, 2, 6]
    for R, parts in ((1, 7), (1, 0), (64, 3)):
        run = mesh_fn(mesh, lambda x, r, w, mb, parts=parts: allreduce.allreduce_add_rms_norm(
            x, r, w, mb, eps=EPS, axis="model", parts=parts), True)
        with pytest.raises(ValueError, match=f"parts={parts} for R={R}, H=2880; expected 1 to 6 with R x parts <= 128"):
            run(z((1, R, 2880)), z((R, 2880), jnp.bfloat16), z((2880,)), mailbox)
    run = mesh_fn(mesh, lambda x, r, w, mb: allreduce.allreduce_add_rms_norm(x, r, w, mb, eps=EPS, axis="model"),
                  True)  # a Mailbox made for rows of 2880 cannot carry rows of 4096
    with pytest.raises(ValueError, match=r"rows of 3072 is not for H=4096 over 1 devices .*rows of 4096"):
        run(z((1, 1, 4096)), z((1, 4096), jnp.bfloat16), z((4096,)), mailbox)


def fake_mesh(layout, hosts=None):
    """A mesh-like object over fake devices: layout [data, model] of process indices."""
    procs = np.asarray(layout)
    devices = np.empty(procs.shape, object)
    for i, (idx, p) in enumerate(np.ndenumerate(procs)):
        devices[idx] = types.SimpleNamespace(id=i, process_index=int(p))
    return types.SimpleNamespace(devices=devices, axis_names=("data", "model"),
                                 shape={"data": procs.shape[0], "model": procs.shape[1]},
                                 is_multi_process=len(set(procs.flat)) > 1)


def test_shared_memory_problem():
    """Model groups reach each other's memory when all in one process, or one device a process with
    the group's processes on one host; otherwise the reason names the group, processes or hosts."""
    one_host = ["a"] * 4
    assert allreduce.shared_memory_problem(fake_mesh([[0, 0, 0, 0]])) is None
    assert allreduce.shared_memory_problem(fake_mesh([[0, 1, 2, 3]]), hosts=one_host) is None
    assert allreduce.shared_memory_problem(fake_mesh([[0, 0], [1, 1]]), hosts=one_host) is None  # groups per process
    assert allreduce.shared_memory_problem(fake_mesh([[0, 1], [0, 1]]), hosts=one_host) is None  # one a process
    why = allreduce.shared_memory_problem(fake_mesh([[0, 0, 1, 1]]), hosts=one_host)
    assert why.startswith("the model group [0, 1, 2, 3] spans processes [0, 1] with several of its devices"), why
    why = allreduce.shared_memory_problem(fake_mesh([[0, 1], [2, 3]]), hosts=["a", "a", "b", "c"])
    assert why == "the model group [2, 3] spans hosts ['b', 'c']; GPUs share memory only within a host", why
    assert allreduce.shared_memory_problem(fake_mesh([[0, 1], [2, 3]]), hosts=["a", "a", "b", "b"]) is None


def exact_calls(M: int, H: int, chain: int = 8, parts=None):
    """loop(n [R, 1], mailbox) for shard_map over "model" (M devices): n[0, 0] iterations of `chain`
    chained kernel calls on [R, H] integer-valued partials that change every call (each depending on
    the last result), so every s is an exact, known sum; returns [1] a device: the elements that
    differ over all calls. parts: blocks a row is sent from, or a tuple of them taken in turn."""
    turns = parts if isinstance(parts, tuple) else (parts,)

    def loop(n, mb):
        d = lax.axis_index("model").astype(jnp.float32)
        R = n.shape[0]
        pattern = jnp.broadcast_to((jnp.arange(H) % 4 + 1).astype(jnp.float32), (R, H))
        zero, w = jnp.zeros((R, H), jnp.bfloat16), jnp.ones((H,), jnp.float32)

        def step(i, carry):
            s, errs = carry
            for j in range(chain):
                v = ((i * chain + j) % 7).astype(jnp.float32)
                part = (v + d + 1) * pattern + 0.0 * s.astype(jnp.float32)  # depends on the previous call
                s, _ = allreduce.allreduce_add_rms_norm(part, zero, w, mb, eps=EPS, axis="model",
                                                        parts=turns[j % len(turns)])
                want = (M * v + M * (M + 1) / 2) * pattern
                errs = errs + jnp.sum(s.astype(jnp.float32) != want).astype(jnp.int32)
            return s, errs

        return lax.fori_loop(0, n[0, 0], step, (zero, jnp.int32(0)))[1][None]

    return loop


def gpus():
    return [d for d in jax.devices() if d.platform == "gpu"]


def model_gpus(least: int = 1) -> int:
    """The "model" axis the GPU tests take: 4, 2 or 1 of this machine's GPUs (skips with fewer than
    `least`; with one, the kernel meets only its own inbox)."""
    n = len(gpus())
    if n < least:
        pytest.skip(f"needs {least} GPUs")
    return 4 if n >= 4 else 2 if n >= 2 else 1


@pytest.mark.gpu
@pytest.mark.parametrize("R,dtype,parts,H", [
    (1, jnp.bfloat16, None, 2880), (1, jnp.bfloat16, 1, 2880), (1, jnp.float32, 4, 2880), (4, jnp.bfloat16, None, 2880),
    (16, jnp.float32, None, 2880), (64, jnp.bfloat16, None, 2880), (64, jnp.bfloat16, 1, 2880),
    (3, jnp.bfloat16, None, 576), (2, jnp.float32, None, 64), (2, jnp.bfloat16, None, 3072)])
def test_kernel_matches_reference_gpu(R, dtype, parts, H):
    """On the GPUs of the machine (4, 2 or 1 as one "model" axis), a row sent from `parts` blocks (4:
    six registers over four blocks, unevenly): the kernel's s equals the reference's bit for bit (the
    sum of the partials in f32 is exact up to order, and M <= 2 sums commute; with more, within one
    rounding), y within bf16 rounding, and every device holds the same bits. Rows of 576 and 64 end
    within a thread's registers (threads past H hold padding), 3072 fills them."""
    M = model_gpus()
    mesh = parallel.make_mesh(model=M, devices=gpus()[:M])
    mailbox = allreduce.new_mailbox(mesh, H)
    host, dev = inputs(mesh, M, R, H, dtype, 7 * R)
    kern = mesh_fn(mesh, lambda x, r, w, mb: allreduce.allreduce_add_rms_norm(
        x, r, w, mb, eps=EPS, axis="model", parts=parts), True)
    s, y = (np.asarray(a, np.float64) for a in kern(*dev, mailbox))
    s_want, y_want = reduce_add_norm_np(*host, dtype)
    for d in range(M):
        np.testing.assert_array_equal(s[d], s[0])
        np.testing.assert_array_equal(y[d], y[0])
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(s[0], s_want, rtol=ulp, atol=ulp)
    np.testing.assert_allclose(y[0], y_want, rtol=2 * ulp, atol=2 * ulp)


@pytest.mark.gpu
def test_kernel_exact_in_a_loop_gpu():
    """4000 chained calls in a jitted loop for each of (rows, blocks a row): (1, default 6), (16, default
    1), (16, 6), (64, 2), (1, 1), and calls taking 6, 1 and 4 blocks in turn at 1 row (1 and 6 at 16),
    the Mailbox reused across calls and programs: integer-valued partials that change every call, so
    every s is an exact, known sum. Counts the calls whose s differs: none on any device."""
    M = model_gpus()
    H, calls, chain = 2880, 500, 8
    mesh = parallel.make_mesh(model=M, devices=gpus()[:M])
    mailbox = allreduce.new_mailbox(mesh, H)
    every = P(tuple(mesh.axis_names))
    for R, parts in ((1, None), (16, None), (16, 6), (64, 2), (1, 1), (1, (6, 1, 4)), (16, (1, 6))):
        run = jax.jit(jax.shard_map(exact_calls(M, H, chain, parts), mesh=mesh,
                                    in_specs=(P(), every), out_specs=P("model"), check_vma=False))
        n = jax.device_put(jnp.full((R, 1), calls, jnp.int32), NamedSharding(mesh, P()))
        assert np.asarray(run(n, mailbox)).tolist() == [0] * M, (R, parts)


@pytest.mark.gpu
@pytest.mark.parametrize("B,N", [(1, 1), (4, 4), (5, 4), (16, 4)])
def test_vocab_argmax_through_the_kernel_gpu(B, N):
    """`parallel.vocab_argmax` over every GPU of the machine (2 or 4 as "model"): np.argmax's index at
    every row (ties within and across shards, a shard's first and last column, a row all -inf),
    through the kernel with no XLA collective where `select.tp_pick` takes it (rows x peers <= 64),
    else through XLA's all-reduce."""
    M, V = model_gpus(2), 201088
    mesh = parallel.make_mesh(model=M, devices=gpus()[:M])
    mailbox = allreduce.new_mailbox(mesh, 2880)
    kernel = B * N * (M - 1) <= select.TP_KERNEL_ROW_PEERS
    assert (select.tp_pick(B * N, M, mailbox) == "kernel") == kernel
    n = V // M
    z = np.random.default_rng(B).normal(size=(B, N, V)).astype(np.float32)
    rows = z.reshape(-1, V)
    rows[0, [n - 1, n]] = 9.0
    if len(rows) > 2:
        rows[1, [V - 1, 5]] = 7.0
        rows[2] = -np.inf
    logits = jax.device_put(z, NamedSharding(mesh, P("data", None, "model")))

    ctx = parallel.RunContext(mesh=mesh, mailbox=mailbox)
    exe = jax.jit(parallel.vocab_argmax).lower(ctx, logits).compile()
    text = exe.as_text()
    assert "all-gather" not in text and ("all-reduce" in text) != kernel
    np.testing.assert_array_equal(np.asarray(exe(ctx, logits)), np.argmax(z, -1))


@pytest.mark.gpu
def test_kernel_one_process_a_gpu():
    """tests/allreduce_processes.py in 2 or 4 processes (jax.distributed on localhost), each seeing one
    GPU: the kernel reaches the other processes' inboxes through CUDA IPC; its values and 4000 exact
    chained calls, checked in every process. The children allocate as they go (no preallocation), so
    they fit beside this process's own allocation, whatever XLA_PYTHON_CLIENT_MEM_FRACTION it has."""
    M = model_gpus(2)
    port = local_processes.free_port()
    path = os.pathsep.join([os.path.dirname(local_processes.HERE), os.environ.get("PYTHONPATH", "")])  # uninstalled
    envs = [{**os.environ, "CUDA_VISIBLE_DEVICES": str(gpus()[i].local_hardware_id),
             "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONPATH": path} for i in range(M)]
    local_processes.run_all("allreduce_processes.py", [(i, M, port) for i in range(M)], envs, timeout=400)


def test_timeout_and_failure_report():
    """The wait for a peer is bounded: a Mailbox carries its timeout (milliseconds, static: part of a
    program's key), the run context sets it, bad values are refused; the kernel of a group of two
    (called alone, axis None: the group's size from the Mailbox) lowers to a wait that reads the
    global timer, writes its record system-wide and traps. `failure_report` reads the records, here
    one written as a kernel would (word 0 last), and names the reduction, the device and the peer."""
    mesh = parallel.make_mesh(model=1, devices=jax.devices()[:1])
    box = allreduce.new_mailbox(mesh, 128)
    assert box.timeout_ms == allreduce.DEFAULT_TIMEOUT_MS and box.table.shape == (3, 2)  # inbox, counter, record
    short = dataclasses.replace(box, timeout_ms=50)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"timeout_ms must be a positive int \(milliseconds\); got"):
            dataclasses.replace(box, timeout_ms=bad)
    x, w = jnp.zeros((1, 128), jnp.bfloat16), jnp.ones(128, jnp.bfloat16)

    def lowered(mb):
        pair = dataclasses.replace(mb, table=jnp.concatenate([mb.table[:1], mb.table]))  # a group of two
        call = jax.jit(lambda x, r, w, m: allreduce.allreduce_add_rms_norm(x, r, w, m, eps=EPS, axis=None))
        return call.trace(x, x, w, pair).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered(box)
    assert all(op in text for op in ("mov.u64 $0, %globaltimer;", "membar.sys;", "trap;")), "no bounded wait"
    assert lowered(short) != text  # the bound is in the kernel
    assert allreduce.failure_report() is None
    lo, hi = np.asarray(box.table).view(np.uint32).astype(np.int64)[-1]
    record = np.ctypeslib.as_array((ctypes.c_int32 * allreduce.RECORD_WORDS).from_address(int(lo) | int(hi) << 32))
    record[1:6] = [0, 0, 7, 3, 51000]  # rank 0 waited 51 ms at call 7, row 3, for rank 0 (itself: the ids)
    assert allreduce.failure_report() is None  # not yet marked failed
    record[0] = 1
    dev = mesh.devices.flat[0].id
    try:
        report = parallel.failure_report()
        assert report == (f"allreduce_add_rms_norm (the fused all-reduce over 'model'): device {dev} (rank 0 of its "
                          f"group [{dev}]) waited 51 ms at call 7, row 3, for rank 0 (device {dev}), which never "
                          "sent: its program stopped or never started, or the devices made different calls"), report
        record[2] = 1
        assert "for rank 1 (outside its group)," in parallel.failure_report()
    finally:
        record[:] = 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["one", "two"])
def test_missing_peer_fails_in_bounded_time_gpu(mode):
    """tests/allreduce_timeout.py: device 0 calls the kernel and its peer never does (one GPU: a group of
    two made by hand; two GPUs: the real Mailbox, GPU 1 idle). The call fails with a device error
    within the 200 ms timeout plus a margin, not a hang, and the failure report names the missing rank."""
    if mode == "two":
        model_gpus(2)
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "allreduce_timeout.py"), mode],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ,
                       XLA_PYTHON_CLIENT_PREALLOCATE="false"))
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads(lines[-1])
    assert out["failed"] and out["seconds"] < 5, out
    assert out["report"] and "waited" in out["report"] and "for rank 1" in out["report"], out


def test_model_kernels_lower_without_collective_metadata():
    """tests/allreduce_lowering.py: the trunk's fused kernels, lowered for CUDA on CPU meshes, one a
    sublayer, none reading XLA's collective metadata."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "allreduce_lowering.py")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]
