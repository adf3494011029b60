"""Kernel benchmarks: each section times one Pallas kernel against the bytes it must move.

  python experiments/bench_kernels.py --only moe --out experiments/results/moe_h200.json

One function per section returns a dict; the JSON holds {"device": ..., "<section>": {...}}.
Every roofline fraction divides by the copy bandwidth measured in the same process.
"""

import json
import os
import time

import numpy as np
from absl import flags

import jax
import jax.numpy as jnp

from lib import cli, step_timing, timing

flags.DEFINE_list("only", None, "sections to run (default: all)")
flags.DEFINE_string("out", None, "JSON output path")
flags.DEFINE_integer("copy_bytes", None, "bytes of the copy-bandwidth measurement of the sections but moe (default: "
                     "4 GiB on GPUs, 256 MiB elsewhere)", lower_bound=1 << 10)
FLAGS = flags.FLAGS


# -- moe: MXFP4 expert matmul for decode / verify (eagle3_jax/pallas/moe.py) ------------------------

flags.DEFINE_list("moe_tokens", ["1", "4", "8", "16", "32", "64"], "token counts T (top-4 routing)")
flags.DEFINE_list("moe_sweep", [], "MoeConfig variants to time at --moe_sweep_tokens before the main table, "
                  "each 'key=value/key=value' (e.g. decode=ptx/block_i=64); the fastest correct one is used")
flags.DEFINE_list("moe_sweep_tokens", ["1", "16"], "token counts of the sweep (the sum of device kernel times ranks "
                  "variants; wall times where the profiler gives none)")
cli.positive_ints("moe_tokens", "moe_sweep_tokens")
flags.DEFINE_integer("moe_routings", 4, "distinct random routings cycled inside one timed call (defeats L2 reuse; "
                     "each is its own kernel instance, compiled separately)", lower_bound=1)
flags.DEFINE_bool("moe_e2e", False, "also build the random full-size gpt-oss-120b and time B=1 decode and its parts")
flags.DEFINE_integer("moe_e2e_prompt", 128, "committed context (tokens) of the end-to-end decode step", lower_bound=1)
flags.DEFINE_integer("moe_e2e_new", 16, "decode steps per timed loop", lower_bound=1)
flags.DEFINE_bool("moe_jnp", True, "also time the MoE layer's jnp paths (slow to compile)")
flags.DEFINE_string("moe_preset", "gpt-oss-120b", "GptOssConfig preset of the benchmarked layer (tiny: CPU smoke run)")
flags.DEFINE_integer("moe_units", None, "moe, moe_grouped: intermediate units of each expert (default: the preset's); "
                     "one device's share under the units split, e.g. 736 for gpt-oss-120b over 4 devices "
                     "(parallel.expert_units / 4)", lower_bound=1)

# --moe_preset names a preset and --moe_units fits its experts: GptOssConfig's own checks
cli.check_with(["moe_preset", "moe_units"], lambda v: _moe_layer_config(v["moe_preset"], v["moe_units"]))
flags.DEFINE_integer("moe_copy_bytes", 4 << 30, "bytes of the copy-bandwidth measurement", lower_bound=1 << 10)
flags.DEFINE_string("moe_config", "", "MoeConfig the model and the main table use ('key=value/...'; default: "
                    "moe.config_for(units)), e.g. fma_warps=1")


def _parse_moe_config(text):
    """'key=value/key=value' -> MoeConfig (decode's value a name, the others integers); ValueError
    naming the text and the fields where it is not that."""
    import dataclasses

    from eagle3_jax.pallas import moe as mk

    fields = [f.name for f in dataclasses.fields(mk.MoeConfig)]
    kw = {}
    for part in filter(None, text.split("/")):
        key, eq, val = part.partition("=")
        if not eq or key not in fields or not (key == "decode" or val.lstrip("-").isdigit()):
            raise ValueError(f"MoeConfig {text!r}: expected key=value parts joined by '/', keys of {fields} "
                             f"(decode a name, the others integers); got {part!r}")
        kw[key] = val if key == "decode" else int(val)
    return mk.MoeConfig(**kw)


cli.check_with("moe_sweep", lambda texts: [_parse_moe_config(t) for t in texts])
cli.check_with("moe_config", lambda text: text and _parse_moe_config(text))


def _loop_time(fn, *args, calls=3, repeats=5):
    return timing.time_fn(jax.jit(fn), *args, calls=calls, repeats=repeats)


