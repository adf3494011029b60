"""Tensor-parallel decode of gpt-oss-120b at several model-axis sizes, one process, one run.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python experiments/bench_tp.py --tp 1,2,4 --batch_sizes 1,4,16 \
      --out experiments/results/tp_decode_<device>.json

For each tensor-parallel degree in --tp (1: one device; n: a (data 1, model n) mesh of the first n
devices, `parallel.make_mesh`), packed random gpt-oss-120b weights and a random draft of the
published EAGLE-3 shape are made on those devices (`step_timing.random_pair`), then for each batch
in --batch_sizes at --context committed tokens: the baseline step (one token a sequence; its time is
the ms a token each sequence sees) and the speculative step of --shape, each timed as bench.py times
them (`step_timing.time_baseline`, `time_step`: a jitted loop, the call's own cost taken off), with
the collectives each step makes (`timing.collectives`). With n > 1 each step is timed once for each
of --reductions ("kernel": decode and verify sum over "model" through pallas/allreduce.py's fused
kernel, where `parallel.context` gives the mesh a Mailbox; "xla": XLA's all-reduce, a run context
without one, `step_timing.run_context`), and for each of --allreduce_rows the reduction alone: one XLA
all-reduce of a [rows, hidden] bf16 array (`timing.allreduce_seconds`), and the fused sum + add +
RMSNorm through the kernel and through its reference, calls chained with nothing between them
(`lib/reduce_timing.py`, feed "direct"). The
models of one degree are freed before the next is made, so one GPU must hold the whole model at tp 1
(gpt-oss-120b: 62.4 GiB). Rows {"tp", "batch", "ms_per_token", "tokens_per_second",
"roofline_fraction" (the bytes the busiest device reads, `roofline.target_bytes(..., model=tp)`, at
the copy bandwidth of this run's first device, over the time), "step_ms", "speedup_vs_tp1" (tp 1's
ms_per_token at the same batch over this one, both from this run; None before tp 1 has run),
"projected_speedup" (tau x baseline / step at the published tau), "collectives", "reduction"
("kernel" | "xla"; None at tp 1), "experts" (how --experts split them, each split its own model
timed in turn: "expert" whole experts a device, "tensor" every expert's units over the devices,
`parallel.split_experts`; None at tp 1), "moe_config" (the MXFP4 kernels' launch config for one
device's share of the experts, `moe.config_for`, with its "units"; None for dense experts)};
"allreduce": [{"tp", "rows", "xla_us", "kernel_us", "reference_us"}] (kernel and reference: None
where the mesh has no Mailbox). With --profile a row
also has "baseline_kernels_ms" (kernel family -> device ms a baseline step, per device) and
"baseline_launches" (kernels a step, per device); {} and 0 where there is no profile (CPU); on a GPU
the profiled loop is compiled with XLA's default options (`step_timing.loop_time`: a loop's CUDA
graph hides its kernels from the profiler). The JSON is written after every row: a run cut short
keeps what it measured.

With --shares (after the degrees): one device running one device's share of tp n and nothing else
(`share_config`: the heads, kv heads, vocabulary and each expert's units that a device of a (1, n)
mesh holds) through the one-device program: the experts through their launch config for that many
units, as on the tp n mesh, but q|k|v and o_proj through XLA's dots and each residual add + RMSNorm
through the norm kernel, where a tp n device runs the projections' one-row kernel
(`gemv.rows_matmul`: 3.4-4.6 us a share faster at one row, kernels_gemv_nk_h200.json) and the fused
reduction. Its baseline timed at each batch: "share_rows": [{"share", "batch", "ms_per_token",
"roofline_fraction" (tp n's device bytes), "speedup_vs_tp1", "config", "moe_config"}, with --profile
also "baseline_kernels_ms" and "baseline_launches"]: what tp n's kernels cost a device without
communication, to within those differences (docs/perf/multi_gpu.md).
"""

import dataclasses
import gc

