"""One of several local CPU processes that tests/test_process_failure.py starts as a script of
experiments/ starts them: flags of experiments/lib/cli.py (--coordinator_address, --num_processes,
--process_id, --join_timeout, --heartbeat_timeout), `cli.setup_devices()` and `cli.run`. Once every
process has joined, each takes part in collectives (an all-gather over the processes; the free
memory they agree on, eagle3_jax.spec.memory.fewest_over_processes), prints "joined" and then waits
--wait seconds, in short sleeps: a process blocked where only JAX's
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

    from eagle3_jax.spec import memory

    gathered = multihost_utils.process_allgather(jax.numpy.ones(()))
    assert gathered.shape == (FLAGS.num_processes,), gathered.shape
    # every process refuses a call alike: the fewest bytes free anywhere (beyond int32), None if one has no figures
    pid = FLAGS.process_id
    assert memory.fewest_over_processes((5 << 32) + 7 - pid) == (5 << 32) + 8 - FLAGS.num_processes
    assert memory.fewest_over_processes(None if pid == 0 else 1 << 40) is None
    print("joined", flush=True)
    end = time.monotonic() + FLAGS.wait
    while time.monotonic() < end:
        time.sleep(0.1)
    print("waited", flush=True)


if __name__ == "__main__":
    cli.run(main)