def bench_moe():
    import dataclasses

    from flax import nnx

    from eagle3_jax.models import gpt_oss
    from eagle3_jax.pallas import moe as mk
    from eagle3_jax.pallas import moe_route, select

    res = dict(timing.device_info())
    if FLAGS.moe_config:  # the model's MoE layers call mxfp4_moe with the module's default
        mk.DEFAULT_CONFIG, mk.SHARE_CONFIGS = _parse_moe_config(FLAGS.moe_config), ()
    bw = timing.copy_bandwidth(FLAGS.moe_copy_bytes, "--moe_copy_bytes")
    res["copy_bandwidth_bytes_per_s"] = bw
    interp = jax.default_backend() != "gpu"  # CPU smoke run: the kernels interpreted

    def partial():  # what is measured so far survives a timeout
        if FLAGS.out:
            with open(FLAGS.out + ".moe_partial", "w") as f:
                json.dump(res, f, indent=1, default=float)

    if FLAGS.moe_e2e:  # first: the full-size model needs the memory the layer below would hold
        res["e2e"] = _bench_moe_e2e(bw)
        partial()
    cfg = _moe_layer_config(FLAGS.moe_preset, FLAGS.moe_units)
    H, k = cfg.hidden_size, cfg.num_experts_per_tok
    layer = gpt_oss.MoE(cfg, jnp.bfloat16, nnx.Rngs(0))  # one layer, random packed experts (scale bytes 119..121)
    ex = layer.experts
    packed = (ex.gate_up_blocks[...], ex.gate_up_scales[...], ex.gate_up_bias[...],
              ex.down_blocks[...], ex.down_scales[...], ex.down_bias[...])
    per_expert = mk.expert_bytes(*packed)
    res["expert_bytes"], res["units"] = per_expert, cfg.intermediate_size
    lim, alpha = float(layer.limit), float(layer.alpha)
    R = FLAGS.moe_routings
    route = jax.jit(lambda m, x: m.route(x))

    def inputs(T, seed):
        """R routings of T tokens through the layer's random router (realistic top-4 sets)."""
        xs = jax.random.normal(jax.random.key(seed), (R, T, H), jnp.bfloat16)
        ids, ws = zip(*[route(layer, xs[r]) for r in range(R)])
        return xs, jnp.stack(ids), jnp.stack(ws)

    def kernel_loop(config):
        def f(xs, ids, ws, *p):
            outs = [mk.mxfp4_moe(xs[r], ids[r], ws[r], *p, limit=lim, alpha=alpha, config=config, interpret=interp)
                    for r in range(R)]
            return jnp.stack([o[:, :8] for o in outs])
        return f

    def roofline(T, ids):
        distinct = float(np.mean([len(np.unique(np.asarray(ids[r]))) for r in range(R)]))
        nbytes = distinct * per_expert + T * H * (2 + 4)  # experts + x in + f32 out
        return distinct, nbytes, nbytes / bw

    def check(config, T=5, seed=123):
        xs, ids, ws = inputs(T, seed)
        out = mk.mxfp4_moe(xs[0], ids[0], ws[0], *packed, limit=lim, alpha=alpha, config=config, interpret=interp)
        ref = mk.mxfp4_moe_reference(xs[0], ids[0], ws[0], *packed, limit=lim, alpha=alpha)
        out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
        return float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.isfinite(out).all() else float("nan")

    # -- variant sweep -----------------------------------------------------------------------------
    best = mk.config_for(cfg.intermediate_size)
    if FLAGS.moe_sweep:
        sweep = []
        for text in FLAGS.moe_sweep:
            c = _parse_moe_config(text)
            row = dict(config=dataclasses.asdict(c))
            try:
                tot = 0.0
                for T in map(int, FLAGS.moe_sweep_tokens):
                    row[f"rel_err_T{T}"] = check(c, T)
                    xs, ids, ws = inputs(T, T)
                    t = _loop_time(kernel_loop(c), xs, ids, ws, *packed) / R
                    row[f"us_T{T}"] = t * 1e6
                    row[f"roofline_T{T}"] = roofline(T, ids)[2] / t
                    prof = _safe_profile(lambda x, i, w, *p, c=c: mk.mxfp4_moe(x, i, w, *p, limit=lim, alpha=alpha,
                                                                              config=c, interpret=interp),
                                         [(xs[r], ids[r], ws[r], *packed) for r in range(R)])
                    if "kernels" in prof:  # device time: what the GPU spends, free of the host's share
                        t = prof["kernel_seconds"]
                        row[f"device_us_T{T}"] = t * 1e6
                        row[f"device_roofline_T{T}"] = roofline(T, ids)[2] / t
                        row[f"kernels_us_T{T}"] = {n: v * 1e6 for n, v in prof["kernels"].items()}
                    tot += t
                row["ok"] = all(row[f"rel_err_T{T}"] < 1e-2 for T in map(int, FLAGS.moe_sweep_tokens))
                row["total_s"] = tot
            except Exception as e:  # a variant that does not compile or run is reported, not fatal
                row["ok"], row["error"] = False, f"{type(e).__name__}: {str(e)[:400]}"
            print("sweep", row, flush=True)
            sweep.append(row)
            res["sweep"] = sweep
            partial()
        res["sweep"] = sweep
        good = [r for r in sweep if r.get("ok")]
        if good:
            best = mk.MoeConfig(**min(good, key=lambda r: r["total_s"])["config"])
    res["config"] = dataclasses.asdict(best)
    res["rel_err_T5_vs_reference"] = check(best)

    # -- main table ------------------------------------------------------------------------------
    rows = []
    for T in map(int, FLAGS.moe_tokens):
        xs, ids, ws = inputs(T, 1000 + T)
        distinct, nbytes, t_roof = roofline(T, ids)
        row = dict(tokens=T, distinct_experts=distinct, bytes=nbytes, roofline_us=t_roof * 1e6)
        t = _loop_time(kernel_loop(best), xs, ids, ws, *packed) / R
        row.update(kernel_us=t * 1e6, kernel_roofline_fraction=t_roof / t)
        prof = _safe_profile(lambda x, i, w, *p: mk.mxfp4_moe(x, i, w, *p, limit=lim, alpha=alpha, config=best,
                                                              interpret=interp),
                             [(xs[r], ids[r], ws[r], *packed) for r in range(R)])
        if "kernels" in prof:  # device time per call of each kernel of the call (the two Pallas kernels, XLA glue)
            row["kernels_us"] = {n: v * 1e6 for n, v in prof["kernels"].items()}
            # device time of the call's kernels: the wall figure above also holds what is spent between
            # the timed calls (1.75x the kernels' time at T=1 with JAX 0.11.2 on an H200, not understood)
            row.update(kernel_device_us=prof["kernel_seconds"] * 1e6, kernel_span_us=prof["span_seconds"] * 1e6,
                       kernel_device_roofline_fraction=t_roof / prof["kernel_seconds"])

        # the layer as the model runs it (router included): default path, and the jnp paths
        def layer_loop(path):
            def f(m, xs):
                return jnp.stack([m(xs[r], path=path)[:, :8] for r in range(R)])
            return f

        def kernel_with_router(m, xs):  # the model's kernel path: pallas/moe_route.py, then the experts
            outs = []
            for r in range(R):
                x, xq, i, w = moe_route.route(xs[r], None, m.router_w[...], m.router_b[...], eps=0.0, k=k,
                                              interpret=interp)
                outs.append(mk.mxfp4_moe(x, i, w, *packed, limit=lim, alpha=alpha, config=best, interpret=interp,
                                         xq=xq)[:, :8])
            return jnp.stack(outs)

        row["layer_kernel_us"] = _loop_time(kernel_with_router, layer, xs) / R * 1e6
        if FLAGS.moe_jnp and T * k <= select.GATHER_MAX_PAIRS:
            row["layer_jnp_gathered_us"] = _loop_time(layer_loop("gathered"), layer, xs, calls=1, repeats=3) / R * 1e6
        if FLAGS.moe_jnp:
            row["layer_jnp_grouped_us"] = _loop_time(layer_loop("grouped"), layer, xs, calls=1, repeats=3) / R * 1e6
        print("moe", row, flush=True)
        rows.append(row)
        res["tokens"] = rows
        partial()
    res["tokens"] = rows
    res["notes"] = (
        "kernel_us: mxfp4_moe (its Pallas kernels and glue) per call, median of back-to-back calls inside one jit, "
        f"cycling {R} router-drawn routings so consecutive calls read different experts. roofline_us: packed "
        "bytes of the distinct selected experts (blocks + scales + biases) over the copy bandwidth measured here. "
        "kernel_device_us: the same call's summed device kernel time (profiler records); kernel_span_us: first "
        "kernel start to last kernel end per call in that profile (gaps between the kernels included). "
        "layer_*: the MoE layer with its router (kernel; jnp gathered per-pair dequantize; jnp expert-grouped tiles).")
    del layer, ex, packed
    return res