import jax
import numpy as np
from absl import flags
from jax.sharding import AbstractMesh
from lib import cli, reduce_timing, roofline, step_timing, timing
from lib.step_timing import parse_shape, random_pair, run_context, time_baseline, time_step, validate_shape_flags

from eagle3_jax import parallel
from eagle3_jax.models import GptOssConfig, gpt_oss
from eagle3_jax.pallas import moe

step_timing.target_flags()
flags.DEFINE_list("tp", ["1", "2", "4"], "tensor-parallel degrees (the mesh's model axis), in order")
flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "batches timed at each degree")
flags.DEFINE_integer("context", 2048, "committed tokens per sequence", lower_bound=1)
flags.DEFINE_string("shape", "chain3", "draft shape of the speculative step")
flags.DEFINE_list("reductions", ["kernel", "xla"], "how decode and verify sum over 'model' at tp > 1 "
                  "(kernel: where the mesh has a Mailbox)")
flags.DEFINE_list("allreduce_rows", ["1", "4", "16", "64"], "rows of the all-reduce timed alone at each tp > 1")
flags.DEFINE_list("experts", [parallel.EXPERTS], "how the experts are split over 'model' at tp > 1 "
                  "(parallel.split_experts: tensor, expert); each its own model, timed in turn")
flags.DEFINE_integer("iters", 24, "steps per timed loop (at 6, tp 2's B=1 baseline moved 1.82-2.14 ms a token "
                     "between runs; at 24 and 48, 2.00-2.07 on four runs: the call's own cost, taken off once a "
                     "loop, weighs less on more steps)", lower_bound=1)
flags.DEFINE_integer("copy_bytes", 1 << 30, "buffer size of the copy-bandwidth measurement (first device)",
                     lower_bound=1 << 10)
flags.DEFINE_list("shares", [], "also one device running one device's share of tp n, for each n (no communication)")
flags.DEFINE_bool("profile", False, "also each baseline step's device time by kernel family (ms a step and device)")
flags.DEFINE_string("out", None, "JSON output path")
cli.progress_flag()
FLAGS = flags.FLAGS
cli.positive_ints("tp", "batch_sizes", "allreduce_rows")
cli.positive_ints("shares", empty=True)
validate_shape_flags("shape")
flags.register_validator("reductions", lambda v: set(v) <= {"kernel", "xla"} and len(v) > 0,
                         "--reductions: a list of kernel, xla")
flags.register_validator("experts", lambda v: set(v) <= {"expert", "tensor"} and len(v) > 0,
                         "--experts: a list of expert, tensor")


def moe_config(target) -> dict | None:
    """The launch config the MXFP4 experts' kernels take on one device's share of the units
    (`moe.config_for`), with "units"; None for dense experts."""
    blocks = getattr(target.layers[0].mlp.experts, "gate_up_blocks", None)
    if blocks is None:
        return None
    units = blocks[...].addressable_shards[0].data.shape[1] // 2
    return dict(units=units, **dataclasses.asdict(moe.config_for(units)))


def vs_tp1(base_ms: dict, B: int, ms: float):
    """(tp 1's ms a token at batch B over `ms`, None where tp 1 was not timed; its " (N.NNx tp1)" text)."""
    ref = base_ms.get(B)
    return (None, "") if ref is None else (ref / ms, f" ({ref / ms:.2f}x tp1)")


def profile_fields(kernels: dict | None, devices: int) -> dict:
    """A baseline loop's profile (`time_baseline`'s kernels: device seconds a step by family, summed
    over the devices, and "launches") per device: {"baseline_kernels_ms", "baseline_launches"}; {}
    where nothing was profiled (kernels None: no --profile)."""
    if kernels is None:
        return {}
    ms = {k: v * 1e3 / devices for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]) if k != "launches"}
    return {"baseline_kernels_ms": ms, "baseline_launches": kernels.get("launches", 0) / devices}


