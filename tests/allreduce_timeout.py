"""Run by tests/test_pallas_allreduce.py (GPU) in a subprocess: the fused all-reduce on device 0 of a
model group whose other member never calls it. `one`: one GPU, a group of two made by hand (device 0's
own inbox, counter and failure record from a one-device Mailbox, and a second inbox no one reads or
fills: the peer's); `two`: the real Mailbox of a 2-GPU mesh, called on the first GPU only. The call
must fail (a device error, not a hang) within the Mailbox's timeout plus launch costs, and
`allreduce.failure_report()` name the missing rank. Prints one JSON line: failed, error, seconds,
report. The trapped device's context is lost, so the process ends at once after printing."""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import parallel
from eagle3_jax.pallas import allreduce, peer_memory

H, TIMEOUT_MS = 2880, 200


def lone_mailbox(device):
    """Device 0's side of a group of two whose second member does not exist."""
    box = allreduce.new_mailbox(parallel.make_mesh(model=1, devices=[device]), H)
    table = np.asarray(box.table).view(np.uint32).astype(np.int64)
    address = [int(lo) | (int(hi) << 32) for lo, hi in table]  # inbox, counter, record
    inbox_bytes = address[1] - address[0]
    peer = peer_memory.allocate(device, inbox_bytes + 4 * allreduce.COUNTER_WORDS)
    rows = [address[0], peer, address[1], address[2]]
    table = np.array([(a & 0xFFFFFFFF, a >> 32) for a in rows], np.int64).astype(np.uint32).view(np.int32)
    return allreduce.Mailbox(jax.device_put(table, device), jax.device_put(box.rank, device), box.width, TIMEOUT_MS)


def first_member(device):
    """Device 0's shards of a 2-GPU mesh's Mailbox, the run context's with its timeout (its peer, GPU 1,
    makes no call)."""
    mesh = parallel.make_mesh(model=2, devices=jax.devices()[:2])
    box = parallel.context(mesh, hidden=H, reduce_timeout_ms=TIMEOUT_MS).mailbox
    assert box.timeout_ms == TIMEOUT_MS and box.table is parallel.mailbox(mesh, H).table
    mine = lambda a: next(s.data for s in a.addressable_shards if s.device == device)  # noqa: E731
    return allreduce.Mailbox(mine(box.table), mine(box.rank), box.width, box.timeout_ms)


def main(mode):
    device = jax.devices()[0]
    box = lone_mailbox(device) if mode == "one" else first_member(device)
    x = jax.device_put(jnp.ones((1, H), jnp.bfloat16), device)
    w = jax.device_put(jnp.ones((H,), jnp.bfloat16), device)
    call = jax.jit(lambda x, r, w, b: allreduce.allreduce_add_rms_norm(x, r, w, b, eps=1e-5, axis=None))
    exe = call.lower(x, x, w, box).compile()
    error, t0 = None, time.perf_counter()
    try:
        jax.block_until_ready(exe(x, x, w, box))
    except Exception as e:  # noqa: BLE001 - the device error is the expected outcome
        error = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    print(json.dumps(dict(failed=error is not None, error=(error or "")[:400], seconds=seconds,
                          report=allreduce.failure_report())), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
