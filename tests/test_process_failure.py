"""Several processes (experiments/lib/cli.py `setup_devices` over jax.distributed, CPU devices): a
process that dies, or never joins, ends the others with a clear message within a stated bound,
instead of leaving them waiting forever (tests/process_failure_worker.py)."""

import os
import signal
import subprocess
import sys
import time

import local_processes

HEARTBEAT = 3  # --heartbeat_timeout, s
JOIN = 3  # --join_timeout, s
SLACK = 10  # s: the bound is the timeout + this (the coordination service's polling, a busy 2-core machine)


def worker(process_id: int, num_processes: int, port: int):
    args = [f"--coordinator_address=localhost:{port}", f"--num_processes={num_processes}",
            f"--process_id={process_id}", f"--join_timeout={JOIN}", f"--heartbeat_timeout={HEARTBEAT}", "--wait=120"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, os.path.join(local_processes.HERE, "process_failure_worker.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def joined(p) -> bool:
    """Whether p printed "joined" (Gloo prints its own lines before) before its stdout ended."""
    return any(line == "joined\n" for line in iter(p.stdout.readline, ""))


def finish(p, timeout):
    """(stdout, stderr, seconds until p ended) of p, killed after `timeout` seconds."""
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return out, err, time.monotonic() - t0


def test_a_dead_process_or_one_that_never_joins_ends_the_others():
    # both cases at once: two processes of which the second is killed once both joined, and the first of
    # two processes whose second never starts
    port = local_processes.free_port()
    pair = [worker(i, 2, port) for i in range(2)]
    alone = worker(0, 2, local_processes.free_port())
    try:
        assert all(joined(p) for p in pair), [finish(p, 1) for p in pair]
        pair[1].send_signal(signal.SIGKILL)
        out, err, seconds = finish(pair[0], HEARTBEAT + SLACK)
        assert pair[0].returncode not in (0, None), (out, err)  # SIGABRT from JAX's fatal log
        assert "waited" not in out, out
        assert "Terminating process because the JAX distributed service detected fatal errors" in err, err[-3000:]
        assert "The following tasks are unhealthy (stopped sending heartbeats):\n1\n" in err, err[-3000:]
        assert seconds < HEARTBEAT + SLACK, seconds
        print(f"the survivor ended {seconds:.1f} s after its peer was killed")

        out, err, seconds = finish(alone, JOIN + SLACK)
        assert alone.returncode == 1 and out == "", (out, err)
        last = err.splitlines()[-1]  # after JAX's INFO lines: one line, the cause
        assert last.startswith(f"error: jax.distributed: process 0 of 2 waited {JOIN} s at localhost:"), err
        assert "not every process joined (--join_timeout 3)" in last, err
    finally:
        for p in pair + [alone]:
            if p.poll() is None:
                p.kill()
                p.wait()