def _moe_layer_config(preset: str, units: int | None):
    """The layer the moe sections time (--moe_preset, --moe_units): the preset with `units`
    intermediate units where given; ValueError where the config cannot hold them."""
    from eagle3_jax.models import GptOssConfig

    cfg = GptOssConfig.preset(preset)
    return cfg if units is None else cfg.replace(intermediate_size=units)


def _bench_moe_e2e(bw):
    """Random full-size gpt-oss-120b, B=1, short context: the decode step (target step + greedy pick,
    the body of generate()'s while_loop) against the bytes it must read, and the parts that take the
    time. Every timing runs its work `iters` times inside one jitted fori_loop, the cache carried in place."""
    import inspect

    from flax import nnx

    from eagle3_jax.models import GptOssConfig, gpt_oss
    from eagle3_jax.pallas import attention as attn_mod
    from eagle3_jax.pallas import moe as mk

    cfg = GptOssConfig.preset(FLAGS.moe_preset)
    t0 = time.perf_counter()
    model = gpt_oss.random_gpt_oss(cfg, seed=0)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
    out = dict(build_seconds=time.perf_counter() - t0, param_bytes=gpt_oss.param_bytes(model))
    P, iters = FLAGS.moe_e2e_prompt, FLAGS.moe_e2e_new
    graphdef, state = nnx.split(model)

    def loop(body, carry):  # (seconds per iteration, device kernel seconds per iteration by family)
        return step_timing.loop_time(graphdef, state, body, carry, iters, profile=True)

    key = jax.random.key(0)
    cache = jax.tree.map(lambda a: (jax.random.normal(key, a.shape, jnp.float32) * 0.5).astype(a.dtype),
                         gpt_oss.init_cache(model, 1, P + 8 * iters + 8))

    def decode_step(m, c):  # lengths stay put so every iteration sees the same context
        lg, _, cache = gpt_oss.step(m, c["cache"], c["tok"][:, None], c["len"][:, None], c["len"])
        return dict(cache=cache, tok=jnp.argmax(lg[:, 0], axis=-1).astype(jnp.int32), len=c["len"])

    per_tok, step_kernels = loop(decode_step, dict(cache=cache, tok=jnp.array([7], jnp.int32),
                                                   len=jnp.array([P], jnp.int32)))
    del cache
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    lay = model.layers[0]
    attn_bytes = sum(int(np.prod(getattr(lay.self_attn, nm)[...].shape)) * 2 for nm in ("wqkv", "wo")) * L
    ex = lay.mlp.experts
    per_expert = mk.expert_bytes(ex.gate_up_blocks[...], ex.gate_up_scales[...], ex.gate_up_bias[...],
                                 ex.down_blocks[...], ex.down_scales[...], ex.down_bias[...])
    expert_bytes = cfg.num_experts_per_tok * per_expert * L
    router_bytes = H * cfg.num_local_experts * 2 * L
    head_bytes = V * H * 2
    kv_bytes = 2 * L * cfg.num_key_value_heads * cfg.head_dim * 2 * P  # upper bound: every layer reads P slots
    total = attn_bytes + expert_bytes + router_bytes + head_bytes + kv_bytes
    out.update(context=P, iters=iters, seconds_per_token=per_tok,
               tokens_per_second=1 / per_tok,
               step_bytes=dict(attention_weights=attn_bytes, experts=expert_bytes, routers=router_bytes,
                               lm_head=head_bytes, kv_cache=kv_bytes, total=total),
               roofline_seconds_per_token=total / bw, roofline_fraction=total / bw / per_tok)

    x0 = jax.random.normal(jax.random.key(1), (1, 1, H), jnp.bfloat16)

    def moe_all(m, x):  # the MoE half of every block: norm, router, experts (kernel on GPU), residual
        for blk in m.layers:
            x = x + blk.mlp(x, norm=blk.post_attention_layernorm)
        return x

    def head(m, x):  # final norm, lm_head, greedy pick, next embedding
        tok = jnp.argmax(gpt_oss.logits(m, m.norm(x)), axis=-1)
        return x + m.embed[...][tok] * 1e-3

    t_moe, moe_kernels = loop(moe_all, x0)
    t_head, head_kernels = loop(head, jnp.copy(x0))  # loop_time takes its carry over
    rest = per_tok - t_moe - t_head
    uses_attn_kernel = "attention_pallas" in inspect.getsource(attn_mod.attention)
    out["parts_seconds_per_token"] = dict(moe_layers=t_moe, lm_head_and_pick=t_head, rest=rest)
    out["parts_roofline_fraction"] = dict(
        moe_layers=(expert_bytes + router_bytes) / bw / t_moe, lm_head_and_pick=head_bytes / bw / t_head,
        rest=(attn_bytes + kv_bytes) / bw / max(rest, 1e-9))
    out["kernels_by_family"] = dict(step=step_kernels, moe_layers=moe_kernels, lm_head_and_pick=head_kernels)
    out["notes"] = (
        "seconds_per_token: one decode step (gpt_oss.step on 1 token + argmax), the body of generate()'s "
        f"while_loop, {iters} steps in one jitted fori_loop over a random-filled KV cache of {P} committed tokens. "
        "moe_layers: the 36 MoE halves (norm, router, experts: Pallas kernel on GPU, residual) chained; "
        "lm_head_and_pick: final norm, lm_head, argmax, embedding; rest = step - both: the 36 attention halves "
        f"(norm, q/k/v/o projections, RoPE, {'Pallas' if uses_attn_kernel else 'jnp reference'} attention "
        "(pallas/attention.py dispatch on GPU at the time of the run), KV-cache writes) and the embedding. "
        "Roofline bytes: docs/reference.md 4 (weights read once per token, 4 experts per layer) plus the KV cache. "
        "kernels_by_family: device kernel seconds per iteration of each loop by kernel family "
        "(timing.kernel_group; 'launches': kernels per iteration); wall time minus their sum is launch gaps.")
    del model, state
    return out


# -- attention / tree_mask / accept / kv_rewind (eagle3_jax/pallas/{attention,tree_mask,accept,kv_rewind}.py) --
# Each returns a dict with a "table" (printed at the end). Roofline fractions divide the bytes a kernel
# must move by the copy bandwidth measured in this process (_copy_bw, measured once).

