"""Acceptance and wall-clock speedup of a target / draft pair on held-out prompts.

  python experiments/eval_pair.py --out experiments/results/pair_eval_h200.json   # the shipped pair

tau (mean committed tokens per step, bonus included) and acceptance rate for each draft shape
(chains of 1..5 drafts and the --shapes trees) over all prompts in one batch, compared with greedy
`generate` token for token; then decode / generate throughput in the same process at each
--speed_batches size (median of --repeats runs, compile excluded) for --speed_shapes.
--auto_shapes: the same rows (shape "auto:<shape>") for decode(depth="auto") up to that shape (its
options: chains of 0 .. D drafts and the tree), with its histogram of choices; step times from
--cost_table (default: the table shipped for this device, eagle3_jax/assets/cost_tables/).

Equality: decode is lossless in exact arithmetic. In bf16 its verify pass (several tokens per
matmul) rounds differently from generate's one-token steps, so where the target's top two logits
are nearly tied the two greedy paths can part; the JSON gives each prompt's first differing
position. `--exact_check` repeats the comparison in float32 with full-precision matmuls, where
the outputs must be identical.
"""

import json
import os

import jax
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
flags.DEFINE_list("shapes", ["chain1", "chain2", "chain3", "chain4", "chain5", "tree3x4n8", "tree5x8n16"],
                  "draft shapes for tau: chainK or treeDxKnN (depth x topk, N nodes incl. the root)")
flags.DEFINE_list("speed_batches", ["1", "4"], "batch sizes of the throughput comparison")
cli.positive_ints("speed_batches", empty=True)
flags.DEFINE_list("speed_shapes", ["chain3", "tree5x8n16"], "draft shapes of the throughput comparison")
flags.DEFINE_list("auto_shapes", [], "shapes also run with depth='auto' (up to that shape), in acceptance and "
                  "speed, e.g. chain3,tree3x4n8; empty: none")
flags.DEFINE_string("cost_table", None, "depth='auto''s table of step times (default: the one shipped for the device)")
flags.DEFINE_integer("repeats", 3, "timed runs per throughput figure (median)", lower_bound=1)
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "weights / activations dtype (default: the library's, "
                  "assets.default_dtype(): bfloat16 on GPUs, float32 on CPUs, where decode == generate bit for bit)")
flags.DEFINE_list("exact_check", ["chain3", "tree3x4n8"], "shapes compared with generate in float32 (empty: skip)")
flags.DEFINE_string("out", None, "JSON output path")
cli.progress_flag()
FLAGS = flags.FLAGS
validate_shape_flags("shapes")
validate_shape_flags("speed_shapes", "exact_check", "auto_shapes", empty=True)
AUTO = "auto:"


def shape_kwargs(s):
    """A shape of the flags, or "auto:<shape>" -> decode's keyword arguments."""
    if s.startswith(AUTO):
        return dict(decode_kwargs(s[len(AUTO):]), depth="auto", cost_table=FLAGS.cost_table)
    return decode_kwargs(s)


def auto_fields(m):
    """The metrics of a depth="auto" run worth a row: its histogram, predicted and realised tokens."""
    if m.get("depth") != "auto":
        return {}
    return dict(depth_histogram=m["depth_histogram"], predicted_tokens=m["auto"]["predicted_tokens"],
                realised_tokens=m["auto"]["realised_tokens"])


def first_differences(a, b):
    """Per sequence pair: the first index where they differ (None when identical)."""
    return [next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v),
                 None if len(x) == len(y) else min(len(x), len(y)))
            for x, y in zip(a, b, strict=True)]


