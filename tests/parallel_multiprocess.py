"""One of two processes that tests/test_parallel.py starts on localhost: `python parallel_multiprocess.py
PROCESS_ID PORT`. Each has 2 CPU devices; through jax.distributed (CPU collectives: gloo) they form
one (data 2, model 2) mesh, data across the processes. The tree decode on the sharded pair must give
the tokens process 0 then computes alone on its first device (generate and the chain are left to
parallel_decode.py, for time); the one-shot kernel's Mailbox is refused (CPU devices across
processes share no memory). Prints the sharded runs' tokens as JSON (tests/test_parallel.py checks
that both processes got the same), then "ok"."""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
from parallel_decode import KW, NEW, RUNS, pair  # noqa: E402

from eagle3_jax import parallel  # noqa: E402
from eagle3_jax.pallas import allreduce
from eagle3_jax.spec import decode  # noqa: E402


def tokens(t, d, prompts):
    return {"tree": decode(t, d, prompts, NEW, **RUNS["tree"], **KW).tokens}


def main(process_id: int, port: int):
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id, initialization_timeout=60)
    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2, jax.devices()
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 13, 20, 9)]
    mesh = parallel.make_mesh(model=2, data=2)
    assert {d.process_index for d in mesh.devices[0]} == {0} and {d.process_index for d in mesh.devices[1]} == {1}
    assert parallel.mailbox(mesh, 256) is None  # no GPUs: XLA's collectives
    try:  # the one-shot kernel's memory is shared across processes only on GPUs
        allreduce.new_mailbox(mesh, 256)
        raise AssertionError("new_mailbox made a Mailbox across CPU processes")
    except ValueError as e:
        assert "across 2 processes shares memory only on GPUs (CUDA IPC); found cpu devices" in str(e), e
    t, d = pair()
    parallel.shard(t, mesh)
    parallel.shard(d, mesh)
    assert not t.lm_head.get_value().is_fully_addressable  # the mesh spans both processes
    got = tokens(t, d, prompts)
    if process_id == 0:  # after the sharded runs: the processes reach their first collective together
        want = tokens(*pair(), prompts)  # this process alone, on its first device
        for name in want:
            assert got[name] == want[name], (process_id, name, got[name], want[name])
    print(json.dumps(got))
    print("ok", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