flags.DEFINE_bool("attn_torch", True, "attention: torch flex_attention / SDPA side by side (GPU only)")
flags.DEFINE_bool("attn_sweep", True, "attention: sweep launch configs at the 32K, Nq in {1, 16} shapes")
flags.DEFINE_bool("kernels_quick", False, "attention/tree/accept/rewind: small shapes (CPU smoke runs)")

# -- moe_grouped: the prefill MoE through the grouped MXFP4 kernels (pallas/moe.py mxfp4_moe_grouped) --

flags.DEFINE_list("grouped_tokens", ["256", "2048", "4096"], "moe_grouped: tokens per call (prefill chunks)")
cli.positive_ints("grouped_tokens")
flags.DEFINE_bool("grouped_scan", True, "moe_grouped: also time the grouped path's XLA scan (each tile's expert "
                  "dequantized in turn)")


def bench_moe_grouped():
    """One MoE layer of --moe_preset (random packed experts, its random router) on N tokens through
    gpt_oss.MoE._grouped: the Pallas grouped kernels, and the XLA scan over the same tiles. Bytes
    roofline: the distinct selected experts' packed bytes over the copy bandwidth; FLOP/s: of the
    pairs' useful work (padding rows of the tiles excluded)."""
    import dataclasses

    from flax import nnx

    from eagle3_jax.models import gpt_oss
    from eagle3_jax.pallas import moe as mk

    cfg = _moe_layer_config(FLAGS.moe_preset, FLAGS.moe_units)
    H, I, E, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok
    layer = gpt_oss.MoE(cfg, jnp.bfloat16, nnx.Rngs(0))
    gdef, state = nnx.split(layer)
    ex = layer.experts
    per_expert = mk.expert_bytes(ex.gate_up_blocks[...], ex.gate_up_scales[...], ex.gate_up_bias[...],
                                 ex.down_blocks[...], ex.down_scales[...], ex.down_bias[...])
    interp = jax.default_backend() != "gpu"  # CPU smoke run: the kernels interpreted
    bw = _copy_bw()
    res = dict(copy_bandwidth_bytes_per_s=bw, expert_bytes=per_expert, units=I,
               config=dataclasses.asdict(mk.GroupedConfig()),
               rows=[], table=[])
    route = jax.jit(lambda st, x: nnx.merge(gdef, st).route(x))

    def grouped(kernel):
        return lambda st, x, i, w: nnx.merge(gdef, st)._grouped(x, i, w, kernel=kernel, interpret=interp and kernel)

    for N in map(int, FLAGS.grouped_tokens):
        x = jax.random.normal(jax.random.key(N), (N, H), jnp.bfloat16)
        ids, w = route(state, x)
        counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
        tm = gpt_oss.group_tile(N * k, E, kernel=True)
        row = dict(tokens=N, tile_rows=tm, live_tiles=int(np.sum(-(-counts // tm))),
                   distinct_experts=int((counts > 0).sum()))
        row["roofline_s"] = row["distinct_experts"] * per_expert / bw
        flops = N * k * 2 * (2 * I * H + H * I)
        sets = [(state, x, ids, w)]
        out = {}
        for name, kernel in (("kernel", True), ("scan", False)) if FLAGS.grouped_scan else (("kernel", True),):
            fn = grouped(kernel)
            out[name] = np.asarray(jax.jit(fn)(*sets[0]), np.float64)
            row[f"{name}_seconds"] = _loop_time(fn, *sets[0], calls=2, repeats=3)
            prof = _safe_profile(fn, sets)
            row[f"{name}_device"] = prof
            t = prof.get("kernel_seconds", row[f"{name}_seconds"])
            row[f"{name}_tflops"] = flops / t / 1e12
            row[f"{name}_roofline_fraction"] = row["roofline_s"] / t
        if "scan" in out:
            row["rel_err_kernel_vs_scan"] = float(np.linalg.norm(out["kernel"] - out["scan"]) / np.linalg.norm(out["scan"]))
        res["rows"].append(row)
        dev = {n: row[f"{n}_device"].get("kernel_seconds", row[f"{n}_seconds"]) * 1e3 for n in out}
        res["table"].append(f"moe_grouped N={N} tm={tm} tiles={row['live_tiles']}: kernels {dev['kernel']:.3f} ms "
                            f"({row['kernel_tflops']:.0f} TFLOP/s, {row['kernel_roofline_fraction']:.2f} of the bytes "
                            f"roofline)" + (f", scan {dev['scan']:.3f} ms, rel err {row['rel_err_kernel_vs_scan']:.1e}"
                                            if "scan" in dev else ""))
    return res


# -- gemv: few-row matmul of a device's projection share (eagle3_jax/pallas/gemv.py) ---------------

flags.DEFINE_list("gemv_shapes", ["1024x2880", "2880x1280", "2048x2880", "2880x2560"], "gemv: products KxN, "
                  "x [R, K] @ w.T with w [N, K] (gpt-oss-120b's o and q|k|v shares at 4 and at 2 devices)")
flags.DEFINE_list("gemv_rows", ["1", "4"], "gemv: rows of x")
flags.DEFINE_list("gemv_blocks", ["4/1024", "8/512", "4/2048"], "gemv: rows_matmul launches, each "
                  "block_n/block_k (powers of two)")
flags.DEFINE_integer("gemv_weights", 36, "gemv: distinct (x, w) a timed call multiplies (past L2)", lower_bound=1)
cli.positive_ints("gemv_rows")


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


def bench_gemv():
    """x [R, K] @ w.T, w [N, K] (bf16, f32 out) for each of --gemv_shapes and --gemv_rows: the model's XLA
    path (`layers.rows_dot`: one row padded to two where the model pads it) against `gemv.rows_matmul`
    for each of --gemv_blocks, a call multiplying --gemv_weights distinct (x, w). Seconds a matmul:
    device kernel time from the profiler on GPUs (the program's copies and pads included), wall time
    elsewhere (the kernel interpreted); bytes_fraction: w's bytes at the copy bandwidth over it;
    max_diff: the largest difference from the XLA path's output."""
    from eagle3_jax.models import layers
    from eagle3_jax.pallas import gemv

    interp = jax.default_backend() != "gpu"
    bw = _copy_bw()
    res = {"copy_bandwidth_bytes_per_s": bw, "weights": FLAGS.gemv_weights, "rows": [], "table": []}
    L = FLAGS.gemv_weights
    for K, N in map(_gemv_shape, FLAGS.gemv_shapes):
        key = jax.random.key(K * 7919 + N)
        ws = [jax.random.normal(jax.random.fold_in(key, i), (N, K), jnp.bfloat16) * K ** -0.5 for i in range(L)]
        for R in map(int, FLAGS.gemv_rows):
            xs = [jax.random.normal(jax.random.fold_in(key, L + i), (R, K), jnp.bfloat16) for i in range(L)]
            impls = [("xla", None, lambda x, w: layers.rows_dot(x, w, out_first=True,
                                                                preferred_element_type=jnp.float32))]
            for bn, bk in map(_gemv_blocks, FLAGS.gemv_blocks):
                impls.append(("rows_matmul", (bn, bk), lambda x, w, bn=bn, bk=bk: gemv.rows_matmul(
                    x, w, out_dtype=jnp.float32, block_n=bn, block_k=bk, interpret=interp)))
            want, sets = None, list(zip(xs, ws))
            for name, blocks, fn in impls:
                out = np.asarray(jax.jit(fn)(*sets[0]), np.float64)
                want = out if want is None else want
                prof = _safe_profile(fn, sets)
                t = prof.get("kernel_seconds") or timing.time_calls(fn, sets, repeats=3)
                row = {"K": K, "N": N, "rows": R, "impl": name, "block_n": blocks and blocks[0],
                       "block_k": blocks and blocks[1], "seconds": t, "bytes_fraction": K * N * 2 / bw / t,
                       "max_diff": float(np.abs(out - want).max()), "kernels": prof.get("kernels")}
                res["rows"].append(row)
                res["table"].append(f"gemv [{R}, {K}] @ [{N}, {K}].T {name:11} {'/'.join(map(str, blocks or ())):8} "
                                    f"{t * 1e6:8.2f} us "
                                    f"({row['bytes_fraction']:.0%} of w's bytes)  max diff {row['max_diff']:.2g}")
    return res


_BW = {}


def _copy_bw():
    if "bw" not in _BW:
        size = FLAGS.copy_bytes or (4 << 30 if jax.default_backend() == "gpu" else 1 << 28)
        _BW["bw"] = timing.copy_bandwidth(size, "--copy_bytes")
    return _BW["bw"]


def _guard(fn):
    """Run a section; a failure is recorded in its dict instead of killing the other sections."""
    import functools
    import traceback

    @functools.wraps(fn)
    def run():
        try:
            return fn()
        except Exception:  # noqa: BLE001
            err = traceback.format_exc()[-3000:]
            print(err, flush=True)
            return dict(error=err, table=[f"{fn.__name__}: FAILED {err.strip().splitlines()[-1][:200]}"])
    return run


def _profile_program(run, calls):
    """Device kernel time per call of one profiled `run()` holding `calls` calls (CUPTI records)."""
    try:
        recs = timing.kernel_records(run, repeats=1)
        names = {}
        for name, _, _ in recs:
            names[name] = names.get(name, 0) + 1
        return dict(kernel_seconds=sum(r[2] for r in recs) * 1e-9 / calls, kernels=names)
    except Exception as e:  # noqa: BLE001
        return dict(profile_error=repr(e)[:300])


def _safe_profile(fn, sets):
    try:
        return timing.profile_calls(fn, sets)
    except Exception as e:  # noqa: BLE001
        return dict(profile_error=repr(e)[:300])


def _attn_inputs(key, B, Nq, L, *, Hq=64, Hkv=8, D=64, n_caches=1):
    from eagle3_jax.pallas.tree_mask import tree_mask_reference
    S = L + max(Nq, 64)
    ks = jax.random.split(key, 8)
    bf = jnp.bfloat16
    caches = [(jax.random.normal(jax.random.fold_in(ks[0], i), (B, Hkv, S, D), bf),
               jax.random.normal(jax.random.fold_in(ks[1], i), (B, Hkv, S, D), bf)) for i in range(n_caches)]
    k = jax.random.normal(ks[2], (B, Nq, Hkv, D), bf)
    v = jax.random.normal(ks[3], (B, Nq, Hkv, D), bf)
    lengths = jnp.full((B,), L, jnp.int32)
    rng = np.random.default_rng(0)
    par = np.full((B, Nq), -1, np.int32)
    for i in range(1, Nq):  # a bushy tree: parents among the previous 4 nodes
        par[:, i] = rng.integers(max(0, i - 4), i, B)
    bits, _, positions, _, _ = tree_mask_reference(jnp.asarray(par), lengths)
    sinks = jax.random.normal(ks[4], (Hq,), jnp.float32)
    return caches, k, v, lengths, positions, bits, sinks, par


def _torch_attention(B, Nq, L, par, Hq=64, Hkv=8, D=64, n_sets=4, flex=True):
    """{sdpa_s, flex_s}: the same tree attention in torch over [B, Hkv, L + Nq, D] caches (torch has no
    sinks, so torch does slightly less work). Timed with CUDA events over 20 calls rotating n_sets inputs."""
    import torch
    import torch.nn.functional as F
    dev = "cuda"
    S = L + Nq
    res = {}
    anc = np.zeros((B, Nq, Nq), bool)
    for b in range(B):
        for i in range(Nq):
            j = i
            while j >= 0:
                anc[b, i, j] = True
                j = par[b, j] if j > 0 else -1
    anc_t = torch.tensor(anc, device=dev)
    sets = [(torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16),
             torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)) for _ in range(n_sets)]
    qs = [torch.randn(B, Hq, Nq, D, device=dev, dtype=torch.bfloat16) for _ in range(n_sets)]
    full = torch.ones(B, 1, Nq, S, dtype=torch.bool, device=dev)
    full[:, 0, :, L:] = anc_t
    scale = D ** -0.5

    def bench(f, reps=20):
        for i in range(3):
            f(i % n_sets)
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            t0.record()
            for i in range(reps):
                f(i % n_sets)
            t1.record()
            torch.cuda.synchronize()
            times.append(t0.elapsed_time(t1) / 1e3 / reps)
        return float(np.median(times))

    try:
        res["sdpa_s"] = bench(lambda i: F.scaled_dot_product_attention(
            qs[i], sets[i][0], sets[i][1], attn_mask=full, scale=scale, enable_gqa=True))
    except Exception as e:  # noqa: BLE001
        res["sdpa_error"] = repr(e)[:300]
    if not flex:
        res["flex_error"] = "not run (flex_attention did not compile at Nq=64 in the issue's measurement)"
    try:
        if not flex:
            raise RuntimeError("skipped")
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)

        def mask_mod(b, h, qi, kv):
            return (kv < L) | anc_t[b, qi, (kv - L).clamp(min=0, max=Nq - 1)]

        bm = create_block_mask(mask_mod, B, None, Nq, S, device=dev)
        res["flex_s"] = bench(lambda i: flex(qs[i], sets[i][0], sets[i][1], block_mask=bm, scale=scale,
                                             enable_gqa=True))
    except Exception as e:  # noqa: BLE001
        if flex:
            res["flex_error"] = repr(e)[:300]
    del sets, qs
    torch.cuda.empty_cache()
    return res


