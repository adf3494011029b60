"""The MXFP4 expert kernels (eagle3_jax/pallas/moe.py) against the bytes they must read: decode and
verify sizes (section moe) and prefill chunks through the grouped kernels (section moe_grouped).

  python experiments/bench_moe.py --only moe --out experiments/results/moe_<device>.json
  python experiments/bench_moe.py --only moe --moe_e2e --out experiments/results/moe_e2e_<device>.json

moe: one MoE layer of --moe_preset (random packed experts, its random router; --moe_units: one
device's share of each expert), for each of --moe_tokens T: `mxfp4_moe` per call cycling
--moe_routings router-drawn routings (wall time and, on GPUs, device kernel time), against the packed
bytes of the distinct selected experts at the copy bandwidth measured here; the layer as the model
runs it (`MoE.__call__` on its "kernel" path: router kernels, then the experts, under
KernelPolicy(moe_config=...)) and on the jnp "gathered" and "grouped" (scan) paths. --moe_sweep first
times MoeConfig variants and takes the fastest correct one; --moe_config fixes the config instead of
`moe.config_for(units)`. --moe_e2e first builds the whole --moe_preset model and times a B=1 decode
step and its parts (`step_timing.loop_time`), the MoE kernels under the same config.

moe_grouped: the same layer on --grouped_tokens tokens through `MoE.__call__`'s "grouped" path (router
included), its tiles through the Pallas grouped kernels and, with --grouped_scan, through XLA's scan
(KernelPolicy(moe_grouped="kernel" | "scan")): seconds, TFLOP/s of the pairs' useful work, bytes
roofline fraction, and the kernels' error against the scan.

JSON: {device_info..., "moe": {...}, "moe_grouped": {...}}; with --out, a run cut short leaves what it
measured in <out>.moe_partial. On a CPU the kernels run in the Pallas interpreter (--moe_preset tiny).
"""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from lib import cli, kernel_bench, step_timing, timing
from lib.kernel_bench import copy_bw, guard, jit_seconds, on_gpu, policy, safe_profile

from eagle3_jax import parallel
from eagle3_jax.models import GptOssConfig, gpt_oss
from eagle3_jax.pallas import moe as mk
from eagle3_jax.pallas import select

flags.DEFINE_list("moe_tokens", ["1", "4", "8", "16", "32", "64"], "token counts T (top-4 routing)")
flags.DEFINE_list("moe_sweep", [], "MoeConfig variants to time at --moe_sweep_tokens before the main table, "
                  "each 'key=value/key=value' (e.g. decode=ptx/block_i=64); the fastest correct one is used")
flags.DEFINE_list("moe_sweep_tokens", ["1", "16"], "token counts of the sweep (the sum of device kernel times ranks "
                  "variants; wall times where the profiler gives none)")
cli.positive_ints("moe_tokens", "moe_sweep_tokens")
flags.DEFINE_integer("moe_routings", 4, "distinct random routings cycled inside one timed call (defeats L2 reuse; "
                     "each is its own kernel instance, compiled separately)", lower_bound=1)
flags.DEFINE_bool("moe_e2e", False, "also build the random full-size --moe_preset model and time B=1 decode and its "
                  "parts")
flags.DEFINE_integer("moe_e2e_prompt", 128, "committed context (tokens) of the end-to-end decode step", lower_bound=1)
flags.DEFINE_integer("moe_e2e_new", 16, "decode steps per timed loop", lower_bound=1)
flags.DEFINE_bool("moe_jnp", True, "also time the MoE layer's jnp paths (slow to compile)")
flags.DEFINE_string("moe_preset", "gpt-oss-120b", "GptOssConfig preset of the benchmarked layer (tiny: CPU smoke run)")
flags.DEFINE_integer("moe_units", None, "intermediate units of each expert (default: the preset's); one device's "
                     "share under the units split, e.g. 736 for gpt-oss-120b over 4 devices "
                     "(parallel.expert_units / 4)", lower_bound=1)
flags.DEFINE_string("moe_config", "", "MoeConfig the model and the main table use ('key=value/...'; default: "
                    "moe.config_for(units)), e.g. fma_warps=1")
flags.DEFINE_list("grouped_tokens", ["256", "2048", "4096"], "moe_grouped: tokens per call (prefill chunks)")
cli.positive_ints("grouped_tokens")
flags.DEFINE_bool("grouped_scan", True, "moe_grouped: also time the grouped path's XLA scan (each tile's expert "
                  "dequantized in turn)")
