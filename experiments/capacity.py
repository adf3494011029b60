"""The largest batch that runs, per context and step: the baseline decode step and a speculative step.

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python experiments/capacity.py --preset gpt-oss-120b \
      --contexts 8192,32768,131072 --modes baseline,chain3 --out experiments/results/capacity_h100.json

Random packed weights of --preset and a random draft of the published EAGLE-3 shape
(`lib.step_timing.random_pair`). For each context and mode ("baseline", or a draft shape such as
chain3), a trial at batch B builds the decode state at that context (`step_timing.noisy_states`: its
caches as decode allocates them) and times a few iterations of the step (`time_baseline`, or
`time_step` without its parts); a trial that runs out of device memory (an XLA RESOURCE_EXHAUSTED
error) fails, and everything it held is freed before the next one. The search starts at a
prediction: device memory free after the weights, less --margin of it for the program's
temporaries, over the bytes of one sequence's state (`step_timing.state_bytes`, caches first of
all); then it doubles B until a trial fails and bisects between the largest B that ran and the
smallest that failed, at most --max_trials trials a cell, within [--min_batch, --max_batch] and below
the largest batch whose state alone fits the free memory (reaching that one ends the cell: "state
bound"). Where the device reports no memory (CPU), the search starts at --min_batch; reaching
--max_batch ends it ("cap reached"). A cell that fails with an error other than running out of
memory is reported with that error (a row with "error") and the next cell runs.

`--mesh model=M,data=D` (and the jax.distributed flags, as bench.py's): the target created split
over the devices (`random_pair(cfg, mesh)`), the states laid out as decode's; batches are multiples
of D, and memory is per device (each device's share of the state against the first local device's
free memory). Steps sum over "model" with XLA's all-reduce, not the fused kernel (a run context without
a Mailbox, `step_timing.run_context(target, "xla")`: a trial that runs out of memory must fail, not
hang).

JSON: device_info (command included), num_devices and mesh, the preset, the memory after the
weights, and a row per
(context, mode): max_batch (0 if none ran), peak_bytes (the compiled step's peak at max_batch:
parameters, state and temporaries), failed_batch and failed_error (the smallest B that failed and
its error's first line, or None), predicted_batch, sequence_bytes (a sequence's state on one
device), note, and trials (each: batch,
ok, seconds per step, memory or error).
"""

import gc

import jax
from absl import flags
from lib import cli, step_timing, timing
from lib.step_timing import (
    baseline_plan,
    parse_shape,
    random_pair,
    run_context,
    state_sizes,
    step_plan,
    time_baseline,
    time_step,
)

step_timing.target_flags()
flags.DEFINE_list("contexts", ["8192", "32768", "131072"], "committed tokens per sequence")
flags.DEFINE_list("modes", ["baseline", "chain3"], "baseline, or draft shapes (chainK, treeDxKnN)")
flags.DEFINE_integer("max_trials", 6, "trials per (context, mode) cell")
flags.DEFINE_integer("iters", 2, "steps per timed loop of a trial", lower_bound=1)
flags.DEFINE_integer("min_batch", 1, "smallest batch tried")
flags.DEFINE_integer("max_batch", 1024, "largest batch tried (reached: the cell ends with 'cap reached')",
                     lower_bound=1)
flags.DEFINE_float("margin", 0.1, "fraction of the free device memory the prediction leaves to temporaries")
flags.DEFINE_string("out", None, "JSON output path")
cli.progress_flag()
cli.mesh_flags()
FLAGS = flags.FLAGS


def _parse_modes(modes):
    if not modes:
        raise ValueError("expected baseline or draft shapes, at least one")
    for m in modes:
        if m != "baseline":
            try:
                parse_shape(m)
            except ValueError as e:
                raise ValueError(f"mode {m!r}: expected baseline or a draft shape: {e}") from e


cli.check_with("modes", _parse_modes)
cli.positive_ints("contexts")
flags.register_validator("max_trials", lambda n: n >= 1, "expected >= 1")
flags.register_validator("min_batch", lambda n: n >= 1, "expected >= 1")
flags.register_validator("margin", lambda m: 0 <= m < 1, "expected a fraction in [0, 1)")


def free_device() -> None:
    """Drops what JAX keeps between calls (compiled executables, traces) and collects garbage, so that
    the arrays of a failed trial (held by its traceback's frames) are gone before the next one."""
    jax.clear_caches()
    gc.collect()