@_guard
def bench_attention():
    import math

    from eagle3_jax.pallas import attention_mosaic as mosaic
    from eagle3_jax.pallas.attention import attention_config, attention_pallas, attention_reference
    bw = _copy_bw()
    gpu = jax.default_backend() == "gpu"
    quick = FLAGS.kernels_quick or not gpu
    Hq, Hkv, D = 64, 8, 64
    prefixes = [512] if quick else [32768, 131072]
    batches = [1] if quick else [1, 4]
    nqs = [1, 16] if quick else [1, 4, 8, 16, 64]
    rows = []
    table = [f"attention on {jax.devices()[0].device_kind}: us; roof% = K/V bytes / copy bandwidth "
             f"({bw / 1e12:.2f} TB/s) / time",
             "pallas = device kernel time per call (profiler, split-K merge included); stream = wall time per "
             "call of 16 calls in one program (launch gaps included); sdpa/flex: CUDA events, 20 calls; mosaic: "
             "attention_mosaic.py (full layers), device kernel time, its roof% and relerr",
             f"{'L':>7} {'B':>2} {'Nq':>3} {'win':>4} {'pallas':>8} {'roof%':>6} {'stream':>8} {'sdpa':>8} "
             f"{'flex':>8} {'relerr':>8} {'mosaic':>8} {'roof%':>6} {'relerr':>8}  config"]
    key = jax.random.key(0)

    def run_one(B, Nq, L, window, configs=(None,), torch_side=False):
        kv_bytes_one = 2 * B * Hkv * L * D * 2
        n_caches = max(2, min(8, math.ceil(3 * 64e6 / kv_bytes_one)))
        caches, k, v, lengths, positions, bits, sinks, par = _attn_inputs(key, B, Nq, L, n_caches=n_caches)
        qs = [jax.random.normal(jax.random.key(100 + i), (B, Nq, Hq, D), jnp.bfloat16) for i in range(16)]
        keys_read = L if window is None else min(L, window - 1)
        kv_bytes = 2 * B * Hkv * keys_read * D * 2
        best = None
        for cfg in configs:
            ov = dict(cfg or {})

            def f(q, kc, vc, ov=ov):
                return attention_pallas(q, k, v, kc, vc, lengths, positions, bits, sinks, window=window,
                                        scale=D ** -0.5, interpret=not gpu, **ov)
            try:
                sets = [(qs[i], *caches[i % n_caches]) for i in range(len(qs))]
                t = timing.time_calls(f, sets)
                prof = _safe_profile(f, sets) if gpu else {}
            except Exception as e:  # noqa: BLE001
                rows.append(dict(L=L, B=B, Nq=Nq, window=window, config=ov, error=repr(e)[:400]))
                print("attention config failed", L, B, Nq, window, ov, repr(e)[:400], flush=True)
                continue
            used = attention_config(B, Nq, Hq, Hkv, D, L + max(Nq, 64), window, **ov)
            kt = prof.get("kernel_seconds", t)
            r = dict(L=L, B=B, Nq=Nq, window=window, config=dict(used.__dict__), seconds=t, kv_bytes=kv_bytes,
                     roofline_fraction=kv_bytes / bw / t, device=prof, kernel_seconds=kt,
                     kernel_roofline_fraction=kv_bytes / bw / kt)
            rows.append(r)
            if best is None or kt < best["kernel_seconds"]:
                best = r
        if best is None:
            table.append(f"{L:>7} {B:>2} {Nq:>3} {str(window):>4}   FAILED")
            return None
        if L <= 32768 or B == 1:  # correctness of the best config at this shape, f32 reference on the device
            cfg = dict(best["config"])
            ref = jax.jit(lambda q, kc, vc: attention_reference(q, k, v, kc, vc, lengths, positions, bits, sinks,
                                                                  window=window, scale=D ** -0.5))
            out = jax.jit(lambda q, kc, vc: attention_pallas(q, k, v, kc, vc, lengths, positions, bits, sinks,
                                                               window=window, scale=D ** -0.5,
                                                               interpret=not gpu, **cfg))
            a = np.asarray(out(qs[0], *caches[0]), np.float32)
            b_ = np.asarray(ref(qs[0], *caches[0]), np.float32)
            best["rel_err"] = float(np.linalg.norm(a - b_) / np.linalg.norm(b_))
        if gpu and mosaic.mosaic_fits(qs[0], caches[0][0], window):  # the Mosaic GPU kernel, its default launch
            def g(q, kc, vc):
                return mosaic.attention_mosaic(q, k, v, kc, vc, lengths, positions, bits, sinks, window=window,
                                               scale=D ** -0.5)
            try:
                prof = _safe_profile(g, [(qs[i], *caches[i % n_caches]) for i in range(len(qs))])
                a = np.asarray(jax.jit(g)(qs[0], *caches[0]), np.float32)
                b_ = np.asarray(attention_reference(qs[0], k, v, *caches[0], lengths, positions, bits, sinks,
                                                    window=window, scale=D ** -0.5), np.float32)
                kt = prof["kernel_seconds"]
                best.update(mosaic=dict(device=prof, kernel_seconds=kt, kernel_roofline_fraction=kv_bytes / bw / kt,
                                        rel_err=float(np.linalg.norm(a - b_) / np.linalg.norm(b_))))
            except Exception as e:  # noqa: BLE001
                best["mosaic"] = dict(error=repr(e)[:400])
        del caches
        if torch_side and gpu and FLAGS.attn_torch:
            try:
                best.update(_torch_attention(B, Nq, L, par, flex=Nq <= 16))
            except Exception as e:  # noqa: BLE001
                best["torch_error"] = repr(e)[:300]
        best["best"] = True
        c = best["config"]
        table.append(f"{L:>7} {B:>2} {Nq:>3} {str(window):>4} {best['kernel_seconds'] * 1e6:8.1f} "
                     f"{100 * best['kernel_roofline_fraction']:6.1f} {best['seconds'] * 1e6:8.1f} "
                     f"{best.get('sdpa_s', float('nan')) * 1e6:8.1f} {best.get('flex_s', float('nan')) * 1e6:8.1f} "
                     f"{best.get('rel_err', float('nan')):8.1e} "
                     f"{best.get('mosaic', {}).get('kernel_seconds', float('nan')) * 1e6:8.1f} "
                     f"{100 * best.get('mosaic', {}).get('kernel_roofline_fraction', float('nan')):6.1f} "
                     f"{best.get('mosaic', {}).get('rel_err', float('nan')):8.1e}  ns={c['num_splits']} bk={c['block_k']} "
                     f"rb={c['block_rows']} w={c['num_warps']} st={c['num_stages']} pre={int(c['preload_new'])}")
        print(table[-1], flush=True)
        return best

    for L in prefixes:
        for B in batches:
            for Nq in nqs:
                configs = [None]
                if gpu and FLAGS.attn_sweep and L == 32768 and Nq <= 16:
                    base = attention_config(B, Nq, Hq, Hkv, D, L + 64, None)
                    ns = base.num_splits
                    configs = [None, dict(num_splits=max(1, ns // 2)), dict(num_splits=2 * ns),
                               dict(num_stages=4)]
                    if base.block_rows <= 64:
                        configs += [dict(block_k=128)]
                    else:
                        configs += [dict(block_k=32), dict(num_stages=2)]
                run_one(B, Nq, L, None, configs, torch_side=(L == 32768 and Nq in (1, 16, 64)))
        for B in batches:  # sliding layers (window 128): time independent of the prefix
            for Nq in ([1] if quick else [1, 16]):
                run_one(B, Nq, L, 128)
    return dict(copy_bandwidth=bw, rows=rows, table=table)


def _random_trees(rng, B, N, n_sets):
    out = []
    for _ in range(n_sets):
        par = np.full((B, N), -1, np.int32)
        for i in range(1, N):
            par[:, i] = rng.integers(max(0, i - 4), i, B)
        out.append(jnp.asarray(par))
    return out


@_guard
def bench_tree_mask():
    from eagle3_jax.pallas.tree_mask import tree_mask_pallas, tree_mask_reference
    interp = jax.default_backend() != "gpu"
    rng = np.random.default_rng(0)
    rows, table = [], ["tree_mask (us per call, 32 distinct trees back to back in one program)"]
    for B, N in [(1, 8), (4, 64)]:
        pars = _random_trees(rng, B, N, 32)
        lengths = jnp.full((B,), 1000, jnp.int32)
        kern = lambda p: tree_mask_pallas(p, lengths, interpret=interp)  # noqa: E731
        ref = lambda p: tree_mask_reference(p, lengths)  # noqa: E731
        t = timing.time_calls(kern, [(p,) for p in pars])
        tr = timing.time_calls(ref, [(p,) for p in pars])
        dev = _safe_profile(kern, [(p,) for p in pars]) if not interp else {}
        same = all(bool(jnp.all(a == b)) for a, b in zip(jax.jit(kern)(pars[0]), jax.jit(ref)(pars[0])))
        rows.append(dict(B=B, N=N, seconds=t, reference_seconds=tr, matches_reference=same, device=dev))
        table.append(f"B={B} N={N}: kernel {dev.get('kernel_seconds', float('nan')) * 1e6:.1f} on device, "
                     f"{t * 1e6:.1f} per call in a stream; jnp reference {tr * 1e6:.1f}; match={same}")
    return dict(rows=rows, table=table)


@_guard
def bench_accept():
    from eagle3_jax.pallas.accept import (accept_greedy_pallas, accept_greedy_reference, accept_sample_pallas,
                                          accept_sample_reference)
    gpu = jax.default_backend() == "gpu"
    interp = not gpu
    rng = np.random.default_rng(0)
    rows, table = [], ["accept (us per call, distinct inputs back to back in one program)"]
    B, N, Dm = 4, 64, 16
    pars = _random_trees(rng, B, N, 32)
    sets = []
    for p in pars:
        tok = rng.integers(0, 8, (B, N)).astype(np.int32)
        tgt = rng.integers(0, 8, (B, N)).astype(np.int32)
        pn = np.asarray(p)
        for b in range(B):  # long accepted paths
            for i in range(1, N):
                if rng.random() < 0.7:
                    tgt[b, pn[b, i]] = tok[b, i]
        sets.append((jnp.asarray(tok), p, jnp.asarray(tgt)))
    kern = lambda a, b, c: accept_greedy_pallas(a, b, c, max_depth=Dm, interpret=interp)  # noqa: E731
    ref = lambda a, b, c: accept_greedy_reference(a, b, c, max_depth=Dm)  # noqa: E731
    t = timing.time_calls(kern, sets)
    tr = timing.time_calls(ref, sets)
    dev = _safe_profile(kern, sets) if not interp else {}
    o = jax.jit(kern)(*sets[0])
    same = all(bool(jnp.all(x == y)) for x, y in zip(o, jax.jit(ref)(*sets[0])))
    rows.append(dict(kind="greedy", B=B, N=N, max_depth=Dm, seconds=t, reference_seconds=tr,
                     matches_reference=same, accept_len=np.asarray(o[0]).tolist(), device=dev))
    table.append(f"greedy B={B} N={N}: kernel {dev.get('kernel_seconds', float('nan')) * 1e6:.1f} on device, "
                 f"{t * 1e6:.1f} per call in a stream; jnp reference {tr * 1e6:.1f}; match={same} "
                 f"acc={np.asarray(o[0]).tolist()}")
    for V in ([32000, 201088] if gpu and not FLAGS.kernels_quick else [64]):
        key = jax.random.key(0)
        logits = jax.random.normal(key, (B, N, V), jnp.float32) * 3
        p = jax.nn.softmax(logits, -1)
        q = jax.nn.softmax(logits + jax.random.normal(jax.random.key(1), (B, N, V)) * 2, -1)
        tok = jnp.argmax(q, -1).astype(jnp.int32)  # plausible drafts
        par = sets[0][1]
        for prop in ("sample", "deterministic"):
            ks = [(tok, par, p, q, jax.random.key(10 + i)) for i in range(8)]
            kern = lambda a, b, c, d, e, prop=prop: accept_sample_pallas(  # noqa: E731
                a, b, c, d, e, max_depth=Dm, proposal=prop, interpret=interp)
            ref = lambda a, b, c, d, e, prop=prop: accept_sample_reference(  # noqa: E731
                a, b, c, d, e, max_depth=Dm, proposal=prop)
            t = timing.time_calls(kern, ks)
            tr = timing.time_calls(ref, ks)
            dev = _safe_profile(kern, ks) if not interp else {}
            o, r = jax.jit(kern)(*ks[0]), jax.jit(ref)(*ks[0])
            same = all(bool(jnp.all(x == y)) for x, y in zip(o, r))
            rows.append(dict(kind=f"sample/{prop}", B=B, N=N, V=V, seconds=t, reference_seconds=tr,
                             matches_reference=same, accept_len=np.asarray(o[0]).tolist(), device=dev))
            table.append(f"sample/{prop} B={B} N={N} V={V}: kernel {dev.get('kernel_seconds', float('nan')) * 1e6:.1f}"
                         f" on device, {t * 1e6:.1f} in a stream; jnp reference {tr * 1e6:.1f}  "
                         f"match={same} acc={np.asarray(o[0]).tolist()}")
        del p, q, logits
    return dict(rows=rows, table=table)


@_guard
def bench_kv_rewind():
    import functools

    from eagle3_jax.pallas.accept import accept_greedy_reference
    from eagle3_jax.pallas.kv_rewind import _kv_rewind_pallas, kv_rewind_reference
    gpu = jax.default_backend() == "gpu"
    interp = not gpu
    quick = FLAGS.kernels_quick or not gpu
    layers, B, Hkv, S, D, N = (4, 2, 2, 256, 64, 16) if quick else (36, 4, 8, 8192, 64, 64)
    Dm = 8
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    k = tuple(jax.random.normal(jax.random.key(i), (B, Hkv, S, D), bf) for i in range(layers))
    v = tuple(jax.random.normal(jax.random.key(1000 + i), (B, Hkv, S, D), bf) for i in range(layers))
    lengths = jnp.asarray(rng.integers(100, S - N, B), jnp.int32)
    paths = []
    for p in _random_trees(rng, B, N, 16):
        zeros = jnp.zeros((B, N), jnp.int32)
        acc, path, _ = accept_greedy_reference(zeros, p, zeros, max_depth=Dm)  # everything matches: deepest path
        paths.append((path, acc))
    rk, rv = jax.jit(kv_rewind_reference)(k, v, lengths, *paths[0])
    ok, ov = jax.jit(functools.partial(_kv_rewind_pallas, interpret=interp))(k, v, lengths, *paths[0])
    same = all(bool(jnp.all(a == b)) for a, b in zip(rk + rv, ok + ov))
    del rk, rv, ok, ov
    d = jnp.arange(1, Dm + 1)
    moved = int(jnp.sum((paths[0][0][:, 1:] != d) & (d <= paths[0][1][:, None])))

    def chain(k, v):  # 16 rewinds in one program, in place (donated), each with its own path
        for pth, a in paths:
            k, v = _kv_rewind_pallas(k, v, lengths, pth, a, interpret=interp)
        return k, v

    f = jax.jit(chain, donate_argnums=(0, 1))
    k, v = f(k, v)
    jax.block_until_ready((k, v))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        k, v = f(k, v)
        jax.block_until_ready((k, v))
        times.append((time.perf_counter() - t0) / len(paths))
    t = float(np.median(times))
    dev = _profile_program(lambda: f(k, v), len(paths)) if gpu else {}
    row = dict(layers=layers, B=B, Hkv=Hkv, S=S, D=D, N=N, max_depth=Dm, seconds=t, matches_reference=same, device=dev,
               moved_rows_per_head_first_tree=moved, bytes_moved_first_tree=2 * moved * 2 * layers * Hkv * D * 2)
    return dict(rows=[row], table=[f"kv_rewind {layers} layers K+V, B={B} Hkv={Hkv} N={N}: "
                                   f"{dev.get('kernel_seconds', float('nan')) * 1e6:.1f} us on device, {t * 1e6:.1f} us per "
                                   f"call (in place, 16 in one program; {moved} moved rows/head/layer in tree 0); "
                                   f"match={same}"])


SECTIONS = {
    "moe": bench_moe,
    "moe_grouped": _guard(bench_moe_grouped),
    "attention": bench_attention,
    "tree_mask": bench_tree_mask,
    "accept": bench_accept,
    "kv_rewind": bench_kv_rewind,
    "gemv": _guard(bench_gemv),
}


def main(argv):
    del argv
    names = FLAGS.only or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise ValueError(f"--only: unknown sections {unknown}; known: {sorted(SECTIONS)}")
    result = dict(timing.device_info())
    for name in names:
        t0 = time.perf_counter()
        result[name] = SECTIONS[name]()
        result[name]["section_seconds"] = time.perf_counter() - t0
    text = json.dumps(result, indent=1, default=float)
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            f.write(text)
    if "moe" in result:
        _print_moe_table(result["moe"])
    for name in names:  # sections that bring their own table print it last
        if isinstance(result[name], dict) and result[name].get("table"):
            print("\n".join(result[name]["table"]))


def _print_moe_table(r):
    print(f"\n{r['device']} jax {r['jax_version']} copy {r['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s "
          f"config {r['config']} relerr {r['rel_err_T5_vs_reference']:.1e}")
    for s in r.get("sweep", []):
        print("  sweep", s.get("config"), {k: round(float(v), 3) if isinstance(v, (float, np.floating)) else v
                                          for k, v in s.items() if k != "config"})
    print(f"{'T':>3} {'experts':>7} {'roof us':>8} {'kern us':>8} {'frac':>5} {'dev us':>8} {'frac':>5} {'layer':>8} "
          f"{'gather':>8} {'group':>8}")
    for row in r["tokens"]:
        print(f"{row['tokens']:>3} {row['distinct_experts']:>7.1f} {row['roofline_us']:>8.1f} {row['kernel_us']:>8.1f} "
              f"{row['kernel_roofline_fraction']:>5.2f} {row.get('kernel_device_us', float('nan')):>8.1f} "
              f"{row.get('kernel_device_roofline_fraction', float('nan')):>5.2f} {row['layer_kernel_us']:>8.1f} "
              f"{row.get('layer_jnp_gathered_us', float('nan')):>8.1f} {row.get('layer_jnp_grouped_us', float('nan')):>8.1f}")
    if "e2e" in r:
        e = r["e2e"]
        print(f"e2e: {e['seconds_per_token'] * 1e3:.3f} ms/token, roofline {e['roofline_seconds_per_token'] * 1e3:.3f} ms "
              f"({e['roofline_fraction']:.2f}); parts ms " +
              str({k: round(v * 1e3, 3) for k, v in e['parts_seconds_per_token'].items()}))


if __name__ == "__main__":
    cli.run(main)