FLAGS = flags.FLAGS


def layer_config(preset: str, units: int | None):
    """The layer the sections time (--moe_preset, --moe_units): the preset with `units` intermediate
    units where given; ValueError where the config cannot hold them."""
    cfg = GptOssConfig.preset(preset)
    return cfg if units is None else cfg.replace(intermediate_size=units)


def parse_moe_config(text):
    """'key=value/key=value' -> MoeConfig (decode's value a name, the others integers); ValueError
    naming the text and the fields where it is not that."""
    fields = [f.name for f in dataclasses.fields(mk.MoeConfig)]
    kw = {}
    for part in filter(None, text.split("/")):
        key, eq, val = part.partition("=")
        if not eq or key not in fields or not (key == "decode" or val.lstrip("-").isdigit()):
            raise ValueError(f"MoeConfig {text!r}: expected key=value parts joined by '/', keys of {fields} "
                             f"(decode a name, the others integers); got {part!r}")
        kw[key] = val if key == "decode" else int(val)
    return mk.MoeConfig(**kw)


# --moe_preset names a preset and --moe_units fits its experts: GptOssConfig's own checks
cli.check_with(["moe_preset", "moe_units"], lambda v: layer_config(v["moe_preset"], v["moe_units"]))
cli.check_with("moe_sweep", lambda texts: [parse_moe_config(t) for t in texts])
cli.check_with("moe_config", lambda text: text and parse_moe_config(text))


def chosen_config():
    """--moe_config, or None (`moe.config_for` the experts' units)."""
    return parse_moe_config(FLAGS.moe_config) if FLAGS.moe_config else None


class Layer:
    """One MoE layer of --moe_preset / --moe_units, random packed experts (scale bytes 119..121) and
    router, with what the timings need: its packed arrays, bytes an expert, inputs."""

    def __init__(self):
        self.cfg = layer_config(FLAGS.moe_preset, FLAGS.moe_units)
        self.module = gpt_oss.MoE(self.cfg, jnp.bfloat16, nnx.Rngs(0))
        ex = self.module.experts
        self.packed = (ex.gate_up_blocks[...], ex.gate_up_scales[...], ex.gate_up_bias[...],
                       ex.down_blocks[...], ex.down_scales[...], ex.down_bias[...])
        self.per_expert = mk.expert_bytes(*self.packed)
        self.limit, self.alpha = float(self.module.limit), float(self.module.alpha)
        self._route = jax.jit(lambda m, x: m.route(x))

    def inputs(self, T, seed, R):
        """R routings of T tokens through the layer's random router (realistic top-k sets):
        (x [R, T, H], ids [R, T, k], weights [R, T, k])."""
        xs = jax.random.normal(jax.random.key(seed), (R, T, self.cfg.hidden_size), jnp.bfloat16)
        ids, ws = zip(*[self._route(self.module, xs[r]) for r in range(R)], strict=True)
        return xs, jnp.stack(ids), jnp.stack(ws)

    def kernel(self, config):
        """mxfp4_moe(x, ids, weights, *packed) at `config`."""
        return lambda x, i, w, *p: mk.mxfp4_moe(x, i, w, *p, limit=self.limit, alpha=self.alpha, config=config,
                                                interpret=not on_gpu())

    def rel_err(self, config, T=5, seed=123):
        """The kernel's relative error against `mxfp4_moe_reference` on T tokens (nan if not finite)."""
        xs, ids, ws = self.inputs(T, seed, 1)
        out = np.asarray(self.kernel(config)(xs[0], ids[0], ws[0], *self.packed), np.float64)
        ref = np.asarray(mk.mxfp4_moe_reference(xs[0], ids[0], ws[0], *self.packed, limit=self.limit,
                                                alpha=self.alpha), np.float64)
        return float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.isfinite(out).all() else float("nan")

    def roofline(self, T, ids, bw):
        """(distinct experts a routing reads on average, bytes, roofline seconds)."""
        distinct = float(np.mean([len(np.unique(np.asarray(i))) for i in ids]))
        nbytes = distinct * self.per_expert + T * self.cfg.hidden_size * (2 + 4)  # experts + x in + f32 out
        return distinct, nbytes, nbytes / bw


def _kernel_stream(layer, config, R):
    """The kernel over R routings in one call (their first 8 columns), for `jit_seconds`."""
    f = layer.kernel(config)
    return lambda xs, ids, ws, *p: jnp.stack([f(xs[r], ids[r], ws[r], *p)[:, :8] for r in range(R)])


