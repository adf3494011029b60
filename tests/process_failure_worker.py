"""One of several local CPU processes that tests/test_process_failure.py starts as a script of
experiments/ starts them: flags of experiments/lib/cli.py (--coordinator_address, --num_processes,
--process_id, --join_timeout, --heartbeat_timeout), `cli.setup_devices()` and `cli.run`. Once every
process has joined, each takes part in one collective (an all-gather over the processes), prints
"joined" and then waits --wait seconds, in short sleeps: a process blocked where only JAX's
coordination service can end it, as a collective waiting for a dead peer on GPUs is. Prints
"waited" and exits 0 if nothing ended it."""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

import jax  # noqa: E402
from absl import flags  # noqa: E402
from lib import cli  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)
cli.mesh_flags()
flags.DEFINE_integer("wait", 60, "seconds to wait after joining")
FLAGS = flags.FLAGS


def main(argv):
    cli.setup_devices()
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(jax.numpy.ones(()))
    assert gathered.shape == (FLAGS.num_processes,), gathered.shape
    print("joined", flush=True)
    end = time.monotonic() + FLAGS.wait
    while time.monotonic() < end:
        time.sleep(0.1)
    print("waited", flush=True)


if __name__ == "__main__":
    cli.run(main)