def exact_check(prompts, n, target, draft):
    """decode vs generate in float32 with full-precision matmuls, for --exact_check shapes: the run's
    own models where they are float32 already (a CPU's default), else the pair loaded again in float32."""
    with jax.default_matmul_precision("highest"):
        if jnp.dtype(target.dtype) != jnp.float32:
            target = load_gpt_oss(FLAGS.target, dtype=jnp.float32, progress=cli.load_progress())
            draft = load_eagle3(FLAGS.draft, target=target, dtype=jnp.float32, progress=cli.load_progress())
        base = generate(target, prompts, n).tokens
        return {s: decode(target, draft, prompts, n, **decode_kwargs(s)).tokens == base
                for s in cli.bar(FLAGS.exact_check, "float32 check", unit="shape")}


def main(argv):
    del argv
    dtype = jnp.dtype(FLAGS.dtype) if FLAGS.dtype else assets.default_dtype()
    target = load_gpt_oss(FLAGS.target, dtype=dtype, progress=cli.load_progress())
    draft = load_eagle3(FLAGS.draft, target=target, dtype=dtype, progress=cli.load_progress())
    with open(FLAGS.prompts_file) as f:
        prompts = json.load(f)[:FLAGS.num_prompts]
    n = FLAGS.max_new_tokens
    base = generate(target, prompts, n)
    res = dict(**device_info(), target=FLAGS.target, draft=FLAGS.draft, num_prompts=len(prompts),
               prompt_lengths=sorted({len(p) for p in prompts}), max_new_tokens=n, dtype=dtype.name, acceptance=[],
               speed=[])
    autos = [AUTO + s for s in FLAGS.auto_shapes]
    for s in cli.bar(FLAGS.shapes + autos, "acceptance", unit="shape"):
        out = decode(target, draft, prompts, n, **shape_kwargs(s))
        m = out.metrics
        kw = {k: v for k, v in shape_kwargs(s).items() if k != "cost_table"}
        row = dict(shape=s, **kw, tau=m["mean_accept_length"], accept_rate=m["accept_rate"],
                   accept_rate_per_position=m["accept_rate_per_position"], frac_steps_ge2=m["frac_steps_ge2"],
                   identical=out.tokens == base.tokens, first_difference=first_differences(out.tokens, base.tokens),
                   **auto_fields(m))
        res["acceptance"].append(row)
        write_json(FLAGS.out, res)  # after every row: a run cut short keeps what it measured
        cli.write(f"{s:12s} tau {row['tau']:.3f}  accept rate {row['accept_rate']:.3f}  identical to generate "
                  f"{row['identical']}")
    speed_shapes = FLAGS.speed_shapes + autos
    bar = cli.bar(total=len(FLAGS.speed_batches) * (1 + len(speed_shapes)), desc="speed", unit="run")
    for b in map(int, FLAGS.speed_batches):
        ps = prompts[:b]
        bar.set_postfix_str(f"B={b} generate")
        t_base = median_seconds(lambda ps=ps: generate(target, ps, n), FLAGS.repeats)
        bar.update()
        for s in speed_shapes:
            bar.set_postfix_str(f"B={b} {s}")
            kw = shape_kwargs(s)
            last = decode(target, draft, ps, n, **kw)
            t_spec = median_seconds(lambda ps=ps, kw=kw: decode(target, draft, ps, n, **kw), FLAGS.repeats)
            row = dict(batch=b, shape=s, baseline_seconds=t_base, decode_seconds=t_spec, speedup=t_base / t_spec,
                       tau=last.metrics["mean_accept_length"], tokens=sum(map(len, last.tokens)),
                       **auto_fields(last.metrics))
            res["speed"].append(row)
            write_json(FLAGS.out, res)
            bar.update()
            cli.write(f"B={b} {s:12s} generate {t_base * 1e3:8.1f} ms  decode {t_spec * 1e3:8.1f} ms  "
                      f"speedup {row['speedup']:.2f}x  (tau {row['tau']:.2f})")
    bar.close()
    if FLAGS.exact_check:
        res["identical_float32"] = exact_check(prompts, n, target, draft)
        print(f"float32, full-precision matmuls, identical to generate: {res['identical_float32']}", flush=True)
    write_json(FLAGS.out, res)


if __name__ == "__main__":
    cli.run(main)
