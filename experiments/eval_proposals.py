"""Deterministic against sampled drafts on the same pair: tau, accept rates and decode / generate.

  python experiments/eval_proposals.py --out experiments/results/proposals_<device>.json

For each draft shape and temperature, `decode(..., proposal=p)` for p in "deterministic" (top-k
drafts verified against one target draw per node) and "sample" (drafts drawn from the draft at the
decoding temperature, recursive rejection with its probabilities), on --num_prompts held-out
prompts of the embedded pair (or --target / --draft), all prompts in one batch; temperature 0 runs
"deterministic" alone as the reference row. With --speed_batches, decode / generate wall clock at
those batch sizes in the same process (median of --repeats runs, compile excluded, both at the
row's temperature). --auto: each (shape, temperature, proposal) also with decode(depth="auto") up to
that shape (options: chains of 0 .. D drafts and the tree; step times from --cost_table, default the
table shipped for this device), its row marked depth "auto" with its histogram of choices.
"""

import json
import math
import os

import jax.numpy as jnp
from absl import flags
from lib import cli
from lib.step_timing import decode_kwargs, median_seconds, validate_shape_flags
from lib.timing import device_info, write_json

from eagle3_jax import assets
from eagle3_jax.convert import load_eagle3, load_gpt_oss
from eagle3_jax.spec import decode, generate

flags.DEFINE_string("target", assets.TARGET_DIR, "HF GPT-OSS checkpoint folder")
flags.DEFINE_string("draft", assets.DRAFT_DIR, "HF EAGLE-3 draft folder")
flags.DEFINE_string("prompts_file", os.path.join(assets.PAIR_DIR, "eval_prompts.json"), "JSON list of token-id lists")
flags.DEFINE_integer("num_prompts", 16, "prompts used (the first n)", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per prompt", lower_bound=1)
flags.DEFINE_list("shapes", ["chain3", "tree3x4n8", "tree5x8n16"], "draft shapes: chainK or treeDxKnN")
flags.DEFINE_list("temperatures", ["0.6", "1.0"], "sampling temperatures (> 0); 0 is always added as the reference")
flags.DEFINE_list("speed_batches", [], "batch sizes of the decode / generate wall-clock comparison (e.g. 1,4)")
cli.positive_ints("speed_batches", empty=True)
flags.DEFINE_integer("repeats", 3, "timed runs per wall-clock figure (median)", lower_bound=1)
flags.DEFINE_bool("auto", False, "also a depth='auto' row for each shape, temperature and proposal")
flags.DEFINE_string("cost_table", None, "depth='auto''s table of step times (default: the one shipped for the device)")
flags.DEFINE_integer("seed", 0, "sampling seed", lower_bound=0)
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "dtype (default: bfloat16 on GPUs, float32 on CPUs)")
flags.DEFINE_string("out", None, "JSON output path")
cli.progress_flag()
FLAGS = flags.FLAGS
validate_shape_flags("shapes")


def _temperatures(ts):
    try:
        ok = all(math.isfinite(float(t)) and float(t) > 0 for t in ts)
    except ValueError:
        ok = False
    return ok


flags.register_validator("temperatures", _temperatures, "expected finite numbers > 0 (0 is always run)")


def main(argv):
    del argv
    dtype = jnp.dtype(FLAGS.dtype) if FLAGS.dtype else assets.default_dtype()
    progress = cli.load_progress()
    target = load_gpt_oss(FLAGS.target, dtype=dtype, progress=progress)
    draft = load_eagle3(FLAGS.draft, target=target, progress=progress)
    with open(FLAGS.prompts_file) as f:
        prompts = json.load(f)[:FLAGS.num_prompts]
    temps = [float(t) for t in FLAGS.temperatures]
    runs = [(s, 0.0, "deterministic") for s in FLAGS.shapes]
    runs += [(s, t, p) for s in FLAGS.shapes for t in temps for p in ("deterministic", "sample")]
    depths = ["fixed", "auto"] if FLAGS.auto else ["fixed"]
    runs = [(s, t, p, d) for s, t, p in runs for d in depths]
    n = FLAGS.max_new_tokens
    res = dict(**device_info(), target=FLAGS.target, draft=FLAGS.draft, num_prompts=len(prompts),
               max_new_tokens=n, dtype=dtype.name, seed=FLAGS.seed, rows=[])
    batches = [int(b) for b in FLAGS.speed_batches]
    base_s = {}
    bar = cli.bar(runs, "proposals", unit="run")
    for s, t, p, depth in bar:
        bar.set_postfix_str(f"{s} T={t} {p} {depth}")
        kw = dict(decode_kwargs(s), temperature=t, seed=FLAGS.seed, proposal=p)
        if depth == "auto":
            kw.update(depth="auto", cost_table=FLAGS.cost_table)
        m = decode(target, draft, prompts, n, **kw).metrics
        row = dict(shape=s, temperature=t, proposal=m["proposal"], depth=depth, tau=m["mean_accept_length"],
                   accept_rate=m["accept_rate"], accept_rate_per_position=m["accept_rate_per_position"],
                   slot_steps=m["slot_steps"], speed=[])
        if depth == "auto":
            row.update(depth_histogram=m["depth_histogram"], predicted_tokens=m["auto"]["predicted_tokens"],
                       realised_tokens=m["auto"]["realised_tokens"])
        for b in batches:
            if (b, t) not in base_s:
                base_s[b, t] = median_seconds(
                    lambda b=b, t=t: generate(target, prompts[:b], n, temperature=t, seed=FLAGS.seed), FLAGS.repeats)
            decode(target, draft, prompts[:b], n, **kw)  # compile
            d = median_seconds(lambda b=b, kw=kw: decode(target, draft, prompts[:b], n, **kw), FLAGS.repeats)
            row["speed"].append(dict(batch=b, generate_seconds=base_s[b, t], decode_seconds=d,
                                     speedup=base_s[b, t] / d))
        res["rows"].append(row)
        write_json(FLAGS.out, res)
        cli.write(f"{s:11s} T={t:.1f} {p:13s} {depth:5s} tau {row['tau']:.3f}  accept rate {row['accept_rate']:.3f}  " +
                  "  ".join(f"B={r['batch']} {r['speedup']:.2f}x" for r in row["speed"]))
    write_json(FLAGS.out, res)


if __name__ == "__main__":
    cli.run(main)
