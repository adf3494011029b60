"""Tree attention over a KV cache (eagle3_jax/pallas/attention.py, the Mosaic GPU kernel of
attention_mosaic.py) against the K/V bytes it must read, beside torch's SDPA and flex_attention.

  python experiments/bench_attention.py --out experiments/results/attention_<device>.json

64 query / 8 kv heads, D 64, a bushy tree of Nq new tokens over L committed keys, for each L, B and
Nq: the Pallas (Triton) kernel at its default launch (and at the 32K, Nq <= 16 shapes a sweep of
launches, --attn_sweep), each timed as wall time per call of 16 calls in one program and as device
kernel time (profiler); the best launch's error against the reference (the library's dispatcher
under KernelPolicy(attention="reference")); the Mosaic kernel (KernelPolicy(attention="mosaic"),
full layers) and torch (--attn_torch) at the same shape. Sliding layers (window 128) too. Roofline
fraction: K/V bytes over the copy bandwidth measured in this run. JSON: {device_info...,
"attention": {"copy_bandwidth", "rows", "table"}}. On a CPU the kernel runs in the Pallas interpreter at
small shapes (--kernels_quick on any device).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from lib import cli, kernel_bench, torch_attention
from lib.kernel_bench import copy_bw, guard, on_gpu, policy, safe_profile

from eagle3_jax.pallas import attention_mosaic
from eagle3_jax.pallas.attention import attention, attention_config, attention_pallas
from eagle3_jax.pallas.tree_mask import tree_mask_reference

flags.DEFINE_bool("attn_torch", True, "torch flex_attention / SDPA side by side (GPU only)")
flags.DEFINE_bool("attn_sweep", True, "sweep launch configs at the 32K, Nq in {1, 16} shapes")
flags.DEFINE_bool("kernels_quick", False, "small shapes (CPU runs always take them): L 512, B 1, Nq 1 and 16")
flags.DEFINE_list("attn_lengths", [], "committed keys L (default: 32768,131072; quick: 512)")
flags.DEFINE_list("attn_batches", [], "batch sizes B (default: 1,4; quick: 1)")
flags.DEFINE_list("attn_nqs", [], "new tokens Nq (default: 1,4,8,16,64; quick: 1,16)")
flags.DEFINE_integer("attn_stream", 16, "distinct queries a timed program cycles through", lower_bound=1)
cli.positive_ints("attn_lengths", "attn_batches", "attn_nqs", empty=True)
FLAGS = flags.FLAGS

HQ, HKV, D = 64, 8, 64


class Inputs:
    """One shape's arguments: caches (a few, rotated past L2), the new tokens' k, v, lengths,
    positions, the tree's mask bits, sinks, the parents and --attn_stream queries."""

    def __init__(self, B, Nq, L, window):
        self.B, self.Nq, self.L, self.window = B, Nq, L, window
        n_caches = max(2, min(8, math.ceil(3 * 64e6 / (2 * B * HKV * L * D * 2))))
        S = L + max(Nq, 64)
        ks = jax.random.split(jax.random.key(0), 8)
        bf = jnp.bfloat16
        self.caches = [(jax.random.normal(jax.random.fold_in(ks[0], i), (B, HKV, S, D), bf),
                        jax.random.normal(jax.random.fold_in(ks[1], i), (B, HKV, S, D), bf)) for i in range(n_caches)]
        self.k = jax.random.normal(ks[2], (B, Nq, HKV, D), bf)
        self.v = jax.random.normal(ks[3], (B, Nq, HKV, D), bf)
        self.lengths = jnp.full((B,), L, jnp.int32)
        rng = np.random.default_rng(0)
        self.parents = np.full((B, Nq), -1, np.int32)
        for i in range(1, Nq):  # a bushy tree: parents among the previous 4 nodes
            self.parents[:, i] = rng.integers(max(0, i - 4), i, B)
        self.bits, _, self.positions, _, _ = tree_mask_reference(jnp.asarray(self.parents), self.lengths)
        self.sinks = jax.random.normal(ks[4], (HQ,), jnp.float32)
        self.qs = [jax.random.normal(jax.random.key(100 + i), (B, Nq, HQ, D), bf) for i in range(FLAGS.attn_stream)]
        keys_read = L if window is None else min(L, window - 1)
        self.kv_bytes = 2 * B * HKV * keys_read * D * 2

    def sets(self):
        return [(q, *self.caches[i % len(self.caches)]) for i, q in enumerate(self.qs)]

    def args(self, q, kc, vc):
        return (q, self.k, self.v, kc, vc, self.lengths, self.positions, self.bits, self.sinks)

    def through(self, pol):
        """The library's attention under KernelPolicy `pol`, as a function of (q, k_cache, v_cache)."""
        return lambda q, kc, vc: attention(*self.args(q, kc, vc), window=self.window, scale=D ** -0.5, policy=pol)

    def pallas(self, **overrides):
        """The Pallas kernel at a launch of its own (`attention_config` fields as overrides)."""
        return lambda q, kc, vc: attention_pallas(*self.args(q, kc, vc), window=self.window, scale=D ** -0.5,
                                                  interpret=not on_gpu(), **overrides)