def trial(target, draft, B, context, mode, need):
    """One batch size: {batch, ok, seconds (per step), memory (loop_time's: program and device), left}
    or {batch, ok False, error (first line), left} when the device ran out of memory, or {batch, ok
    False, error, ran False} without running when the state alone (`need` bytes a device) is larger
    than the device's free memory (an allocation that cannot succeed would otherwise still compile the
    step first). Steps sum over "model" through XLA's all-reduce (an out-of-memory trial must fail,
    not hang in the fused kernel). left: after the trial, the first device's bytes in use (None on
    CPU) and those live arrays hold. Other errors propagate."""
    mem = timing.memory_stats()
    if mem and "bytes_limit" in mem and need > mem["bytes_limit"] - mem["bytes_in_use"]:
        return dict(batch=B, ok=False, ran=False, error=f"state {timing.gib(need)} > "
                    f"{timing.gib(mem['bytes_limit'] - mem['bytes_in_use'])} free (not run)")
    ctx = run_context(target, "xla")
    try:
        if mode == "baseline":
            memory = {}
            seconds = time_baseline(target, B, context, FLAGS.iters, memory=memory, ctx=ctx)
        else:
            r = time_step(target, draft, B, parse_shape(mode), context, FLAGS.iters, parts=False, ctx=ctx)
            seconds, memory = r["seconds"]["step"], r["memory"]["step"]
        out = dict(batch=B, ok=True, seconds=seconds, memory=memory)
    except jax.errors.JaxRuntimeError as e:
        if not timing.is_oom(e):
            raise
        out = dict(batch=B, ok=False, error=timing.first_line(e))
    free_device()
    # what stays allocated for the next trial, and how much of it live arrays hold (a failed trial's
    # state once stayed allocated on 2 H200s: docs/perf/multi_gpu.md)
    out["left"] = dict(bytes_in_use=(timing.memory_stats() or {}).get("bytes_in_use"),
                       live_array_bytes=timing.live_array_bytes())
    return out


