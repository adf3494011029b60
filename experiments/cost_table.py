"""Measures the table of step times that decode(depth="auto") reads (format: eagle3_jax/spec/cost_table.py)
on this device for one target / draft pair, and writes (or merges) it into a table file.

  python experiments/cost_table.py --out table.json                     # the embedded pair, CPU: ~15 minutes
  python experiments/cost_table.py --preset gpt-oss-120b --contexts 1024,16384 --batches 1,4,16 --modes greedy \\
      --shapes chain3 --out table.json                                  # random weights of that shape
  # then decode(..., depth="auto", cost_table="table.json"), or copy it to eagle3_jax/assets/cost_tables/<kind>.json

For each proposal mode (--modes: greedy at temperature 0; deterministic and sample at temperature 1),
each draft configuration of --shapes (chainK or treeDxKnN; its options: chains of 0 .. D drafts and
that tree), batch and prompt length: one executable of decode(depth="auto"), each option forced in
turn (lib/auto_timing.py: the difference of a --tokens run and the shortest run of the same program,
over their difference in steps, medians of --repeats). A chain measured under several shapes keeps
the first figure. The table's context is prompt length + --tokens / 2 (the rows' mean length over
the timed steps). Prompts: the embedded pair's held-out prompts cut or repeated to length, or with
--preset random ids (random weights accept few drafts; a step's time does not depend on acceptance
but for a tree's KV moves). The file keeps the tables of other pairs and modes (--nomerge: replaced).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from lib import auto_timing, cli
from lib.step_timing import decode_kwargs, preset_config, random_pair, validate_shape_flags
from lib.timing import device_info, write_json

from eagle3_jax import assets
from eagle3_jax.convert import load_eagle3, load_gpt_oss
from eagle3_jax.spec import cost_table

flags.DEFINE_string("target", assets.TARGET_DIR, "HF GPT-OSS checkpoint folder (ignored with --preset)")
flags.DEFINE_string("draft", assets.DRAFT_DIR, "HF EAGLE-3 draft folder (ignored with --preset)")
flags.DEFINE_string("preset", None, "random weights of this GptOssConfig preset (e.g. gpt-oss-120b) and a draft of "
                    "the published EAGLE-3 shape, instead of --target / --draft")
flags.DEFINE_integer("layers", None, "with --preset: target layers (default: the preset's)", lower_bound=1)
flags.DEFINE_list("shapes", ["tree3x4n8", "tree5x8n16"], "draft configurations: chainK or treeDxKnN")
flags.DEFINE_list("modes", list(auto_timing.MODES), "proposal modes: greedy, deterministic, sample")
flags.DEFINE_list("batches", ["1", "4", "16"], "batch sizes")
cli.positive_ints("batches")
flags.DEFINE_list("contexts", ["128"], "prompt lengths (tokens)")
cli.positive_ints("contexts")
flags.DEFINE_integer("tokens", 64, "new tokens of the long run", lower_bound=8)
flags.DEFINE_integer("repeats", 3, "runs per figure (median)", lower_bound=1)
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "dtype (default: bfloat16 on GPUs, float32 on CPUs)")
flags.DEFINE_bool("merge", True, "keep the --out file's tables of other pairs and modes")
flags.DEFINE_string("out", None, "table file to write")
flags.mark_flag_as_required("out")
cli.progress_flag()
FLAGS = flags.FLAGS
validate_shape_flags("shapes")


def _modes(modes):
    bad = [m for m in modes if m not in auto_timing.MODES]
    if not modes or bad:
        raise ValueError(f"expected a non-empty list of {list(auto_timing.MODES)}, got {modes}")


cli.check_with("modes", _modes)


def prompts_of(target, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of `length` ids: the embedded pair's held-out prompts repeated or cut, else
    (--preset) random ids."""
    if FLAGS.preset:
        rng = np.random.default_rng(length)
        return rng.integers(0, target.config.vocab_size, (batch, length)).tolist()
    base = assets.eval_prompts()
    return [(base[i % len(base)] * (length // len(base[0]) + 1))[:length] for i in range(batch)]


def load():
    dtype = jnp.dtype(FLAGS.dtype) if FLAGS.dtype else assets.default_dtype()
    if FLAGS.preset:
        target, draft = random_pair(preset_config(FLAGS.preset, FLAGS.layers))
        return target, draft, dtype
    target = load_gpt_oss(FLAGS.target, dtype=dtype, progress=cli.load_progress())
    return target, load_eagle3(FLAGS.draft, target=target, progress=cli.load_progress()), dtype


def main(argv):
    del argv
    target, draft, dtype = load()
    model = cost_table.model_fields(target.config, draft.config, target.dtype)
    batches, lengths = [int(b) for b in FLAGS.batches], [int(c) for c in FLAGS.contexts]
    info = device_info()
    tables = []
    work = [(m, s, b, c) for m in FLAGS.modes for s in FLAGS.shapes for b in batches for c in lengths]
    bar = cli.bar(total=len(work), desc="cost table", unit="program")
    for mode in FLAGS.modes:
        seconds, notes = {}, {}
        for shape in FLAGS.shapes:
            kw = dict(decode_kwargs(shape), eos_ids=(), **auto_timing.MODES[mode])
            new = [n for n in auto_timing.options_of(kw) if n not in seconds]
            for n in new:
                seconds[n] = [[None] * len(lengths) for _ in batches]
            for i, b in enumerate(batches):
                for j, c in enumerate(lengths):
                    bar.set_postfix_str(f"{mode} {shape} B={b} P={c}")
                    got = auto_timing.option_seconds(target, draft, prompts_of(target, b, c), FLAGS.tokens, kw,
                                                     FLAGS.repeats, names=new)
                    for n, r in got.items():
                        seconds[n][i][j] = r["seconds"]
                        notes.setdefault(n, {})[f"B={b},P={c}"] = dict(steps=r["steps"], tau=r["tau"],
                                                                       compile_seconds=r["compile_seconds"])
                        step = "not measured" if r["seconds"] is None else f"{r['seconds'] * 1e3:8.3f} ms a step"
                        cli.write(f"{mode:13s} {n:11s} B={b:<3d} P={c:<6d} {step}  (tau {r['tau']:.2f})")
                    bar.update()
        tables.append(dict(
            model=model, proposal=auto_timing.MODES[mode]["proposal"], greedy=mode == "greedy", batches=batches,
            contexts=[c + FLAGS.tokens // 2 for c in lengths], seconds=seconds,
            source=f"measured by experiments/cost_table.py on {info['device']} ({info['date']}): {info['command']}; "
                   "each figure (seconds of a --tokens run - of the shortest run of the same program) / (their "
                   "difference in steps), the option forced at every step (experiments/lib/auto_timing.py)",
            runs=notes, jax_version=info["jax_version"]))
    bar.close()
    old = []
    if FLAGS.merge and os.path.exists(FLAGS.out):
        with open(FLAGS.out) as f:
            old = json.load(f).get("tables", [])
    key = lambda t: (json.dumps(t.get("model"), sort_keys=True), t.get("proposal"), t.get("greedy"))  # noqa: E731
    mine = {key(t) for t in tables}
    write_json(FLAGS.out, {"format": 1, "device_kind": jax.devices()[0].device_kind,
                           "tables": [t for t in old if key(t) not in mine] + tables})
    cli.write(f"wrote {len(tables)} table(s) to {FLAGS.out}")


if __name__ == "__main__":
    cli.run(main)