def _timed(layer, config, T, xs, ids, ws, bw, R):
    """{us, roofline, and where the profiler gives them device_us, device_roofline, kernels_us} of the
    kernel at `config` on T tokens, and the seconds that rank it (device time where there is one)."""
    t = jit_seconds(_kernel_stream(layer, config, R), xs, ids, ws, *layer.packed) / R
    roof = layer.roofline(T, ids, bw)[2]
    row = dict(us=t * 1e6, roofline=roof / t)
    prof = safe_profile(layer.kernel(config), [(xs[r], ids[r], ws[r], *layer.packed) for r in range(R)])
    if "kernels" in prof:  # device time: what the GPU spends, free of the host's share
        t = prof["kernel_seconds"]
        row.update(device_us=t * 1e6, device_roofline=roof / t, kernels_us={n: v * 1e6 for n, v in
                                                                             prof["kernels"].items()},
                   kernel_seconds=t, span_seconds=prof["span_seconds"])
    return row, t


def _sweep_row(layer, text, bw, R):
    """One --moe_sweep variant at every --moe_sweep_tokens: its figures, "ok" (correct everywhere) and
    "total_s" (the sum of its ranking times), or "error" where it does not compile or run."""
    c = parse_moe_config(text)
    row = dict(config=dataclasses.asdict(c))
    try:
        total = 0.0
        for T in map(int, FLAGS.moe_sweep_tokens):
            row[f"rel_err_T{T}"] = layer.rel_err(c, T)
            xs, ids, ws = layer.inputs(T, T, R)
            fig, t = _timed(layer, c, T, xs, ids, ws, bw, R)
            row.update({f"{k}_T{T}": v for k, v in fig.items() if k not in ("kernel_seconds", "span_seconds")})
            total += t
        row["ok"] = all(row[f"rel_err_T{T}"] < 1e-2 for T in map(int, FLAGS.moe_sweep_tokens))
        row["total_s"] = total
    except Exception as e:  # noqa: BLE001 -- a variant that does not compile or run is reported, not fatal
        row["ok"], row["error"] = False, f"{type(e).__name__}: {str(e)[:400]}"
    return row


def _token_row(layer, T, config, bw, R):
    """The main table's row at T tokens: the kernel alone, then the layer on the model's paths."""
    xs, ids, ws = layer.inputs(T, 1000 + T, R)
    distinct, nbytes, t_roof = layer.roofline(T, ids, bw)
    row = dict(tokens=T, distinct_experts=distinct, bytes=nbytes, roofline_us=t_roof * 1e6)
    fig, _ = _timed(layer, config, T, xs, ids, ws, bw, R)
    row.update(kernel_us=fig["us"], kernel_roofline_fraction=fig["roofline"])
    if "kernels_us" in fig:  # device time per call of each kernel of the call (the two Pallas kernels, XLA glue)
        row.update(kernels_us=fig["kernels_us"], kernel_device_us=fig["device_us"],
                   kernel_span_us=fig["span_seconds"] * 1e6, kernel_device_roofline_fraction=fig["device_roofline"])

    def on_path(path, ctx):  # the layer as the model runs it, router included
        return lambda m, xs: jnp.stack([m(xs[r], path=path, ctx=ctx)[:, :8] for r in range(R)])

    kernel_ctx = parallel.RunContext(kernels=policy(moe_config=config))
    row["layer_kernel_us"] = jit_seconds(on_path("kernel", kernel_ctx), layer.module, xs) / R * 1e6
    scan = parallel.RunContext(kernels=select.KernelPolicy(moe_grouped="scan"))  # the jnp paths
    if FLAGS.moe_jnp and T * layer.cfg.num_experts_per_tok <= select.GATHER_MAX_PAIRS:
        row["layer_jnp_gathered_us"] = jit_seconds(on_path("gathered", scan), layer.module, xs, calls=1,
                                                   repeats=3) / R * 1e6
    if FLAGS.moe_jnp:
        row["layer_jnp_grouped_us"] = jit_seconds(on_path("grouped", scan), layer.module, xs, calls=1,
                                                  repeats=3) / R * 1e6
    return row


