"""gpt-oss-120b speculative-step benchmark against the byte roofline and the baseline, one process.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python experiments/bench.py --scenarios single,gates \
      --out experiments/results/bench_gpt-oss-120b_h200.json --plot experiments/results/bench.png

Random packed gpt-oss-120b and a random draft of the published EAGLE-3 shape (hidden 2880, MLP
17280, draft vocab 32000): acceptance is meaningless, so each scenario reports the baseline time
per token, the speculative step split into draft / verify / accept+rewind / extend (with --noparts
the whole step only), the byte roofline of each (experiments/lib/roofline.py, at the copy bandwidth
measured in this run; with --mesh the bytes one device reads, at one device's bandwidth), and the
projected speedup tau * T_base / T_step for the published gpt-oss-120b tau (2.29, 2.68, 3.22 at 3
draft tokens) and, with --tau_trained, a measured one.

Scenarios: single (B=1, 1K), gates (B=1 32K and B=4 16K, chain3: what gates.py reads), batch (B in
--batch_sizes, default 4, at 1K), large (B=1 at --large_contexts), sweep (B=1 at --sweep_context over
chains 1..5 and trees), stress (decode() end to end, B=16 ragged prompts, early eos).

On a mesh (--mesh): each row's "collectives" counts the collective operations of one baseline step
and one speculative step by kind (`timing.collectives`), and the JSON's "allreduce_seconds" gives
one XLA all-reduce of a [rows, hidden] bf16 array over "model" (rows 1, 4, 16, 64), timed in the
same run (`timing.allreduce_seconds`).

Kernels (--profile, GPU): each row's "kernels" holds, for the baseline token and the whole step,
the device seconds by kernel family (`timing.kernel_group`) and "launches" (kernels and device
copies an iteration), from the same loop compiled without CUDA graphs (the profiler cannot see
inside one); the printed line lists them in ms.

Memory: each row's "memory" holds, for the baseline and the step loop (and each part's loop), the
compiled program's buffers (`timing.program_memory`: argument, output, alias, temp, peak bytes) and
the device allocator's figures after its first call (`timing.memory_stats`), and the allocator's
figures after the row ("device": bytes_in_use, peak_bytes_in_use since the process started,
bytes_limit; None on CPU). The printed "peak" is the largest program peak of the row, and in
parentheses the device's peak in use so far (not on CPU).
"""

import json

import jax
import numpy as np
from absl import flags
from flax import nnx
from lib import cli, roofline, step_timing, timing
from lib.step_timing import parse_shape, random_pair, time_baseline, time_step, validate_shape_flags

from eagle3_jax import parallel
from eagle3_jax.models import gpt_oss
from eagle3_jax.spec import decode

step_timing.target_flags()
SCENARIOS = ["single", "gates", "batch", "large", "sweep", "stress"]
flags.DEFINE_list("scenarios", SCENARIOS, "which to run, of " + ",".join(SCENARIOS))
flags.DEFINE_list("large_contexts", ["16384", "32768", "131072"], "contexts of the large scenario")
flags.DEFINE_integer("sweep_context", 4096, "context of the sweep scenario", lower_bound=1)
flags.DEFINE_list("sweep_shapes", ["chain1", "chain2", "chain3", "chain4", "chain5", "tree3x4n8", "tree4x4n16"],
                  "shapes of the sweep")
flags.DEFINE_integer("short_context", 1024, "context of the single and batch scenarios", lower_bound=1)
flags.DEFINE_list("batch_sizes", ["4"], "batch sizes of the batch scenario (rows batch<B>)")
flags.DEFINE_integer("iters", 8, "steps per timed loop", lower_bound=1)
flags.DEFINE_integer("stress_new_tokens", 64, "new tokens a slot of the stress scenario", lower_bound=1)
flags.DEFINE_integer("stress_prompt_max", 1024, "the stress scenario's prompt lengths are drawn from [64, this)",
                     lower_bound=65)
flags.DEFINE_bool("parts", True, "also time the step's parts (draft, verify, accept+rewind, extend), each its own "
                  "loop; --noparts times the whole step and the baseline only (two loops a row, not six)")
flags.DEFINE_bool("profile", False, "also record, for the baseline token and the whole step, the device kernel seconds "
                  "by kernel family and the kernel launches (GPU; each row's \"kernels\")")
flags.DEFINE_integer("copy_bytes", 4 << 30, "buffer size of the copy-bandwidth measurement", lower_bound=1 << 10)
flags.DEFINE_list("dense_rows", [], "rows (by name) also timed with full-length sliding-layer caches, in the same "
                  "process (baseline and step; the library keeps rings)")
