"""Tests that start several local processes under jax.distributed (tests/test_parallel.py on CPUs,
tests/test_pallas_allreduce.py one a GPU): a free coordinator port, and the processes run to the end."""

import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_all(script: str, args, envs, timeout: float = 300):
    """Runs `python tests/<script> *args[i]` with environment envs[i] for each i, all at once from the
    tests folder, and asserts that each exits 0 with its last line "ok" (its stdout and the tail of its
    stderr otherwise); returns their stdouts. A process still running at `timeout` seconds is killed."""
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, script), *map(str, a)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=HERE) for a, env in zip(args, envs)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.rstrip().endswith("ok"), (out, err[-4000:])
    return [out for out, _ in outs]
