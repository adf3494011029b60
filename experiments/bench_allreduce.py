"""One all-reduce of a decode-sized residual, through each route XLA and NCCL offer, one run.

  python experiments/bench_allreduce.py --tp 2,4 --rows 1,4,16,64 --out experiments/results/allreduce_<device>.json

The all-reduce a tensor-parallel layer makes: `lax.psum` over a (data 1, model n) mesh of a
[rows, --hidden] bf16 array inside a jitted loop (`timing.allreduce_seconds`: the loop's cost per
all-reduce, the call's own cost taken off), for each n in --tp and each of --rows. Each route in
--routes runs in its own process, since XLA and NCCL read their settings when they start:

  xla       XLA's default (NCCL)
  one_shot  --xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true: XLA's own one-shot kernel
            (each GPU writes its input to its peers' buffers, then sums them), where XLA supports
            the size and device count
  nccl_ll   NCCL_PROTO=LL (NCCL's low-latency protocol)
  nccl_ll128 NCCL_PROTO=LL128

Each result is checked: the psum of per-device values equals their sum. A route whose process fails
(an XLA flag this jaxlib does not know, a wrong sum) is reported with its error's last line and the
others still run. JSON: {"routes": {name: {"env": ..., "results": [{"tp", "rows", "us"}], "error"}}}.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lib import cli, timing

from eagle3_jax import parallel

ROUTES = {
    "xla": {},
    "one_shot": {"XLA_FLAGS": "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"},
    "nccl_ll": {"NCCL_PROTO": "LL"},
    "nccl_ll128": {"NCCL_PROTO": "LL128"},
}

flags.DEFINE_list("routes", list(ROUTES), "routes to time, of " + ",".join(ROUTES))
cli.message_flags()
flags.DEFINE_integer("timeout", 300, "seconds each route's process may take", lower_bound=1)
flags.DEFINE_string("out", None, "JSON output path")
flags.DEFINE_string("child", None, "internal: run one route's measurements in this process and print them")
FLAGS = flags.FLAGS
flags.register_validator("routes", lambda rs: len(rs) > 0 and set(rs) <= set(ROUTES),
                         "expected names of " + ",".join(ROUTES))


def measure() -> list[dict]:
    """In this process: [{tp, rows, us}] for every --tp the devices hold and every --rows, each sum
    checked (device i contributes i + 1: the psum must be n (n + 1) / 2 everywhere)."""
    out = []
    for n in (int(t) for t in FLAGS.tp):
        if n > jax.device_count():
            continue
        mesh = parallel.make_mesh(model=n, devices=jax.devices()[:n])
        for rows in (int(r) for r in FLAGS.rows):
            ones = jax.device_put(jnp.ones((n * rows, FLAGS.hidden), jnp.bfloat16), NamedSharding(mesh, P("model")))
            scaled = ones * (jnp.arange(n * rows) // rows + 1).astype(jnp.bfloat16)[:, None]
            total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "model"), mesh=mesh, in_specs=P("model"),
                                          out_specs=P("model"), check_vma=False))(scaled)
            want = n * (n + 1) / 2
            if not np.all(np.asarray(total, np.float32) == want):
                raise ValueError(f"psum over {n} devices of [{rows}, {FLAGS.hidden}]: not {want} everywhere")
            out.append(dict(tp=n, rows=rows, us=timing.allreduce_seconds(mesh, rows, FLAGS.hidden) * 1e6))
    return out


def run_route(name: str) -> dict:
    """One route in its own process (its environment set before JAX starts)."""
    env = dict(os.environ)
    for key, value in ROUTES[name].items():
        env[key] = f"{env.get(key, '')} {value}".strip() if key == "XLA_FLAGS" else value
    args = [sys.executable, os.path.abspath(__file__), "--child", name, "--tp", ",".join(FLAGS.tp), "--rows",
            ",".join(FLAGS.rows), "--hidden", str(FLAGS.hidden)]
    try:
        r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=FLAGS.timeout,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
    except subprocess.TimeoutExpired:
        return dict(env=ROUTES[name], results=[], error=f"timed out after {FLAGS.timeout} s")
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return dict(env=ROUTES[name], results=[], error=tail[:300])
    return dict(env=ROUTES[name], results=json.loads(lines[-1]), error=None)


def main(argv):
    del argv
    if FLAGS.child:
        print(json.dumps(measure()), flush=True)
        return
    result = dict(timing.device_info(), num_devices=jax.device_count(), hidden=FLAGS.hidden, routes={})
    for name in FLAGS.routes:
        r = result["routes"][name] = run_route(name)
        timing.write_json(FLAGS.out, result)
        if r["error"]:
            cli.write(f"{name:<10} error: {r['error']}")
        else:
            cli.write(f"{name:<10} " + "  ".join(f"tp{x['tp']} {x['rows']} rows {x['us']:.1f} us"
                                                 for x in r["results"]))
    timing.write_json(FLAGS.out, result)


if __name__ == "__main__":
    cli.run(main)