flags.DEFINE_float("tau_trained", None, "tau measured on a trained pair (projected alongside)", lower_bound=1.0)
flags.DEFINE_string("out", None, "JSON output path")
flags.DEFINE_string("plot", None, "PNG output path (needs matplotlib)")
flags.DEFINE_list("plot_from", None, "only draw --plot from these results JSONs (no benchmark)")
cli.progress_flag()
cli.mesh_flags()
FLAGS = flags.FLAGS
cli.positive_ints("batch_sizes", "large_contexts")
flags.register_validator("scenarios", lambda names: len(names) > 0 and set(names) <= set(SCENARIOS),
                         "expected names of " + ",".join(SCENARIOS))
validate_shape_flags("sweep_shapes")

ALLREDUCE_ROWS = (1, 4, 16, 64)  # message rows of the all-reduce timed on a mesh (decode and verify sizes)


def rows_for(name):
    s = FLAGS.short_context
    return {"single": [("single", 1, s, "chain3")],
            "gates": [("single-32k", 1, 32768, "chain3"), ("batch4-16k", 4, 16384, "chain3")],
            "batch": [(f"batch{int(b)}", int(b), s, "chain3") for b in FLAGS.batch_sizes],
            "large": [(f"large-{int(c) // 1024}k", 1, int(c), "chain3") for c in FLAGS.large_contexts],
            "sweep": [("sweep", 1, FLAGS.sweep_context, sh) for sh in FLAGS.sweep_shapes]}.get(name, [])


def peak_text(memory):
    """'peak X GiB' for a row's line: the largest peak of the row's compiled loops (parameters, state
    and temporaries), and where the device keeps figures its peak in use since the process started."""
    loops = [memory.get("baseline"), memory.get("step"), *memory.get("parts", {}).values()]
    peaks = [m["program"]["peak"] for m in loops if m and m.get("program")]
    text = f"peak {timing.gib(max(peaks, default=None))}"
    if memory.get("device") and "peak_bytes_in_use" in memory["device"]:
        text += f" (device {timing.gib(memory['device']['peak_bytes_in_use'])})"
    return text