NOTES = (
    "kernel_us: mxfp4_moe (its Pallas kernels and glue) per call, median of back-to-back calls inside one jit, "
    "cycling {R} router-drawn routings so consecutive calls read different experts. roofline_us: packed "
    "bytes of the distinct selected experts (blocks + scales + biases) over the copy bandwidth measured here. "
    "kernel_device_us: the same call's summed device kernel time (profiler records); kernel_span_us: first "
    "kernel start to last kernel end per call in that profile (gaps between the kernels included). "
    "layer_*: the MoE layer with its router as the model runs it (MoE.__call__: the kernel path; jnp gathered "
    "per-pair dequantize; jnp expert-grouped tiles through XLA's scan).")


def bench_moe():
    res = dict(timing.device_info())
    bw = res["copy_bandwidth_bytes_per_s"] = copy_bw()
    R = FLAGS.moe_routings

    def partial():  # what is measured so far survives a timeout
        if FLAGS.out:
            with open(FLAGS.out + ".moe_partial", "w") as f:
                json.dump(res, f, indent=1, default=float)

    if FLAGS.moe_e2e:  # first: the full-size model needs the memory the layer below would hold
        res["e2e"] = e2e(bw, chosen_config())
        partial()
    layer = Layer()
    res["expert_bytes"], res["units"] = layer.per_expert, layer.cfg.intermediate_size
    best = chosen_config() or mk.config_for(layer.cfg.intermediate_size)
    if FLAGS.moe_sweep:
        res["sweep"] = []
        for text in FLAGS.moe_sweep:
            res["sweep"].append(_sweep_row(layer, text, bw, R))
            print("sweep", res["sweep"][-1], flush=True)
            partial()
        good = [r for r in res["sweep"] if r.get("ok")]
        if good:
            best = mk.MoeConfig(**min(good, key=lambda r: r["total_s"])["config"])
    res["config"] = dataclasses.asdict(best)
    res["rel_err_T5_vs_reference"] = layer.rel_err(best)
    res["tokens"] = []
    for T in map(int, FLAGS.moe_tokens):
        res["tokens"].append(_token_row(layer, T, best, bw, R))
        print("moe", res["tokens"][-1], flush=True)
        partial()
    res["notes"] = NOTES.format(R=R)
    return res


def _step_bytes(model, P):
    """The bytes a B=1 decode step at context P reads (docs/reference.md 4: weights once, the routed
    experts of every layer, the KV cache's P slots of every layer as an upper bound), by part."""
    cfg = model.config
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    lay = model.layers[0]
    ex = lay.mlp.experts
    per_expert = mk.expert_bytes(ex.gate_up_blocks[...], ex.gate_up_scales[...], ex.gate_up_bias[...],
                                 ex.down_blocks[...], ex.down_scales[...], ex.down_bias[...])
    parts = dict(attention_weights=sum(int(np.prod(getattr(lay.self_attn, nm)[...].shape)) * 2
                                       for nm in ("wqkv", "wo")) * L,
                 experts=cfg.num_experts_per_tok * per_expert * L, routers=H * cfg.num_local_experts * 2 * L,
                 lm_head=V * H * 2, kv_cache=2 * L * cfg.num_key_value_heads * cfg.head_dim * 2 * P)
    return dict(parts, total=sum(parts.values()))


def _decode_step(m, c, ctx):
    """gpt_oss.step on one token and the greedy pick; the lengths stay put, so every iteration sees the
    same context."""
    lg, _, cache = gpt_oss.step(m, c["cache"], c["tok"][:, None], c["len"][:, None], c["len"], ctx=ctx)
    return dict(cache=cache, tok=jnp.argmax(lg[:, 0], axis=-1).astype(jnp.int32), len=c["len"])


def _moe_layers(m, x, ctx):
    """The MoE half of every block: norm, router, experts (the kernel on GPUs), residual."""
    for blk in m.layers:
        x = x + blk.mlp(x, norm=blk.post_attention_layernorm, ctx=ctx)
    return x


def _head(m, x, ctx):
    """Final norm, lm_head, greedy pick, next embedding."""
    tok = jnp.argmax(gpt_oss.logits(m, m.norm(x), ctx), axis=-1)
    return x + m.embed[...][tok] * 1e-3


