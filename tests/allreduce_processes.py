"""One of M processes, one GPU each, that tests/test_pallas_allreduce.py starts on localhost:
`python allreduce_processes.py PROCESS_ID NUM_PROCESSES PORT` with CUDA_VISIBLE_DEVICES set to one
GPU. Through jax.distributed they form one "model" axis of M devices, and the one-shot kernel
reaches its peers' inboxes in the other processes through CUDA IPC (`allreduce.new_mailbox`). Each
process checks its own device's results: the kernel against float64 numpy at 1, 4 and 16 rows, then
4000 chained calls with exact sums at 1 and 16 rows. Prints "ok"."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_pallas_allreduce import EPS, exact_calls, reduce_add_norm_np

from eagle3_jax import parallel
from eagle3_jax.pallas import allreduce

H = 2880


def global_array(mesh, host, spec):
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])


def mine(a):
    """This process's shard of a result stacked over "model" (its one device's)."""
    return np.asarray(a.addressable_shards[0].data, np.float64)[0]


def check_values(mesh, mailbox, M, R, dtype):
    rng = np.random.default_rng(R)  # the same inputs in every process
    parts = rng.normal(size=(M, R, H)).astype(np.float32)
    residual = np.asarray(jnp.asarray(rng.normal(size=(R, H)), dtype))
    scale = (1 + 0.1 * rng.normal(size=H)).astype(np.float32)

    def body(x, r, w, mb):
        s, y = allreduce.allreduce_add_rms_norm(x[0], r, w, mb, eps=EPS, axis="model")
        return s[None], y[None]

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("model"), P(), P(), P(("data", "model"))),
                                out_specs=(P("model"), P("model")), check_vma=False))
    s, y = run(global_array(mesh, parts, P("model")), global_array(mesh, residual, P()),
               global_array(mesh, scale, P()), mailbox)
    s_want, y_want = reduce_add_norm_np(parts, residual, scale, dtype)
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(mine(s), s_want, rtol=ulp, atol=ulp)
    np.testing.assert_allclose(mine(y), y_want, rtol=2 * ulp, atol=2 * ulp)


def check_loop(mesh, mailbox, M, R, calls=500):
    run = jax.jit(jax.shard_map(exact_calls(M, H), mesh=mesh, in_specs=(P(), P(("data", "model"))),
                                out_specs=P("model"), check_vma=False))
    errors = int(np.asarray(run(global_array(mesh, np.full((R, 1), calls, np.int32), P()), mailbox)
                            .addressable_shards[0].data)[0])
    assert errors == 0, (R, errors)


def main(process_id: int, processes: int, port: int):
    jax.distributed.initialize(f"localhost:{port}", num_processes=processes, process_id=process_id,
                               initialization_timeout=120)
    assert jax.local_device_count() == 1 and jax.device_count() == processes, jax.devices()
    mesh = parallel.make_mesh(model=processes)
    mailbox = parallel.mailbox(mesh, H)
    assert mailbox is not None  # one process a GPU on one host: the kernel's route
    for R, dtype in ((1, jnp.bfloat16), (4, jnp.float32), (16, jnp.bfloat16)):
        check_values(mesh, mailbox, processes, R, dtype)
    for R in (1, 16):
        check_loop(mesh, mailbox, processes, R)
    print("ok", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