def _rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _time_configs(x: Inputs, configs, bw, rows):
    """A row per launch config (None: the default) of the Pallas kernel, appended to `rows`: (the best
    by device kernel time (wall time off GPUs), or None where none ran; its outputs on the first set)."""
    best, best_out = None, None
    for cfg in configs:
        ov = dict(cfg or {})
        f = x.pallas(**ov) if ov else x.through(policy(attention="triton"))
        try:
            t, out = kernel_bench.stream(f, x.sets())
            prof = safe_profile(f, x.sets())
        except Exception as e:  # noqa: BLE001
            rows.append(dict(L=x.L, B=x.B, Nq=x.Nq, window=x.window, config=ov, error=repr(e)[:400]))
            print("attention config failed", x.L, x.B, x.Nq, x.window, ov, repr(e)[:400], flush=True)
            continue
        used = attention_config(x.B, x.Nq, HQ, HKV, D, x.L + max(x.Nq, 64), x.window, **ov)
        kt = prof.get("kernel_seconds", t)
        r = dict(L=x.L, B=x.B, Nq=x.Nq, window=x.window, config=dict(used.__dict__), seconds=t, kv_bytes=x.kv_bytes,
                 roofline_fraction=x.kv_bytes / bw / t, device=prof, kernel_seconds=kt,
                 kernel_roofline_fraction=x.kv_bytes / bw / kt)
        rows.append(r)
        if best is None or kt < best["kernel_seconds"]:
            best, best_out = r, out
    return best, best_out


def _mosaic(x: Inputs, bw):
    """The Mosaic GPU kernel at its default launch: device time, roofline fraction, error."""
    f = x.through(policy(attention="mosaic"))
    try:
        prof = safe_profile(f, x.sets())
        q, kc, vc = x.sets()[0]
        err = _rel_err(jax.jit(f)(q, kc, vc), x.through(policy(attention="reference"))(q, kc, vc))
        kt = prof["kernel_seconds"]
        return dict(device=prof, kernel_seconds=kt, kernel_roofline_fraction=x.kv_bytes / bw / kt, rel_err=err)
    except Exception as e:  # noqa: BLE001
        return dict(error=repr(e)[:400])


def _table_line(best):
    c, m, nan = best["config"], best.get("mosaic", {}), float("nan")
    return (f"{best['L']:>7} {best['B']:>2} {best['Nq']:>3} {str(best['window']):>4} "
            f"{best['kernel_seconds'] * 1e6:8.1f} "
            f"{100 * best['kernel_roofline_fraction']:6.1f} {best['seconds'] * 1e6:8.1f} "
            f"{best.get('sdpa_s', nan) * 1e6:8.1f} {best.get('flex_s', nan) * 1e6:8.1f} "
            f"{best.get('rel_err', nan):8.1e} {m.get('kernel_seconds', nan) * 1e6:8.1f} "
            f"{100 * m.get('kernel_roofline_fraction', nan):6.1f} {m.get('rel_err', nan):8.1e}  "
            f"ns={c['num_splits']} bk={c['block_k']} rb={c['block_rows']} w={c['num_warps']} st={c['num_stages']} "
            f"pre={int(c['preload_new'])}")