def measure(target, draft, bw, name, B, context, shape_name, base_cache):
    shape = parse_shape(shape_name)
    if (B, context) not in base_cache:
        base_mem, base_kernels = {}, ({} if FLAGS.profile else None)
        t = time_baseline(target, B, context, FLAGS.iters, memory=base_mem, kernels=base_kernels)
        base_cache[(B, context)] = t, base_mem, base_kernels
    t_base, base_mem, base_kernels = base_cache[(B, context)]
    r = time_step(target, draft, B, shape, context, FLAGS.iters, parts=FLAGS.parts, profile=FLAGS.profile)
    sec = r["seconds"]
    split = dict(draft=sec["draft"], verify=sec["verify"], accept_rewind=sec["accept"] + sec.get("rewind", 0.0),
                 extend=sec["extend"]) if FLAGS.parts else {}
    per_device = mesh_axes(target)  # on a mesh: the bytes one device reads
    sb = roofline.step_bytes(target.config, draft.config, B, context, shape["depth"], shape["num_nodes"], **per_device)
    base_bytes = roofline.target_bytes(target.config, B, 1, context, **per_device)["total"]
    taus = list(roofline.PUBLISHED_TAU) + ([FLAGS.tau_trained] if FLAGS.tau_trained else [])
    memory = dict(baseline=base_mem, step=r["memory"]["step"],
                  parts={k: v for k, v in r["memory"].items() if k != "step"}, device=timing.memory_stats())
    row = dict(name=name, batch=B, context=context, shape=shape_name, **shape,
               baseline_seconds_per_token=t_base, step_seconds=dict(step=sec["step"], **split),
               bytes=dict(baseline=base_bytes, step=sb["total"], draft=sb["draft"], verify=sb["verify"],
                          extend=sb["extend"]),
               roofline_seconds=dict(baseline=base_bytes / bw, step=sb["total"] / bw, draft=sb["draft"] / bw,
                                     verify=sb["verify"] / bw, extend=sb["extend"] / bw),
               projected_speedup={f"{t:g}": t * t_base / sec["step"] for t in taus},
               roofline_speedup={f"{t:g}": t * base_bytes / sb["total"] for t in taus}, memory=memory,
               collectives=dict(baseline=base_mem.get("collectives"), step=r["memory"]["step"].get("collectives")))
    if name in FLAGS.dense_rows:  # the same row with full-length sliding-layer caches
        dense_mem = {}
        t_dense = time_baseline(target, B, context, FLAGS.iters, memory=dense_mem, sliding="dense")
        rd = time_step(target, draft, B, shape, context, FLAGS.iters, parts=False, sliding="dense")
        row["dense_sliding"] = dict(baseline_seconds_per_token=t_dense, step_seconds=rd["seconds"]["step"],
                                    memory=dict(baseline=dense_mem, step=rd["memory"]["step"]))
        cli.write(f"{name:<12} dense sliding caches: base {t_dense * 1e3:7.2f} ms  step "
                  f"{rd['seconds']['step'] * 1e3:7.2f} ms  {peak_text(row['dense_sliding']['memory'])}")
    if FLAGS.profile:
        row["kernels"] = dict(baseline=base_kernels, step=r["kernels"]["step"])
        cli.write(f"{name:<12} kernels: " + "; ".join(
            f"{k} {g.get('launches', 0):.0f} launches, " + ", ".join(
                f"{f} {v * 1e3:.3f}" for f, v in sorted(g.items(), key=lambda kv: -kv[1]) if f != "launches")[:300]
            for k, g in row["kernels"].items()))
    row["baseline_roofline_fraction"] = row["roofline_seconds"]["baseline"] / t_base
    row["step_roofline_fraction"] = row["roofline_seconds"]["step"] / sec["step"]
    cli.write(f"{name:<12} B={B:<2} ctx={context:<6} {shape_name:<10} base {t_base * 1e3:7.2f} ms "
          f"({row['baseline_roofline_fraction']:.0%} of roofline)  step {sec['step'] * 1e3:7.2f} ms "
          f"({row['step_roofline_fraction']:.0%}) " + "".join(f" {k} {v * 1e3:.2f}" for k, v in split.items()) +
          f"  proj@3.22 {row['projected_speedup']['3.22']:.2f}x roof@3.22 {row['roofline_speedup']['3.22']:.2f}x"
          f"  {peak_text(memory)}" + (f"  collectives base {sum(row['collectives']['baseline'].values())} step "
                                     f"{sum(row['collectives']['step'].values())}" if per_device else ""))
    return row


def mesh_axes(target) -> dict:
    """{"data": D, "model": M, "experts": the split of its experts} of the target's mesh
    (parallel.mesh_of), {} on one device: what `roofline` needs for the bytes one device reads."""
    mesh = parallel.mesh_of(nnx.state(target))
    if mesh is None:
        return {}
    return dict(data=mesh.shape["data"], model=mesh.shape["model"], experts=target.layers[0].mlp.expert_split)


def kv_bytes_per_token(target):
    """The target cache's bytes per token of context, one sequence: {"ring": the library's caches,
    "dense": every layer full length, "ring_fixed": the rings' own bytes, whatever the context}."""
    size = lambda n, m: jax.eval_shape(lambda: gpt_oss.init_cache(target, 1, n, max_step_tokens=m)).nbytes  # noqa: E731
    a, b = 1 << 16, 1 << 17
    per = (size(b, 128) - size(a, 128)) / (b - a)
    return dict(ring=per, dense=(size(b, b) - size(a, a)) / (b - a), ring_fixed=size(a, 128) - per * a)


