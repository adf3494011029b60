"""One speculative step against the sum of its parts, and no recompilation across calls.

  python experiments/bench_step.py --layers 8 --experts 32 --batch 1,4 --context 2048 \
      --out experiments/results/step_midsize_h200.json

Mid-size target: gpt-oss-120b widths (hidden 2880, 64/8 heads, vocab 201088) with fewer layers
and experts; a random draft of the published gpt-oss-120b EAGLE-3 shape. Every timing runs its
work `--iters` times inside one jitted `fori_loop` with the caches carried in place, as decode's
`while_loop` does, so a step and its parts are timed the same way: draft (tree + mask),
verify (target over the N nodes), accept, rewind (trees only) and extend (draft over the
accepted tokens). A step much slower than the sum of its parts would mean a hidden sync or copy.
`--proposals deterministic,sample` times both verification rules (each row's `accept_rewind_share`:
accept + rewind over the step); `--preset gpt-oss-120b` the full model.
"""

import json

import numpy as np
from absl import flags
from lib import cli, timing
from lib.step_timing import parse_shape, preset_config, random_pair, time_step, validate_shape_flags

from eagle3_jax.models import GptOssConfig
from eagle3_jax.spec import decode

flags.DEFINE_integer("layers", 8, "target layers (with --preset: the preset's unless given)", lower_bound=1)
flags.DEFINE_integer("experts", 32, "target experts (top-4)", lower_bound=1)
flags.DEFINE_list("batch", ["1", "4"], "batch sizes")
cli.positive_ints("batch")
flags.DEFINE_integer("context", 2048, "committed tokens per sequence", lower_bound=1)
flags.DEFINE_list("shapes", ["chain3", "tree3x4n8"], "chainK or treeDxKnN")
flags.DEFINE_list("proposals", ["deterministic"], "decode proposals to time: deterministic (greedy), sample "
                  "(drafts drawn at temperature 1, recursive rejection)")
flags.DEFINE_integer("iters", 10, "steps per timed loop", lower_bound=1)
flags.DEFINE_bool("profile", True, "also record each timing's device kernel seconds by kernel family (GPU)")
flags.DEFINE_string("preset", None, "use this GptOssConfig preset instead (e.g. tiny, for a smoke run)")
flags.DEFINE_string("out", None, "JSON output path")
cli.progress_flag()
FLAGS = flags.FLAGS
validate_shape_flags("shapes")
flags.register_validator("proposals", lambda ps: len(ps) > 0 and set(ps) <= {"deterministic", "sample"},
                         "expected deterministic, sample or both")


def models():
    if FLAGS.preset:
        tcfg = preset_config(FLAGS.preset, FLAGS.layers if FLAGS["layers"].present else None)
    else:
        tcfg = GptOssConfig.preset("gpt-oss-120b").replace(
            num_hidden_layers=FLAGS.layers, layer_types=(), num_local_experts=FLAGS.experts)
    return random_pair(tcfg)


def kernel_diff(kernels):
    """The step minus the sum over its parts: device seconds per kernel family (largest change first),
    kernel launches, and the summed kernel seconds of the step and of its parts."""
    parts = [v for k, v in kernels.items() if k != "step"]
    minus = lambda f: kernels["step"].get(f, 0.0) - sum(v.get(f, 0.0) for v in parts)  # noqa: E731
    fams = set().union(*kernels.values()) - {"launches"}
    total = lambda v: sum(x for f, x in v.items() if f != "launches")  # noqa: E731
    return dict(by_family=dict(sorted(((f, minus(f)) for f in fams), key=lambda kv: -abs(kv[1]))),
                launches=minus("launches"), kernel_seconds_step=total(kernels["step"]),
                kernel_seconds_parts=sum(total(v) for v in parts))


def main(argv):
    del argv
    target, draft = models()
    rows = []
    bar = cli.bar([(int(B), name, prop) for B in FLAGS.batch for name in FLAGS.shapes for prop in FLAGS.proposals],
                  "step timings", unit="shape")
    for B, name, prop in bar:
        bar.set_postfix_str(f"B={B} {name} {prop}")
        r = time_step(target, draft, B, parse_shape(name), FLAGS.context, FLAGS.iters, profile=FLAGS.profile,
                      proposal=prop)
        sec = r["seconds"]
        r["accept_rewind_share"] = (sec["accept"] + sec.get("rewind", 0.0)) / sec["step"]
        if r.get("kernels", {}).get("step"):
            r["kernel_diff"] = kernel_diff(r["kernels"])
        rows.append(r)
        cli.write(f"B={B} {name} {prop}: step {r['seconds']['step'] * 1e3:.3f} ms, parts "
                  f"{r['sum_of_parts'] * 1e3:.3f} ms, ratio {r['step_over_parts']:.3f}, accept + rewind "
                  f"{r['accept_rewind_share']:.1%} of the step  " +
                  " ".join(f"{k}={v * 1e3:.3f}" for k, v in r["seconds"].items() if k != "step"))
        if "kernel_diff" in r:
            kd = r["kernel_diff"]
            cli.write(f"  kernel time: step {kd['kernel_seconds_step'] * 1e3:.3f} ms, parts "
                      f"{kd['kernel_seconds_parts'] * 1e3:.3f} ms; step - parts: launches {kd['launches']:+.0f}, " +
                      " ".join(f"{f}={v * 1e6:+.1f}us" for f, v in list(kd["by_family"].items())[:10]))
    rng = np.random.default_rng(0)
    V = target.config.vocab_size
    prompts = [rng.integers(0, V, 40).tolist(), rng.integers(0, V, 25).tolist()]
    a = decode(target, draft, prompts, 16, num_spec_tokens=3, eos_ids=(), prefill_chunk=64)
    b = decode(target, draft, [p[::-1] for p in prompts], 12, num_spec_tokens=3, eos_ids=(), prefill_chunk=64)
    result = dict(timing.device_info(), target=dict(layers=target.config.num_hidden_layers,
                                                    experts=target.config.num_local_experts,
                                                    hidden=target.config.hidden_size, vocab=V),
                  draft=dict(hidden=draft.config.hidden_size, mlp=draft.config.intermediate_size,
                             draft_vocab=draft.config.draft_vocab_size),
                  iters=FLAGS.iters, rows=rows, recompile_check=dict(
                      first_compile_seconds=a.metrics["compile_seconds"],
                      second_call_compile_seconds=b.metrics["compile_seconds"]))
    print(json.dumps(result["recompile_check"]))
    timing.write_json(FLAGS.out, result)


if __name__ == "__main__":
    cli.run(main)