def e2e(bw, config):
    """Random full-size --moe_preset, B=1, short context: the decode step (the target's step and the
    greedy pick, the body of generate()'s loop) against the bytes it must read, and the parts that take
    the time, the MoE kernels at `config` (None: `moe.config_for`). Every timing runs its work
    --moe_e2e_new times inside one jitted fori_loop, the cache carried in place (`step_timing.loop_time`)."""
    t0 = time.perf_counter()
    model = gpt_oss.random_gpt_oss(GptOssConfig.preset(FLAGS.moe_preset), seed=0)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    out = dict(build_seconds=time.perf_counter() - t0, param_bytes=gpt_oss.param_bytes(model))
    cfg, P, iters = model.config, FLAGS.moe_e2e_prompt, FLAGS.moe_e2e_new
    ctx = parallel.context(kernels=select.KernelPolicy(moe_config=config))
    graphdef, state = nnx.split(model)

    def loop(body, carry):  # (seconds per iteration, device kernel seconds per iteration by family)
        return step_timing.loop_time(graphdef, state, body, carry, iters, profile=True, ctx=ctx)

    key = jax.random.key(0)
    cache = jax.tree.map(lambda a: (jax.random.normal(key, a.shape, jnp.float32) * 0.5).astype(a.dtype),
                         gpt_oss.init_cache(model, 1, P + 8 * iters + 8))
    per_tok, step_kernels = loop(_decode_step, dict(cache=cache, tok=jnp.array([7], jnp.int32),
                                                    len=jnp.array([P], jnp.int32)))
    del cache
    nbytes = _step_bytes(model, P)
    out.update(context=P, iters=iters, seconds_per_token=per_tok, tokens_per_second=1 / per_tok, step_bytes=nbytes,
               roofline_seconds_per_token=nbytes["total"] / bw, roofline_fraction=nbytes["total"] / bw / per_tok)
    x0 = jax.random.normal(jax.random.key(1), (1, 1, cfg.hidden_size), jnp.bfloat16)
    t_moe, moe_kernels = loop(_moe_layers, x0)
    t_head, head_kernels = loop(_head, jnp.copy(x0))  # loop_time takes its carry over
    rest = per_tok - t_moe - t_head
    out["parts_seconds_per_token"] = dict(moe_layers=t_moe, lm_head_and_pick=t_head, rest=rest)
    out["parts_roofline_fraction"] = dict(
        moe_layers=(nbytes["experts"] + nbytes["routers"]) / bw / t_moe,
        lm_head_and_pick=nbytes["lm_head"] / bw / t_head,
        rest=(nbytes["attention_weights"] + nbytes["kv_cache"]) / bw / max(rest, 1e-9))
    out["kernels_by_family"] = dict(step=step_kernels, moe_layers=moe_kernels, lm_head_and_pick=head_kernels)
    out["notes"] = e2e_notes(cfg, P, iters)
    return out