def timed_batch(cfg, tp: int, B: int, shape, reduction, experts, target, draft, result, base_ms):
    """Times the baseline and the speculative step at batch B, appending a row to result["rows"]."""
    base_mem, kernels = {}, ({} if FLAGS.profile else None)
    ctx = run_context(target, reduction or "kernel")
    t_base = time_baseline(target, B, FLAGS.context, FLAGS.iters, memory=base_mem, kernels=kernels, ctx=ctx)
    r = time_step(target, draft, B, shape, FLAGS.context, FLAGS.iters, parts=False, ctx=ctx)
    t_step = r["seconds"]["step"]
    if tp == 1:
        base_ms[B] = t_base * 1e3
    speedup, vs = vs_tp1(base_ms, B, t_base * 1e3)
    nbytes = roofline.target_bytes(cfg, B, 1, FLAGS.context, model=tp, experts=experts)["total"]
    row = dict(tp=tp, batch=B, context=FLAGS.context, shape=FLAGS.shape, reduction=reduction, experts=experts,
               moe_config=moe_config(target), ms_per_token=t_base * 1e3,
               tokens_per_second=B / t_base, roofline_fraction=nbytes / result["copy_bandwidth"] / t_base,
               step_ms=t_step * 1e3,
               speedup_vs_tp1=speedup,
               projected_speedup={f"{tau:g}": tau * t_base / t_step for tau in roofline.PUBLISHED_TAU},
               collectives=dict(baseline=base_mem.get("collectives"),
                                step=r["memory"]["step"].get("collectives")))
    row.update(profile_fields(kernels, tp))
    result["rows"].append(row)
    timing.write_json(FLAGS.out, result)
    cli.write(f"tp={tp} B={B:<3} {reduction or '':6} {experts or '':6} {row['ms_per_token']:7.2f} ms a token "
              f"({row['roofline_fraction']:.0%} of roofline){vs}  {FLAGS.shape} step {row['step_ms']:7.2f} ms  "
              f"proj@3.22 {row['projected_speedup']['3.22']:.2f}x  collectives "
              f"{sum((row['collectives']['baseline'] or {}).values())}")


def degree(cfg, tp: int, batches, shape, result, base_ms):
    """Times every batch at one degree, appending to result["rows"] (and result["allreduce"])."""
    mesh = None if tp == 1 else parallel.make_mesh(model=tp, devices=jax.devices()[:tp])
    mailbox = parallel.context(mesh, hidden=cfg.hidden_size).mailbox
    modes = [None] if mesh is None else [m for m in FLAGS.reductions if m == "xla" or mailbox is not None]
    if mesh is not None:
        progs = None if mailbox is None else {k: reduce_timing.fused(mesh, k) for k in (True, False)}
        rng = np.random.default_rng(0)
        for rows in map(int, FLAGS.allreduce_rows):
            a = dict(tp=tp, rows=rows, xla_us=timing.allreduce_seconds(mesh, rows, cfg.hidden_size) * 1e6,
                     kernel_us=None, reference_us=None)
            if progs is not None:
                args = reduce_timing.inputs(mesh, rows, cfg.hidden_size, rng)
                a["kernel_us"] = reduce_timing.per_call(progs[True][1], args, mailbox) * 1e6
                a["reference_us"] = reduce_timing.per_call(progs[False][1], args) * 1e6
            result["allreduce"].append(a)
            cli.write(f"tp={tp} {rows} rows: XLA all-reduce {a['xla_us']:.1f} us, fused kernel "
                      f"{a['kernel_us'] or float('nan'):.1f} us, reference {a['reference_us'] or float('nan'):.1f} us")
    for experts in [None] if mesh is None else FLAGS.experts:  # one model at a time
        target, draft = random_pair(cfg, mesh, experts)
        for B in batches:
            for reduction in modes:
                timed_batch(cfg, tp, B, shape, reduction, experts, target, draft, result, base_ms)
        del target, draft
        gc.collect()
        jax.clear_caches()