def stress(target, draft):
    rng = np.random.default_rng(0)
    V = target.config.vocab_size
    hi = min(FLAGS.stress_prompt_max, target.config.max_position_embeddings - 64 - FLAGS.stress_new_tokens)
    prompts = [rng.integers(0, V, int(n)).tolist() for n in rng.integers(64, hi, 16)]
    eos = rng.choice(V, max(V // 100, 2), replace=False).tolist()  # ~1% of ids end a sequence: ragged stops
    out = decode(target, draft, prompts, FLAGS.stress_new_tokens, num_spec_tokens=3, eos_ids=eos,
                 prefill_chunk=min(512, hi))
    m = out.metrics
    lens = [len(t) for t in out.tokens]
    memory = dict(device=timing.memory_stats())
    cli.write(f"stress B=16: {m['generated_tokens']} tokens, {m['steps']} steps, {m['tokens_per_second']:.1f} tok/s, "
              f"lengths {min(lens)}..{max(lens)}  {peak_text(memory)}")
    return dict(name="stress", batch=16, lengths=lens, metrics=m, memory=memory)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    sweep = sorted((r for r in rows if r["name"] == "sweep"), key=lambda r: r["num_nodes"])
    if sweep:
        n = [r["num_nodes"] for r in sweep]
        ax[0].plot(n, [r["step_seconds"]["step"] * 1e3 for r in sweep], "o-", label="step (measured)")
        ax[0].plot(n, [r["roofline_seconds"]["step"] * 1e3 for r in sweep], "k--", label="byte roofline")
        ax[0].set(xlabel="tree nodes N (incl. root)", ylabel="ms", title=f"step vs N, B=1, {sweep[0]['context']} ctx")
        ax[0].legend()
    large = sorted((r for r in rows if r["name"].startswith(("large", "single"))), key=lambda r: r["context"])
    if large:
        c = [r["context"] for r in large]
        ax[1].plot(c, [r["step_seconds"]["step"] * 1e3 for r in large], "o-", label="spec step (chain3)")
        ax[1].plot(c, [r["baseline_seconds_per_token"] * 1e3 for r in large], "s-", label="baseline token")
        ax[1].plot(c, [r["roofline_seconds"]["step"] * 1e3 for r in large], "k--", label="step roofline")
        ax[1].plot(c, [r["roofline_seconds"]["baseline"] * 1e3 for r in large], "k:", label="baseline roofline")
        ax[1].set(xscale="log", xlabel="context (tokens)", ylabel="ms", title="B=1 vs context")
        ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    del argv
    if FLAGS.plot_from:
        rows = []
        for path in FLAGS.plot_from:
            with open(path) as f:
                rows += [r for r in json.load(f)["scenarios"] if "step_seconds" in r]
        plot(rows, FLAGS.plot)
        return
    work = [args for sc in FLAGS.scenarios for args in (["stress"] if sc == "stress" else rows_for(sc))]
    names = list(dict.fromkeys(args[0] for args in work if args != "stress"))
    unknown = [n for n in FLAGS.dense_rows if n not in names]
    if unknown:
        raise ValueError(f"--dense_rows: {unknown} are not rows of --scenarios {','.join(FLAGS.scenarios)} "
                         f"(its rows: {', '.join(names) or 'none'})")
    mesh = cli.setup_devices()
    data = 1 if mesh is None else mesh.shape["data"]
    uneven = [f"{args[0]} (batch {args[1]})" for args in work if args != "stress" and args[1] % data]
    if uneven:  # before the weights are made: the timed state's rows are split over "data"
        raise ValueError(f"--scenarios: rows {', '.join(uneven)} have a batch that is not a multiple of the "
                         f"mesh's data axis ({data}); choose scenarios or --batch_sizes that it divides")
    cfg = step_timing.target_config()
    target, draft = random_pair(cfg, mesh, FLAGS.experts)
    bw = timing.copy_bandwidth(FLAGS.copy_bytes)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows, base_cache = [], {}
    result = dict(timing.device_info(), preset=FLAGS.preset, layers=cfg.num_hidden_layers, copy_bandwidth=bw,
                  iters=FLAGS.iters,
                  kv_bytes_per_token=kv_bytes_per_token(target), num_devices=1 if mesh is None else mesh.size,
                  mesh=None if mesh is None else dict(mesh.shape, experts=FLAGS.experts),
                  num_processes=jax.process_count(),
                  tau_published=roofline.PUBLISHED_TAU, tau_trained=FLAGS.tau_trained, scenarios=rows)
    if mesh is not None and mesh.shape["model"] > 1:  # what one all-reduce of the residual costs, in this run
        result["allreduce_seconds"] = {str(n): timing.allreduce_seconds(mesh, n, cfg.hidden_size)
                                       for n in ALLREDUCE_ROWS}
        print("all-reduce of [rows, hidden] bf16 over model: " + ", ".join(
            f"{n} rows {t * 1e6:.1f} us" for n, t in result["allreduce_seconds"].items()), flush=True)
    bar = cli.bar(work, "scenarios", unit="row")
    for args in bar:
        bar.set_postfix_str(args if args == "stress" else f"{args[0]} {args[3]}")
        rows.append(stress(target, draft) if args == "stress" else measure(target, draft, bw, *args, base_cache))
        timing.write_json(FLAGS.out, result)  # after every row: a run cut short keeps what it measured
    timing.write_json(FLAGS.out, result)
    if FLAGS.plot:
        plot([r for r in rows if "step_seconds" in r], FLAGS.plot)


if __name__ == "__main__":
    cli.run(main)