def e2e_notes(cfg, P, iters):
    q = jax.ShapeDtypeStruct((1, 1, cfg.num_attention_heads, cfg.head_dim), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((1, cfg.num_key_value_heads, P + 8 * iters + 8, cfg.head_dim), jnp.bfloat16)
    attn = select.attention(q, cache, None)
    return ("seconds_per_token: one decode step (gpt_oss.step on 1 token + argmax), the body of generate()'s "
            f"while_loop, {iters} steps in one jitted fori_loop over a random-filled KV cache of {P} committed "
            f"tokens. moe_layers: the {cfg.num_hidden_layers} MoE halves (norm, router, experts: Pallas kernel on "
            "GPU, residual) chained; lm_head_and_pick: final norm, lm_head, argmax, embedding; rest = step - both: "
            f"the attention halves (norm, q/k/v/o projections, RoPE, {attn} attention (select.attention at a "
            "full layer's decode shape), KV-cache writes) and the embedding. Roofline bytes: docs/reference.md 4 "
            "(weights read once per token, the routed experts per layer) plus the KV cache. kernels_by_family: "
            "device kernel seconds per iteration of each loop by kernel family (timing.kernel_group; 'launches': "
            "kernels per iteration); wall time minus their sum is launch gaps.")


def _grouped_row(layer, N, bw):
    """moe_grouped's row at N tokens: the grouped path's tiles through the kernels and the scan."""
    cfg = layer.cfg
    H, units, E, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok
    x = jax.random.normal(jax.random.key(N), (N, H), jnp.bfloat16)
    ids, _ = layer.module.route(x)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
    tm = gpt_oss.group_tile(N * k, E, kernel=True)
    row = dict(tokens=N, tile_rows=tm, live_tiles=int(np.sum(-(-counts // tm))),
               distinct_experts=int((counts > 0).sum()))
    row["roofline_s"] = row["distinct_experts"] * layer.per_expert / bw
    flops = N * k * 2 * (2 * units * H + H * units)
    out = {}
    for name in ("kernel", "scan") if FLAGS.grouped_scan else ("kernel",):
        ctx = parallel.RunContext(kernels=policy(moe_grouped=name))
        fn = lambda m, x, ctx=ctx: m(x, path="grouped", dtype=jnp.float32, ctx=ctx)  # noqa: E731
        out[name] = np.asarray(jax.jit(fn)(layer.module, x), np.float64)
        row[f"{name}_seconds"] = jit_seconds(fn, layer.module, x, calls=2, repeats=3)
        prof = row[f"{name}_device"] = safe_profile(fn, [(layer.module, x)])
        t = prof.get("kernel_seconds", row[f"{name}_seconds"])
        row[f"{name}_tflops"] = flops / t / 1e12
        row[f"{name}_roofline_fraction"] = row["roofline_s"] / t
    if "scan" in out:
        row["rel_err_kernel_vs_scan"] = float(np.linalg.norm(out["kernel"] - out["scan"]) / np.linalg.norm(out["scan"]))
    return row


@guard
def bench_moe_grouped():
    """One MoE layer of --moe_preset on --grouped_tokens tokens through the grouped path (see above)."""
    layer, bw = Layer(), copy_bw()
    res = dict(copy_bandwidth_bytes_per_s=bw, expert_bytes=layer.per_expert, units=layer.cfg.intermediate_size,
               config=dataclasses.asdict(mk.GroupedConfig()), rows=[], table=[])
    for N in map(int, FLAGS.grouped_tokens):
        row = _grouped_row(layer, N, bw)
        res["rows"].append(row)
        dev = {n: row[f"{n}_device"].get("kernel_seconds", row[f"{n}_seconds"]) * 1e3
               for n in ("kernel", "scan") if f"{n}_seconds" in row}
        res["table"].append(f"moe_grouped N={N} tm={row['tile_rows']} tiles={row['live_tiles']}: kernels "
                            f"{dev['kernel']:.3f} ms ({row['kernel_tflops']:.0f} TFLOP/s, "
                            f"{row['kernel_roofline_fraction']:.2f} of the bytes roofline)"
                            + (f", scan {dev['scan']:.3f} ms, rel err {row['rel_err_kernel_vs_scan']:.1e}"
                               if "scan" in dev else ""))
    return res


def print_moe(result):
    """The moe section's table (and its sweep and e2e lines), where it ran."""
    r = result.get("moe")
    if not r or "tokens" not in r:
        return
    nan = float("nan")
    print(f"\n{r['device']} jax {r['jax_version']} copy {r['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s "
          f"config {r['config']} relerr {r['rel_err_T5_vs_reference']:.1e}")
    for s in r.get("sweep", []):
        print("  sweep", s.get("config"), {k: round(float(v), 3) if isinstance(v, (float, np.floating)) else v
                                          for k, v in s.items() if k != "config"})
    print(f"{'T':>3} {'experts':>7} {'roof us':>8} {'kern us':>8} {'frac':>5} {'dev us':>8} {'frac':>5} {'layer':>8} "
          f"{'gather':>8} {'group':>8}")
    for row in r["tokens"]:
        print(f"{row['tokens']:>3} {row['distinct_experts']:>7.1f} {row['roofline_us']:>8.1f} {row['kernel_us']:>8.1f} "
              f"{row['kernel_roofline_fraction']:>5.2f} {row.get('kernel_device_us', nan):>8.1f} "
              f"{row.get('kernel_device_roofline_fraction', nan):>5.2f} {row['layer_kernel_us']:>8.1f} "
              f"{row.get('layer_jnp_gathered_us', nan):>8.1f} {row.get('layer_jnp_grouped_us', nan):>8.1f}")
    if "e2e" in r:
        e = r["e2e"]
        print(f"e2e: {e['seconds_per_token'] * 1e3:.3f} ms/token, roofline {e['roofline_seconds_per_token'] * 1e3:.3f} "
              f"ms ({e['roofline_fraction']:.2f}); parts ms "
              + str({k: round(v * 1e3, 3) for k, v in e["parts_seconds_per_token"].items()}))


SECTIONS = {"moe": bench_moe, "moe_grouped": bench_moe_grouped}
kernel_bench.define_flags(SECTIONS)

if __name__ == "__main__":
    cli.run(kernel_bench.main(SECTIONS, after=print_moe))