def share_config(cfg: GptOssConfig, n: int) -> GptOssConfig:
    """The model one device of a (data 1, model n) mesh holds under the default experts split: heads,
    kv heads and vocabulary divided by n, each expert's units as `parallel.expert_units` pads them
    (gpt-oss-120b at 4: 2944 / 4 = 736), token ids taken into the smaller vocabulary. Raises
    ValueError naming --shares and what n does not divide."""
    mesh = AbstractMesh((1, n), ("data", "model"))
    try:
        parallel.check_mesh(cfg, mesh)
    except ValueError as e:
        raise ValueError(f"--shares: {n}: {e}") from None
    V = cfg.vocab_size // n

    def ids(i):
        return None if i is None else i % V

    return cfg.replace(num_attention_heads=cfg.num_attention_heads // n,
                       num_key_value_heads=cfg.num_key_value_heads // n,
                       intermediate_size=parallel.expert_units(cfg, mesh, "tensor") // n, vocab_size=V,
                       eos_token_ids=tuple(ids(i) for i in cfg.eos_token_ids), pad_token_id=ids(cfg.pad_token_id),
                       bos_token_id=ids(cfg.bos_token_id))


def share_rows(cfg, n: int, batches, result, base_ms):
    """Times one device's share of tp n (`share_config`) at each batch, appending to result["share_rows"]."""
    target = gpt_oss.random_gpt_oss(share_config(cfg, n), seed=0)
    scfg = target.config
    for B in batches:
        kernels = {} if FLAGS.profile else None
        t = time_baseline(target, B, FLAGS.context, FLAGS.iters, kernels=kernels)
        nbytes = roofline.target_bytes(cfg, B, 1, FLAGS.context, model=n)["total"]
        speedup, vs = vs_tp1(base_ms, B, t * 1e3)
        row = dict(share=n, batch=B, context=FLAGS.context, ms_per_token=t * 1e3,
                   roofline_fraction=nbytes / result["copy_bandwidth"] / t,
                   speedup_vs_tp1=speedup,
                   config={k: getattr(scfg, k) for k in ("num_attention_heads", "num_key_value_heads",
                                                          "intermediate_size", "vocab_size")},
                   moe_config=moe_config(target))
        row.update(profile_fields(kernels, 1))
        result["share_rows"].append(row)
        timing.write_json(FLAGS.out, result)
        cli.write(f"share of tp={n} B={B:<3} on one device {row['ms_per_token']:7.2f} ms a token "
                  f"({row['roofline_fraction']:.0%} of tp {n}'s roofline){vs}")
    del target
    gc.collect()
    jax.clear_caches()


def main(argv):
    del argv
    tps, batches = [int(t) for t in FLAGS.tp], [int(b) for b in FLAGS.batch_sizes]
    cfg = step_timing.target_config()
    for tp in tps:  # every degree checked before any model is made
        if tp > jax.device_count():
            raise ValueError(f"--tp: {tp} devices, but {jax.device_count()} available")
        parallel.check_mesh(cfg, parallel.make_mesh(model=tp, devices=jax.devices()[:tp]))
    for n in map(int, FLAGS.shares):
        share_config(cfg, n)
    result = dict(timing.device_info(), preset=FLAGS.preset, layers=cfg.num_hidden_layers,
                  num_devices=jax.device_count(), context=FLAGS.context,
                  shape=FLAGS.shape, iters=FLAGS.iters, tau_published=roofline.PUBLISHED_TAU,
                  copy_bandwidth=timing.copy_bandwidth(FLAGS.copy_bytes), rows=[], allreduce=[], share_rows=[])
    cli.write(f"copy bandwidth {result['copy_bandwidth'] / 1e12:.2f} TB/s")
    base_ms = {}
    for tp in cli.bar(tps, "degrees", unit="tp"):
        degree(cfg, tp, batches, parse_shape(FLAGS.shape), result, base_ms)
    for n in map(int, FLAGS.shares):
        share_rows(cfg, n, batches, result, base_ms)
    timing.write_json(FLAGS.out, result)


if __name__ == "__main__":
    cli.run(main)
