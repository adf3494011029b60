"""The sum of a sublayer's partial outputs over the "model" devices fused with the residual add and
RMSNorm (pallas/allreduce.py): the one-shot kernel against its reference (XLA's all-reduce, then the
add and the norm), per message size, one process, one run.

  python experiments/bench_reduce_norm.py --tp 2,4 --rows 1,4,16,64 --parts 1,auto \
      --out experiments/results/reduce_norm_<device>.json

For each n in --tp (the first n GPUs as a (data 1, model n) mesh) and each R in --rows, [R, --hidden]
partials (f32), a bf16 residual and scale (`reduce_timing.inputs`): the kernel's s against the
reference's (max difference) and whether every device holds the same bits; then `--chain` calls a
loop iteration, each feeding the next (--feed: "direct", y is the next partial, nothing between two
calls; "scaled", y times a per-device factor, a multiply kernel between them), in a jitted
fori_loop compiled as decode's programs are, per call (`reduce_timing.per_call`), for both; the
kernel once for each of --parts (blocks a row is sent from; "auto": `allreduce.parts_for`). With
--profile, also the device time of each kernel family per call and device (`timing.kernel_records`
of one run of a copy of the loop compiled with XLA's defaults, whose kernels the profiler sees: the
fused kernel's own time, its spin included, against what the launches around it add). Rows {"tp",
"rows", "parts", "kernel_us", "reference_us", "s_max_diff", "same_on_devices", "kernel_device_us",
"reference_device_us"}. Needs GPUs (the kernel has no CPU path); the JSON is written after each row.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from lib import cli, reduce_timing, timing

from eagle3_jax import parallel
from eagle3_jax.pallas import allreduce

cli.message_flags()
flags.DEFINE_integer("chain", 8, "calls a loop iteration", lower_bound=1)
flags.DEFINE_integer("iters", 200, "loop iterations timed", lower_bound=1)
flags.DEFINE_list("parts", ["auto"], "blocks a row is sent from, each timed: integers or auto")
flags.register_validator("parts", lambda v: all(p == "auto" or (p.isdigit() and int(p) > 0) for p in v),
                         "--parts: a list of positive integers or auto")
flags.DEFINE_enum("feed", "direct", reduce_timing.FEEDS, "what a call's next partial is (see above)")
flags.DEFINE_bool("profile", True, "also the device time per call of each kernel family")
flags.DEFINE_string("out", None, "JSON output path")
FLAGS = flags.FLAGS


def device_us(run, args, mailbox, n):
    """{kernel family: device microseconds per call and device} over one run of --iters iterations
    (mailbox: the kernel's, None for the reference)."""
    k = jnp.int32(FLAGS.iters)
    boxes = () if mailbox is None else (mailbox,)
    recs = timing.kernel_records(lambda: run(*args, k, *boxes), repeats=1)
    out = {}
    for name, _, dur in recs:
        group = timing.kernel_group(name)
        out[group] = out.get(group, 0.0) + dur * 1e-3 / (FLAGS.iters * FLAGS.chain * n)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def programs(mesh):
    """(kernel, parts, options=None) -> `reduce_timing.fused`'s (once, loop) on mesh, each made once."""
    made = {}

    def get(kernel, parts, options=None):
        key = (kernel, parts, options is None)
        if key not in made:
            made[key] = reduce_timing.fused(mesh, kernel, FLAGS.chain, parts=parts, options=options, feed=FLAGS.feed)
        return made[key]

    return get


def main(argv):
    del argv
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        raise ValueError("bench_reduce_norm: needs a GPU (the kernel has no CPU path), found none")
    H = FLAGS.hidden
    result = dict(timing.device_info(), num_devices=len(gpus), hidden=H, chain=FLAGS.chain, iters=FLAGS.iters,
                  feed=FLAGS.feed, rows=[])
    rng = np.random.default_rng(0)
    for n in (int(t) for t in FLAGS.tp):
        if n > len(gpus):
            continue
        mesh = parallel.make_mesh(model=n, devices=gpus[:n])
        mailbox = allreduce.new_mailbox(mesh, H)
        prog = programs(mesh)
        for R in (int(r) for r in FLAGS.rows):
            args = reduce_timing.inputs(mesh, R, H, rng)
            ref = prog(False, None)
            s_ref = np.asarray(ref[0](*args)[0], np.float32)
            reference_us = reduce_timing.per_call(ref[1], args, None, FLAGS.iters, FLAGS.chain) * 1e6
            reference_device_us = device_us(prog(False, None, {})[1], args, None, n) if FLAGS.profile else None
            for parts in sorted({allreduce.parts_for(R, H, n) if p == "auto" else int(p) for p in FLAGS.parts}):
                if parts > allreduce.max_parts(H) or R * parts > allreduce.MAX_BLOCKS:
                    continue
                once, loop = prog(True, parts)
                s, y = (np.asarray(a, np.float32) for a in once(*args, mailbox))
                row = dict(tp=n, rows=R, parts=parts, s_max_diff=float(np.abs(s - s_ref).max()),
                           same_on_devices=bool(all(np.array_equal(s[0], s[d]) and np.array_equal(y[0], y[d])
                                                    for d in range(n))),
                           kernel_us=reduce_timing.per_call(loop, args, mailbox, FLAGS.iters, FLAGS.chain) * 1e6,
                           reference_us=reference_us)
                if FLAGS.profile:
                    row["kernel_device_us"] = device_us(prog(True, parts, {})[1], args, mailbox, n)
                    row["reference_device_us"] = reference_device_us
                result["rows"].append(row)
                timing.write_json(FLAGS.out, result)
                cli.write(f"tp={n} rows={R:<3} parts={parts} kernel {row['kernel_us']:6.1f} us  reference "
                          f"{reference_us:6.1f} us  s max diff {row['s_max_diff']:.3g}  same on devices "
                          f"{row['same_on_devices']}")


if __name__ == "__main__":
    cli.run(main)
