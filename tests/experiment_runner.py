"""Runs experiments/*.py scripts for the tests as `python experiments/<script> ARGS` would, each in a
process forked from one server process that has imported JAX, Flax, absl and eagle3_jax already
(about 2 s of each script's start on a 2-core CPU). No JAX backend is started before the fork: the
child starts its own, with its own XLA_FLAGS. The child runs the script as __main__ with the
script's folder first on sys.path, its argv, the caller's environment and working directory, stdout
and stderr to files and stdin from /dev/null; its exit status is the script's (an uncaught
exception: its traceback on stderr, status 1).

`run` (stdout of a run that must exit 0) and `fails` (stderr of one that must exit with `code`) run
experiments/<script> on CPU (`CPU_ENV`: also the matmul precision conftest.py gives the tests' own
process, so that scripts and tests compile the same programs); `execute` runs any script path and
returns a CompletedProcess. JAX reads its environment variables (JAX_*) when it is imported: the
server imports it with this process's JAX_* variables and CPU_ENV, and a run whose JAX_* variables
differ from those gets a process of its own, started as usual.
Server side: `python experiment_runner.py` reads one JSON job a line and answers one JSON line."""

import atexit
import json
import os
import subprocess
import sys
import tempfile

EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
CPU_ENV = {"JAX_PLATFORMS": "cpu", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
_server = None


def _server_main():
    import runpy
    import traceback

    import absl.app
    import absl.flags  # noqa: F401
    import jax
    import jax.numpy  # noqa: F401
    import numpy  # noqa: F401
    from flax import nnx  # noqa: F401

    import eagle3_jax.assets
    import eagle3_jax.convert
    import eagle3_jax.models
    import eagle3_jax.parallel
    import eagle3_jax.spec
    import eagle3_jax.train  # noqa: F401

    for line in sys.stdin:  # `execute` sends only jobs whose JAX_* variables are the server's
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: the script as `python script args` runs it
            code = 1
            try:
                os.environ.clear()
                os.environ.update(job["env"])
                os.chdir(job["cwd"])
                fd = os.open(os.devnull, os.O_RDONLY)
                os.dup2(fd, 0)
                for stream, path in ((1, job["stdout"]), (2, job["stderr"])):
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(fd, stream)
                    os.close(fd)
                sys.argv = list(job["argv"])
                script = os.path.abspath(job["argv"][0])
                sys.path[0] = os.path.dirname(script)
                try:
                    runpy.run_path(script, run_name="__main__")
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                    if e.code is not None and not isinstance(e.code, int):
                        print(e.code, file=sys.stderr)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                atexit._run_exitfuncs()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


def _stop():
    global _server
    if _server is not None:
        _server.kill()
        _server.wait()
        _server = None


def cpu_env(env=()):
    """This process's environment, CPU_ENV and `env` on top; XLA_FLAGS in `env` are added to this process's
    (conftest.py's CPU compile settings stay)."""
    env = dict(env)
    out = {**os.environ, **CPU_ENV, **env}
    if "XLA_FLAGS" in env and os.environ.get("XLA_FLAGS"):
        out["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {env['XLA_FLAGS']}"
    return out


def run(script, *args, env=(), cwd=None, timeout=600):
    """stdout of `python experiments/<script> args` on CPU (from `cwd` with `script` relative to it, if
    given), which must exit 0; `env`: variables set on top of this process's environment (`cpu_env`)."""
    r = execute(script if cwd else os.path.join(EXPERIMENTS, script), *args, cwd=cwd, timeout=timeout,
                env=cpu_env(env))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def fails(script, *args, code=1, env=(), timeout=120):
    """stderr of `python experiments/<script> args` on CPU, which must exit with `code`."""
    r = execute(os.path.join(EXPERIMENTS, script), *args, timeout=timeout, env=cpu_env(env))
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return r.stderr


def _jax_env(env):
    return {k: v for k, v in env.items() if k.startswith("JAX_")}


def execute(path, *args, env=None, cwd=None, timeout=600):
    """`python path *args` in a child of the server (started on first use, JAX imported with this
    process's JAX_* variables and CPU_ENV); a CompletedProcess. At `timeout` seconds the server and the
    run are killed. A run whose JAX_* variables differ from the server's (which JAX read when the
    server imported it) runs in a process of its own, started as usual."""
    global _server
    env = dict(os.environ if env is None else env)
    if _jax_env(env) != _jax_env({**os.environ, **CPU_ENV}):
        return subprocess.run([sys.executable, path, *map(str, args)], capture_output=True, text=True, env=env,
                              cwd=cwd, timeout=timeout)
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env={**os.environ, **CPU_ENV},
                                   start_new_session=True)
        atexit.register(_stop)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        job = dict(argv=[str(path), *map(str, args)], env=env, cwd=os.path.abspath(cwd or os.getcwd()),
                   stdout=out, stderr=err)
        _server.stdin.write(json.dumps(job) + "\n")
        _server.stdin.flush()
        answer = _read_line(timeout)
        with open(out) as f, open(err) as g:
            return subprocess.CompletedProcess([sys.executable, path, *args], answer["returncode"], f.read(), g.read())


def _read_line(timeout):
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(_server.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            os.killpg(_server.pid, 9)  # the server and the child running the script
            _stop()
            raise subprocess.TimeoutExpired("experiment_runner", timeout)
    line = _server.stdout.readline()
    if not line:
        raise RuntimeError(f"experiment_runner: the server ended (status {_server.poll()})")
    return json.loads(line)


if __name__ == "__main__":
    _server_main()
