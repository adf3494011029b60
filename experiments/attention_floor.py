"""How close the full-layer attention can get to the HBM roofline: the Mosaic prefix kernel
(eagle3_jax/pallas/attention_mosaic.py) with its math left out (stream) and with its copies left out
(compute), beside the whole call and a plain XLA read of the same K/V bytes, GPU only.

  python experiments/attention_floor.py --out experiments/results/attention_floor_h200.json

Per (B, Nq) at --length committed keys (64 query / 8 kv heads, D 64, causal new tokens): device kernel
time (profiler) of
  call     attention_mosaic (prefix kernel + finish kernel)
  prefix   the prefix kernel alone
  stream   the prefix kernel's TMA stream alone (probe="stream")
  compute  its math alone, on whatever the ring holds (probe="compute")
  xla_read an XLA reduction reading the same caches (f32 sums of K and of V)
and each as a fraction of the roofline (K/V bytes over the copy bandwidth measured in this run).
prefix, stream and compute time the prefix kernel alone through `attention_mosaic.prefix_call`
(its launch and probes); where the package does not expose it, those rows are left out (None).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from lib import cli, timing

from eagle3_jax.pallas import attention_mosaic as mosaic
from eagle3_jax.pallas.attention import attention_reference

flags.DEFINE_integer("length", 32768, "committed keys a sequence", lower_bound=1)
flags.DEFINE_list("batches", ["1", "4"], "batch sizes B")
flags.DEFINE_list("nqs", ["1", "4", "8", "16"], "query tokens Nq")
cli.positive_ints("batches", "nqs")
flags.DEFINE_string("out", None, "JSON output path")
FLAGS = flags.FLAGS

HQ, HKV, D = 64, 8, 64
PREFIX_CALL = getattr(mosaic, "prefix_call", None)  # the prefix kernel alone, its probes: not public yet
PARTS = ("call", "prefix", "stream", "compute", "xla_read")


def measure(B, Nq, L, bw):
    S = L + 64
    kv_bytes = 2 * B * HKV * L * D * 2
    n_caches = max(2, min(8, math.ceil(3 * 64e6 / kv_bytes)))  # rotated: no call finds its caches in L2
    key = jax.random.key(B * 100 + Nq)
    ks = jax.random.split(key, 4)
    caches = [(jax.random.normal(jax.random.fold_in(ks[0], i), (B, HKV, S, D), jnp.bfloat16),
               jax.random.normal(jax.random.fold_in(ks[1], i), (B, HKV, S, D), jnp.bfloat16)) for i in range(n_caches)]
    k, v = (jax.random.normal(kk, (B, Nq, HKV, D), jnp.bfloat16) for kk in (ks[2], ks[3]))
    qs = [jax.random.normal(jax.random.key(1000 + i), (B, Nq, HQ, D), jnp.bfloat16) for i in range(8)]
    lengths = jnp.full((B,), L, jnp.int32)
    positions = L + jnp.broadcast_to(jnp.arange(Nq, dtype=jnp.int32), (B, Nq))
    sinks = jax.random.normal(jax.random.key(7), (HQ,), jnp.float32)
    sets = [(qs[i], *caches[i % n_caches]) for i in range(len(qs))]
    launch = mosaic.launch_config(qs[0], caches[0][0])

    def call(q, kc, vc):
        return mosaic.attention_mosaic(q, k, v, kc, vc, lengths, positions, None, sinks, window=None, scale=D ** -0.5)

    def prefix(probe):
        return lambda q, kc, vc: PREFIX_CALL(q, kc, vc, lengths, scale=D ** -0.5, probe=probe, **launch)

    fns = dict(call=call, xla_read=lambda q, kc, vc: (jnp.sum(kc, dtype=jnp.float32), jnp.sum(vc, dtype=jnp.float32)))
    if PREFIX_CALL is not None:
        fns.update(prefix=prefix(None), stream=prefix("stream"), compute=prefix("compute"))
    row = dict(B=B, Nq=Nq, length=L, kv_bytes=kv_bytes, launch=launch, prefix=None, stream=None, compute=None)
    for name, fn in fns.items():
        prof = timing.profile_calls(fn, sets)
        t = prof["kernel_seconds"]
        row[name] = dict(us=t * 1e6, roofline_fraction=kv_bytes / bw / t, kernels_us={k_: v_ * 1e6 for k_, v_ in
                                                                                        prof["kernels"].items()})
    out = np.asarray(jax.jit(call)(*sets[0]), np.float32)
    ref = np.asarray(attention_reference(qs[0], k, v, *caches[0], lengths, positions, None, sinks, window=None,
                                         scale=D ** -0.5), np.float32)
    row["call"]["rel_err"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    return row


def main(_):
    if jax.default_backend() != "gpu":
        raise SystemExit("attention_floor: the Mosaic GPU kernel needs a GPU")
    bw = timing.copy_bandwidth()
    res = dict(**timing.device_info(), copy_bandwidth_bytes_per_s=bw, rows=[])
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; us (roofline %)")
    for B in map(int, FLAGS.batches):
        for Nq in map(int, FLAGS.nqs):
            row = measure(B, Nq, FLAGS.length, bw)
            res["rows"].append(row)
            parts = "  ".join(f"{n} {row[n]['us']:6.1f} ({100 * row[n]['roofline_fraction']:5.1f})"
                              for n in PARTS if row[n] is not None)
            print(f"B={B} Nq={Nq:2d}  {parts}  err {row['call']['rel_err']:.1e}", flush=True)
            timing.write_json(FLAGS.out, res)  # after each row


if __name__ == "__main__":
    cli.run(main)