def predict(free_bytes, seq_bytes):
    """Batch that the free device memory holds, --margin of it kept for temporaries; None if unknown."""
    if free_bytes is None or seq_bytes <= 0:
        return None
    return int(free_bytes * (1 - FLAGS.margin) // seq_bytes)


def search(run, start, lo_bound, hi_bound, max_trials, known_bad=None):
    """The largest B in [lo_bound, hi_bound] for which run(B)["ok"], by trials: start (clamped), then
    doubling while trials run (up to hi_bound), halving while they fail (down to lo_bound), and
    bisection between the largest B that ran and the smallest that failed; at most max_trials calls.
    known_bad: a B known to fail without a trial (bisection starts below it at once).
    Returns (largest ok B or 0, smallest failed B or None, trials in order, note)."""
    trials, ok, bad = [], 0, known_bad
    B = min(max(start, lo_bound), hi_bound)
    while len(trials) < max_trials:
        t = run(B)
        trials.append(t)
        if t["ok"]:
            ok = max(ok, B)
        else:
            bad = B if bad is None else min(bad, B)
        if bad is None:
            if ok >= hi_bound:
                return ok, bad, trials, "cap reached"
            B = min(2 * ok, hi_bound)
        elif ok == 0:
            if bad <= lo_bound:
                return ok, bad, trials, "min_batch failed"
            B = max(bad // 2, lo_bound)
        else:
            if bad - ok <= 1:
                return ok, bad, trials, "exact"
            B = (ok + bad) // 2
    return ok, bad, trials, "trials exhausted"


def state_bound(fits, hi):
    """The largest B in [1, hi] with fits(B) (fits monotone: the state's bytes grow with B), or 0."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def cell(target, draft, context, mode, free_bytes, mesh=None):
    """One (context, mode) row. Where the device reports its free memory, the search's upper end is the
    largest batch whose state alone fits it (no trial above it could allocate its caches): reaching it
    ends the cell with note "state bound" and the next batch as failed_batch (not run). On a mesh
    (--mesh) batches are multiples of its data axis (the search counts in those units), and memory
    is per device: the first local device's free memory against each device's share of the state."""
    plan = baseline_plan(context) if mode == "baseline" else step_plan(draft, parse_shape(mode), context)
    unit = 1 if mesh is None else mesh.shape["data"]
    sizes = state_sizes(target, None if mode == "baseline" else draft, plan, mesh=mesh)
    state = lambda n: sizes(n * unit)  # noqa: E731  n units
    seq_bytes = state(1) / unit
    predicted = predict(free_bytes, state(1))
    start = predicted if predicted else -(-FLAGS.min_batch // unit)
    lo, hi, known_bad, bound_error = -(-FLAGS.min_batch // unit), FLAGS.max_batch // unit, None, None
    if free_bytes is not None:
        fit = state_bound(lambda n: state(n) <= free_bytes, hi)
        if fit < hi:
            hi = max(fit, lo)
            known_bad = hi + 1
            bound_error = f"state {timing.gib(state(known_bad))} > {timing.gib(free_bytes)} free (not run)"
    best, bad, trials, note = search(lambda n: trial(target, draft, n * unit, context, mode, state(n)), start, lo,
                                     hi, FLAGS.max_trials, known_bad)
    failed = next((t for t in trials if not t["ok"] and t["batch"] == (bad or 0) * unit), None)
    if bad is not None and bad == known_bad:
        failed = dict(error=bound_error)
        note = "state bound" if best == hi else note
    at_best = next((t for t in trials if t["ok"] and t["batch"] == best * unit), None)
    program = (at_best or {}).get("memory", {}).get("program") or {}
    return dict(context=context, mode=mode, max_batch=best * unit, peak_bytes=program.get("peak"),
                seconds_at_max=at_best["seconds"] if at_best else None,
                failed_batch=None if bad is None else bad * unit, failed_error=failed["error"] if failed else None,
                predicted_batch=None if predicted is None else predicted * unit, sequence_bytes=seq_bytes, note=note,
                trials=trials)


def held_after(trials, after_weights, slack=1 << 30) -> str | None:
    """A warning when the device holds more than `slack` bytes beyond what it held after the weights
    once the cell's last trial that ran is over (later cells then see less free memory), else None."""
    left = next((t["left"] for t in reversed(trials) if "left" in t), None)
    if not left or left["bytes_in_use"] is None or not after_weights:
        return None
    extra = left["bytes_in_use"] - after_weights["bytes_in_use"]
    if extra <= slack:
        return None
    return (f"{timing.gib(extra)} more in use than after the weights once this cell is over (live arrays hold "
            f"{timing.gib(left['live_array_bytes'])}): later cells see less free memory")


def main(argv):
    del argv
    if FLAGS.max_batch < FLAGS.min_batch:
        raise ValueError(f"--max_batch {FLAGS.max_batch} is below --min_batch {FLAGS.min_batch}")
    mesh = cli.setup_devices()
    target, draft = random_pair(step_timing.target_config(), mesh, FLAGS.experts)
    jax.block_until_ready((jax.tree.leaves(target), jax.tree.leaves(draft)))
    mem = timing.memory_stats()
    free = mem["bytes_limit"] - mem["bytes_in_use"] if mem and "bytes_limit" in mem else None
    rows = []
    result = dict(timing.device_info(), num_devices=1 if mesh is None else mesh.size,
                  mesh=None if mesh is None else dict(mesh.shape, experts=FLAGS.experts),
                  preset=FLAGS.preset, layers=target.config.num_hidden_layers, iters=FLAGS.iters, margin=FLAGS.margin,
                  min_batch=FLAGS.min_batch, max_batch_bound=FLAGS.max_batch, max_trials=FLAGS.max_trials,
                  memory_after_weights=mem, free_bytes=free, rows=rows)
    cli.write(f"{FLAGS.preset}: {timing.gib(mem['bytes_in_use']) if mem else '-'} in use after the weights, "
              f"{timing.gib(free)} free")
    work = [(int(c), m) for c in FLAGS.contexts for m in FLAGS.modes]
    bar = cli.bar(work, "cells", unit="cell")
    for context, mode in bar:
        bar.set_postfix_str(f"ctx={context} {mode}")
        try:
            r = cell(target, draft, context, mode, free, mesh)
        except Exception as e:  # noqa: BLE001 -- a cell that cannot run at all is reported; the others still run
            rows.append(dict(context=context, mode=mode, error=f"{type(e).__name__}: {timing.first_line(e)}"))
            cli.write(f"ctx={context:<7} {mode:<9} error: {rows[-1]['error']}")
            timing.write_json(FLAGS.out, result)
            free_device()
            continue
        rows.append(r)
        tried = ",".join(f"{t['batch']}{'' if t['ok'] else 'x'}" for t in r["trials"])
        step = f"{r['seconds_at_max'] * 1e3:.2f} ms/step" if r["seconds_at_max"] is not None else "-"
        cli.write(f"ctx={context:<7} {mode:<9} max B {r['max_batch']:<5} peak {timing.gib(r['peak_bytes'])}  {step}  "
                  f"failed {r['failed_batch'] if r['failed_batch'] is not None else '-'}  "
                  f"predicted {r['predicted_batch'] if r['predicted_batch'] is not None else '-'}  "
                  f"{r['note']}  trials {tried}"
                  + (f"\n  {r['failed_error']}" if r["failed_error"] else ""))
        kept = held_after(r["trials"], mem)
        if kept:
            cli.write(f"  {kept}")
        timing.write_json(FLAGS.out, result)  # after every cell: a run cut short keeps what it found
    timing.write_json(FLAGS.out, result)


if __name__ == "__main__":
    cli.run(main)
