"""Kill-during-save trials for tests/test_checkpoint_writes.py: processes killed by SIGKILL in the
middle of `save_gpt_oss(..., overwrite=True)`.

    python checkpoint_kill_worker.py ROOT SOURCE TRIALS SEED

Run through experiment_runner (forked from a server that imported JAX and eagle3_jax without
starting a backend), this process starts no backend either: each save runs in a process forked
from it, which starts its own, loads the checkpoint SOURCE and saves it into ROOT/<trial>/ckpt
(prepared by the test: another checkpoint, or nothing). First ROOT/calibrate/ckpt: a whole save,
counting its file operations (os.rename, os.replace, os.mkdir, os.link, os.open, os.fsync,
shutil.rmtree, shutil.copymode, open and safetensors' save_file on paths under ROOT, and the
atomic exchange) and timing it. Then TRIALS trials: even ones ("op") kill themselves just before
their n-th file operation, n spread over the calibrated count; odd ones ("time") are killed by this
process a random time after their first file operation (up to the calibrated time from there to
the end of the save). Trials i % 4 in
{2, 3} use the fallback replacement (old folder aside, then rename) instead of the exchange.
Writes ROOT/results.json: [{trial, mode, at, exchange, status}], status the signal that ended the
saving process (9: SIGKILL) or 0 when the save ended first.
"""

import builtins
import json
import os
import random
import shutil
import signal
import sys
import time
import traceback


def saver(out_fd, root, source, target, mode, at, exchange):
    """The forked process: load SOURCE, count file operations (dying before the at-th one in mode
    "op"), save; writes "s" on out_fd at the first file operation, then {"ops", "seconds" (from the
    first file operation to the end)}."""
    import safetensors.numpy

    from eagle3_jax.convert import folders, load_gpt_oss, save_gpt_oss

    model = load_gpt_oss(source, progress=False)
    if not exchange:
        folders._exchange = lambda a, b: False
    ops = [0]

    def counted(fn):
        def wrapped(*args, **kwargs):
            first = args[0] if args else None
            if not isinstance(first, (str, os.PathLike)) or os.fspath(first).startswith(root):
                ops[0] += 1
                if ops[0] == 1:  # the save begins writing: the clock of mode "time" starts
                    t0[0] = time.perf_counter()
                    os.write(out_fd, b"s")
                if mode == "op" and ops[0] == at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return wrapped

    for module, name in ((os, "rename"), (os, "replace"), (os, "mkdir"), (os, "link"), (os, "open"), (os, "fsync"),
                         (shutil, "rmtree"), (shutil, "copymode"), (builtins, "open"),
                         (safetensors.numpy, "save_file"), (folders, "_exchange")):
        setattr(module, name, counted(getattr(module, name)))
    t0 = [time.perf_counter()]
    t_start = t0[0]
    save_gpt_oss(model, target, overwrite=True)
    end = time.perf_counter()
    os.write(out_fd, json.dumps({"ops": ops[0], "seconds": end - t0[0], "before": t0[0] - t_start}).encode())


def trial(root, source, target, mode="none", at=0, exchange=True):
    """Forks a saver; in mode "time" kills it `at` seconds after it begins saving. Returns (status,
    the saver's report or None)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            saver(w, root, source, target, mode, at, exchange)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    started = os.read(r, 1)
    if mode == "time" and started:
        time.sleep(at)
        os.kill(pid, signal.SIGKILL)
    report = b""
    while chunk := os.read(r, 4096):
        report += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status), None
    if os.WEXITSTATUS(status):
        raise RuntimeError(f"the saver of {target} failed (status {os.WEXITSTATUS(status)})")
    return 0, json.loads(report) if report else None


def main(root, source, trials, seed):
    root = os.path.realpath(root)
    rng = random.Random(seed)
    _, calibration = trial(root, source, os.path.join(root, "calibrate", "ckpt"))
    n_ops, seconds = calibration["ops"], calibration["seconds"]
    op_trials = list(range(0, trials, 2))
    results = []
    for i in range(trials):
        if i % 2 == 0:  # stratified: one draw in each of len(op_trials) equal parts of the operations
            j = op_trials.index(i)
            mode, at = "op", 1 + int((j + rng.random()) * n_ops / len(op_trials))
        else:
            mode, at = "time", rng.uniform(0.0, seconds)
        exchange = i % 4 < 2
        status, _ = trial(root, source, os.path.join(root, str(i), "ckpt"), mode, at, exchange)
        results.append(dict(trial=i, mode=mode, at=at, exchange=exchange, status=status))
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump(dict(ops=n_ops, seconds=seconds, trials=results), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