def one_shape(B, Nq, L, window, bw, rows, table, configs=(None,), torch_side=False):
    """Times one shape (every launch in `configs`), appending to rows and a line to table; the best row."""
    x = Inputs(B, Nq, L, window)
    best, out = _time_configs(x, configs, bw, rows)
    if best is None:
        table.append(f"{L:>7} {B:>2} {Nq:>3} {str(window):>4}   FAILED")
        return None
    if L <= 32768 or B == 1:  # correctness of the best config at this shape, f32 reference on the device
        best["rel_err"] = _rel_err(out, jax.jit(x.through(policy(attention="reference")))(*x.sets()[0]))
    if on_gpu() and attention_mosaic.mosaic_fits(x.qs[0], x.caches[0][0], window):
        best["mosaic"] = _mosaic(x, bw)
    parents = x.parents
    del x
    if torch_side and on_gpu() and FLAGS.attn_torch:
        try:
            best.update(torch_attention.times(B, Nq, L, parents, HQ, HKV, D, flex=Nq <= 16))
        except Exception as e:  # noqa: BLE001
            best["torch_error"] = repr(e)[:300]
    best["best"] = True
    table.append(_table_line(best))
    print(table[-1], flush=True)
    return best


def _sweep(B, Nq, L):
    """The launches --attn_sweep times at the 32K, Nq <= 16 shapes on GPUs (None: the default)."""
    if not (on_gpu() and FLAGS.attn_sweep and L == 32768 and Nq <= 16):
        return [None]
    base = attention_config(B, Nq, HQ, HKV, D, L + 64, None)
    ns = base.num_splits
    configs = [None, dict(num_splits=max(1, ns // 2)), dict(num_splits=2 * ns), dict(num_stages=4)]
    return configs + ([dict(block_k=128)] if base.block_rows <= 64 else [dict(block_k=32), dict(num_stages=2)])


@guard
def bench_attention():
    bw = copy_bw()
    quick = FLAGS.kernels_quick or not on_gpu()
    prefixes = [int(n) for n in FLAGS.attn_lengths] or ([512] if quick else [32768, 131072])
    batches = [int(n) for n in FLAGS.attn_batches] or ([1] if quick else [1, 4])
    nqs = [int(n) for n in FLAGS.attn_nqs] or ([1, 16] if quick else [1, 4, 8, 16, 64])
    rows = []
    table = [f"attention on {jax.devices()[0].device_kind}: us; roof% = K/V bytes / copy bandwidth "
             f"({bw / 1e12:.2f} TB/s) / time",
             "pallas = device kernel time per call (profiler, split-K merge included); stream = wall time per "
             f"call of {FLAGS.attn_stream} calls in one program (launch gaps included); sdpa/flex: CUDA events, "
             "20 calls; mosaic: attention_mosaic.py (full layers), device kernel time, its roof% and relerr",
             f"{'L':>7} {'B':>2} {'Nq':>3} {'win':>4} {'pallas':>8} {'roof%':>6} {'stream':>8} {'sdpa':>8} "
             f"{'flex':>8} {'relerr':>8} {'mosaic':>8} {'roof%':>6} {'relerr':>8}  config"]
    for L in prefixes:
        for B in batches:
            for Nq in nqs:
                one_shape(B, Nq, L, None, bw, rows, table, _sweep(B, Nq, L),
                          torch_side=L == 32768 and Nq in (1, 16, 64))
        for B in batches:  # sliding layers (window 128): time independent of the prefix
            for Nq in [1] if quick else [1, 16]:
                one_shape(B, Nq, L, 128, bw, rows, table)
    return dict(copy_bandwidth=bw, rows=rows, table=table)


SECTIONS = {"attention": bench_attention}
kernel_bench.define_flags(SECTIONS)

if __name__ == "__main__":
    cli.run(kernel_bench.main(SECTIONS))
