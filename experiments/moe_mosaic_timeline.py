"""Where the fused Mosaic MoE kernel (eagle3_jax/pallas/moe_mosaic.py) spends its time, from its own
time stamps (`moe_fma(..., timeline=True)`): one gpt-oss layer with random packed experts, T tokens
routed by its random router, GPU only.

  python experiments/moe_mosaic_timeline.py --tokens 1 --out experiments/results/moe_mosaic_timeline_h200.json

Per call (--calls of them, each a different routing, after a warm-up): the span from the first
warpgroup's start to the last unit's end; when a compute warpgroup first has data; per compute
warpgroup the time spent waiting for its units' data and computing them, gate_up and down apart; the
time from a unit's issue to the start of its compute (the copy's latency plus any wait for a busy
compute warpgroup); and the memory warpgroup's mean gap between issues.
"""


import numpy as np
from absl import flags

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.models import GptOssConfig, gpt_oss
from eagle3_jax.pallas import moe, moe_mosaic
from lib import cli, timing


def _define_flags():  # at run time only: the tests import summarize() beside other scripts' flags
    flags.DEFINE_string("preset", "gpt-oss-120b", "GptOssConfig preset of the layer")
    flags.DEFINE_integer("tokens", 1, "tokens T (T * k <= moe_mosaic.MAX_PAIRS)")
    flags.DEFINE_integer("compute_wgs", 3, "compute warpgroups")
    flags.DEFINE_integer("stages", None, "ring slots (default: moe_fma's)")
    flags.DEFINE_integer("calls", 4, "timed calls, each its own routing")
    flags.DEFINE_string("out", None, "JSON output path")


FLAGS = flags.FLAGS


def summarize(st, *, units_gate_up, units, compute_wgs):
    """st u32 [ncta, cw + 1, S + 1, 2] (`moe_fma`'s stamps) -> dict of microseconds (see the docstring)."""
    st = st.astype(np.int64)
    ncta, _, S1, _ = st.shape
    S, cw = S1 - 1, compute_wgs
    rel = (st - st[:, :, S, 0].min()) % (1 << 32)  # ns since the first start (the low bits wrap)
    rel = np.where(rel >= 1 << 31, rel - (1 << 32), rel)
    acc = dict(wait_gate_up=0, wait_down=0, comp_gate_up=0, comp_down=0)
    comp_g, comp_d, firsts, ends, lat, gaps = [], [], [], [], [], []
    for c in range(ncta):
        n_valid = -(-(units - c) // ncta)
        d0 = max(-(-(units_gate_up - c) // ncta), 0)
        for w in range(cw):
            prev = rel[c, w, S, 0]
            for n, i in enumerate(range(w, n_valid, cw)):
                ready, done = rel[c, w, i, 0], rel[c, w, i, 1]
                phase = "down" if i >= d0 else "gate_up"
                acc["wait_" + phase] += ready - prev
                acc["comp_" + phase] += done - ready
                (comp_d if i >= d0 else comp_g).append(done - ready)
                lat.append(ready - rel[c, cw, i, 0])
                if n == 0:
                    firsts.append(ready)
                prev = done
            ends.append(prev)
        issue = rel[c, cw, :n_valid, 0]
        gaps.extend(np.diff(issue))
    us = lambda v: float(v) / 1e3  # noqa: E731
    out = dict(span=us(max(ends)), first_data_mean=us(np.mean(firsts)), end_mean=us(np.mean(ends)),
               end_min=us(min(ends)), unit_gate_up_compute_mean=us(np.mean(comp_g)),
               unit_down_compute_mean=us(np.mean(comp_d)) if comp_d else None,
               issue_to_start_mean=us(np.mean(lat)), issue_to_start_p90=us(np.percentile(lat, 90)),
               memory_issue_gap_mean=us(np.mean(gaps)))
    out.update({k + "_per_warpgroup": us(v / (ncta * cw)) for k, v in acc.items()})
    return out


def main(_):
    if jax.default_backend() != "gpu":
        raise SystemExit("moe_mosaic_timeline: the Mosaic GPU kernel needs a GPU")
    cfg = GptOssConfig.preset(FLAGS.preset)
    k = cfg.num_experts_per_tok
    layer = gpt_oss.MoE(cfg, jnp.bfloat16, nnx.Rngs(0))
    ex = layer.experts
    packed = (ex.gate_up_blocks[...], ex.gate_up_scales[...], ex.gate_up_bias[...],
              ex.down_blocks[...], ex.down_scales[...], ex.down_bias[...])
    route = jax.jit(lambda m, x: m.route(x))
    T = FLAGS.tokens
    sets = []
    for r in range(FLAGS.calls):
        x = jax.random.normal(jax.random.key(r), (T, cfg.hidden_size), jnp.bfloat16)
        ids, w = route(layer, x)
        sets.append((ids.reshape(-1), w.reshape(-1), moe.f16_pairs(x.astype(jnp.float32))) + packed)
    kw = dict(k=k, limit=float(layer.limit), alpha=float(layer.alpha), dtype=jnp.bfloat16,
              compute_wgs=FLAGS.compute_wgs, stages=FLAGS.stages, timeline=True)
    calls = jax.jit(lambda sets: [moe_mosaic.moe_fma(*a, **kw)[1] for a in sets])
    jax.block_until_ready(calls(sets))
    stamps = jax.block_until_ready(calls(sets))
    P = T * k
    units_gate_up = P * 2 * cfg.intermediate_size // moe_mosaic.ROWS
    units = units_gate_up + P * cfg.hidden_size // moe_mosaic.ROWS
    rows = [summarize(np.asarray(s), units_gate_up=units_gate_up, units=units, compute_wgs=FLAGS.compute_wgs)
            for s in stamps]
    for r in rows:
        print({key: round(v, 3) if isinstance(v, float) else v for key, v in r.items()}, flush=True)
    res = dict(timing.device_info(), preset=FLAGS.preset, tokens=T, compute_wgs=FLAGS.compute_wgs,
               stages=FLAGS.stages, calls=rows,
               notes="microseconds; the kernel's own %globaltimer stamps (moe_fma timeline=True), one jitted "
                     "program of --calls calls; *_per_warpgroup: summed over a compute warpgroup's units, "
                     "averaged over the grid's compute warpgroups")
    if FLAGS.out:
        timing.write_json(FLAGS.out, res)


if __name__ == "__main__":
    _define_flags()
    cli.run(main)
