"""The few-row matmul of a device's projection share (eagle3_jax/pallas/gemv.py `rows_matmul`) against
the model's XLA path (`layers.rows_dot`), per launch config.

  python experiments/bench_gemv.py --out experiments/results/kernels_gemv_<device>.json

x [R, K] @ w.T, w [N, K] (bf16, f32 out) for each of --gemv_shapes and --gemv_rows: the XLA path
(one row padded to two where the model pads it) and `rows_matmul` for each of --gemv_blocks, a call
multiplying --gemv_weights distinct (x, w). Seconds a matmul: device kernel time from the profiler on
GPUs (the program's copies and pads included), wall time elsewhere (the kernel interpreted);
bytes_fraction: w's bytes at the copy bandwidth over it; max_diff: the largest difference from the
XLA path's output. JSON: {device_info..., "gemv": {"copy_bandwidth_bytes_per_s", "weights", "rows",
"table"}}.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from lib import cli, kernel_bench
from lib.kernel_bench import copy_bw, guard, on_gpu, safe_profile

from eagle3_jax.models import layers
from eagle3_jax.pallas import gemv

flags.DEFINE_list("gemv_shapes", ["1024x2880", "2880x1280", "2048x2880", "2880x2560"], "products KxN, "
                  "x [R, K] @ w.T with w [N, K] (gpt-oss-120b's o and q|k|v shares at 4 and at 2 devices)")
flags.DEFINE_list("gemv_rows", ["1", "4"], "rows of x")
flags.DEFINE_list("gemv_blocks", ["4/1024", "8/512", "4/2048"], "rows_matmul launches, each block_n/block_k "
                  "(powers of two)")
flags.DEFINE_integer("gemv_weights", 36, "distinct (x, w) a timed call multiplies (past L2)", lower_bound=1)
cli.positive_ints("gemv_rows")
FLAGS = flags.FLAGS


def _gemv_shape(text):
    k, _, n = text.partition("x")
    if not (k.isdigit() and n.isdigit() and int(k) > 0 and int(n) > 0):
        raise ValueError(f"--gemv_shapes: expected KxN with positive K and N (e.g. 1024x2880), got {text!r}")
    return int(k), int(n)


def _gemv_blocks(text):
    n, _, k = text.partition("/")
    if not all(v.isdigit() and int(v) > 0 and int(v) & (int(v) - 1) == 0 for v in (n, k)):
        raise ValueError(f"--gemv_blocks: block_n/block_k, powers of two, expected; got {text!r}")
    return int(n), int(k)


cli.check_with("gemv_shapes", lambda v: [_gemv_shape(t) for t in v])
cli.check_with("gemv_blocks", lambda v: [_gemv_blocks(t) for t in v])


def _impls():
    """[(name, (block_n, block_k) or None, fn(x, w))]: the XLA path, then rows_matmul per --gemv_blocks."""
    impls = [("xla", None, lambda x, w: layers.rows_dot(x, w, out_first=True, preferred_element_type=jnp.float32))]
    for bn, bk in map(_gemv_blocks, FLAGS.gemv_blocks):
        impls.append(("rows_matmul", (bn, bk), lambda x, w, bn=bn, bk=bk: gemv.rows_matmul(
            x, w, out_dtype=jnp.float32, block_n=bn, block_k=bk, interpret=not on_gpu())))
    return impls


@guard
def bench_gemv():
    bw = copy_bw()
    res = {"copy_bandwidth_bytes_per_s": bw, "weights": FLAGS.gemv_weights, "rows": [], "table": []}
    L = FLAGS.gemv_weights
    for K, N in map(_gemv_shape, FLAGS.gemv_shapes):
        key = jax.random.key(K * 7919 + N)
        ws = [jax.random.normal(jax.random.fold_in(key, i), (N, K), jnp.bfloat16) * K ** -0.5 for i in range(L)]
        for R in map(int, FLAGS.gemv_rows):
            xs = [jax.random.normal(jax.random.fold_in(key, L + i), (R, K), jnp.bfloat16) for i in range(L)]
            want, sets = None, list(zip(xs, ws, strict=True))
            for name, blocks, fn in _impls():
                t, out = kernel_bench.stream(fn, sets, repeats=3)
                out = np.asarray(out, np.float64)
                want = out if want is None else want
                prof = safe_profile(fn, sets)
                t = prof.get("kernel_seconds") or t
                row = {"K": K, "N": N, "rows": R, "impl": name, "block_n": blocks and blocks[0],
                       "block_k": blocks and blocks[1], "seconds": t, "bytes_fraction": K * N * 2 / bw / t,
                       "max_diff": float(np.abs(out - want).max()), "kernels": prof.get("kernels")}
                res["rows"].append(row)
                res["table"].append(f"gemv [{R}, {K}] @ [{N}, {K}].T {name:11} {'/'.join(map(str, blocks or ())):8} "
                                    f"{t * 1e6:8.2f} us "
                                    f"({row['bytes_fraction']:.0%} of w's bytes)  max diff {row['max_diff']:.2g}")
    return res


SECTIONS = {"gemv": bench_gemv}
kernel_bench.define_flags(SECTIONS)

if __name__ == "__main__":
    cli.run(kernel_bench.main(SECTIONS))
