"""The benchmark harness's memory: a timed loop holds the caller's carry once (donated, never copied),
a timed function closing over a large array is refused, and experiments/capacity.py's search
reports memory (bench.py's per-row "memory": tests/test_bench_scripts.py::test_bench_and_gates)."""

import json
import math
import os
import sys
import types

import experiment_runner
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from lib import step_timing


def script(name, *args, env=()):
    """Runs experiments/<name> on CPU from experiments/ (as its README shows); returns stdout."""
    return experiment_runner.run(name, *args, env=env, cwd=os.path.join(ROOT, "experiments"), timeout=300)


def live_bytes():
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


def test_loop_time_takes_over_its_carry_and_copies_nothing():
    graphdef, params = nnx.split(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    zero = jnp.zeros((), jnp.int32)  # one array at two leaves, as Counters.zeros makes them
    cache = jnp.zeros((4, 1 << 18), jnp.float32)  # 4 MiB
    carry = dict(cache=cache, a=zero, b=zero)

    def fn(m, c, bias, ctx):  # a timed function takes the run context last, as spec/step.py's parts do
        return dict(cache=c["cache"] + bias, a=c["a"] + 1, b=c["b"])

    bias = jnp.ones((1 << 18,), jnp.float32)
    before = live_bytes()
    memory = {}
    seconds, kernels = step_timing.loop_time(graphdef, params, fn, carry, 2, memory=memory, args=(bias,))
    assert math.isfinite(seconds) and kernels == {}  # noise on CPU may make it <= 0
    assert cache.is_deleted() and zero.is_deleted() and not bias.is_deleted()
    assert live_bytes() <= before - cache.nbytes + 1024  # the loop's carry went with it; nothing kept
    p = memory["program"]
    assert p["alias"] >= cache.nbytes  # the cache is updated in the donated buffer ...
    assert p["temp"] < cache.nbytes and p["peak"] < 2 * cache.nbytes  # ... with no copy of it beside
    assert memory["device"] is None or memory["device"]["bytes_in_use"] > 0
    del carry


def test_profile_runs_the_loop_without_loop_graphs(monkeypatch):
    """Where decode's programs compile with options (loops as CUDA graphs on a GPU, which hide their
    kernels from the profiler), the timed loop takes them and the profiled one XLA's defaults."""
    from eagle3_jax.pallas import select

    monkeypatch.setattr(select, "compiler_options", lambda platform=None: dict(select.LOOP_GRAPHS))
    seen, compile_call = [], step_timing.compile_call

    def spy(*a, options=None, **kw):
        seen.append(("compile", options))
        exe = compile_call(*a, options=options, **kw)
        return lambda *args: (seen.append(("ran", options)), exe(*args))[1]

    monkeypatch.setattr(step_timing, "compile_call", spy)
    monkeypatch.setattr(step_timing.timing, "kernel_records",
                        lambda thunk, repeats: [jax.block_until_ready(thunk()) is not None and ("fusion.1", 0, 4000)])
    graphdef, params = nnx.split(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    _, kernels = step_timing.loop_time(graphdef, params, lambda m, c, ctx: m(c), jnp.ones((2, 4)), 2, profile=True)
    k = seen.index(("compile", {}))
    assert seen[0] == ("compile", None) and k > 1 and seen[k:] == [("compile", {}), ("ran", {}), ("ran", {})]
    assert all(e == ("ran", None) for e in seen[1:k])  # every timed call: decode's options; warm + profile: XLA's
    assert kernels["launches"] == 0.5 and kernels[step_timing.timing.kernel_group("fusion.1")] == pytest.approx(2e-6)
    seen.clear()
    step_timing.loop_time(graphdef, params, lambda m, c, ctx: m(c), jnp.ones((2, 4)), 2)
    assert [e for e in seen if e[0] == "compile"] == [("compile", None)]  # no profile: one executable


def test_closed_over_array_is_refused():
    graphdef, params = nnx.split(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    big = jnp.ones((1 << 19,), jnp.float32)  # 2 MiB, above MAX_CAPTURED_BYTES

    with pytest.raises(RuntimeError, match=r"closes over arrays float32\[524288\] \(2097152 bytes\): pass them"):
        step_timing.loop_time(graphdef, params, lambda m, c, ctx: c + big[:4].sum(), jnp.zeros((4,)), 1)
    x = jnp.zeros((4,))
    step_timing.loop_time(graphdef, params, lambda m, c, big, ctx: c + big[:4].sum(), x, 1, args=(big,))  # as argument
    assert x.is_deleted() and not big.is_deleted()


def test_capacity_search_doubles_then_bisects(tmp_path):
    # the search alone (capacity.py imported in a script process of its own: its flags would clash with
    # other scripts')
    code = f"""
import sys
sys.path.insert(0, {os.path.join(ROOT, "experiments")!r})
import capacity
fits = lambda B: dict(batch=B, ok=B <= 37)
for start in (1, 30, 100):
    best, bad, trials, note = capacity.search(fits, start, 1, 1000, 20)
    print(best, bad, [t["batch"] for t in trials], note)
print(capacity.search(fits, 1, 1, 16, 20)[::3], capacity.search(fits, 50, 40, 99, 20)[::3])
print(capacity.search(fits, 1, 1, 1000, 3)[:2])
print(capacity.search(fits, 30, 1, 40, 20, known_bad=41)[::3], capacity.search(fits, 20, 1, 35, 20, 36)[:2])
print(capacity.state_bound(lambda B: 3 * B <= 100, 1000), capacity.state_bound(lambda B: False, 10),
      capacity.state_bound(lambda B: True, 10))
G, weights = 1 << 30, dict(bytes_in_use=34 << 30)  # the warning on memory a cell leaves held (last trial that ran)
trials = [dict(left=dict(bytes_in_use=130 * G, live_array_bytes=32 * G)), dict(ran=False)]
print(capacity.held_after(trials, weights))
print(capacity.held_after([dict(left=dict(bytes_in_use=35 * G, live_array_bytes=32 * G))], weights),
      capacity.held_after([dict(left=dict(bytes_in_use=None, live_array_bytes=1))], None))
"""
    path = tmp_path / "search.py"
    path.write_text(code)
    out = experiment_runner.execute(str(path), env={**os.environ, **experiment_runner.CPU_ENV}, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "37 38 [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37] exact",
        "37 38 [30, 60, 45, 37, 41, 39, 38] exact",
        "37 38 [100, 50, 25, 37, 43, 40, 38] exact",
        "(16, 'cap reached') (0, 'min_batch failed')",
        "(4, None)",
        "(37, 'exact') (35, 36)",
        "33 0 10",
        "96.00 GiB more in use than after the weights once this cell is over (live arrays hold 32.00 GiB): later "
        "cells see less free memory",
        "None None",
    ]


@pytest.mark.slow
def test_capacity_writes_rows(tmp_path):
    # four fake CPU devices, data=2: batches 2 and 4 (multiples of the data axis; the search itself:
    # test_capacity_search_doubles_then_bisects), both modes in one run, memory per device
    path = tmp_path / "cap.json"
    out = script("capacity.py", "--preset", "tiny", "--layers", "2", "--contexts", "64", "--modes", "baseline,chain3",
                 "--mesh", "model=2,data=2", "--max_batch", "4", "--max_trials", "3", "--out", str(path),
                 "--noprogress", env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    r = json.loads(path.read_text())
    for k in ("command", "device", "jax_version", "date", "preset", "memory_after_weights", "rows"):
        assert k in r
    assert r["num_devices"] == 4 and r["mesh"] == {"data": 2, "model": 2, "experts": "tensor"}
    assert [(x["context"], x["mode"]) for x in r["rows"]] == [(64, "baseline"), (64, "chain3")]
    for x in r["rows"]:  # no out-of-memory on CPU: the cap ends the search
        assert (x["max_batch"], x["note"], x["failed_batch"], x["failed_error"]) == (4, "cap reached", None, None)
        assert [t["batch"] for t in x["trials"]] == [2, 4] and all(t["ok"] for t in x["trials"])
        assert x["peak_bytes"] == x["trials"][-1]["memory"]["program"]["peak"] > x["sequence_bytes"] * 2
        assert all(math.isfinite(t["seconds"]) for t in x["trials"])
        # after each trial only the models stay: the same live bytes, whatever the batch (none in use on CPU)
        left = [t["left"] for t in x["trials"]]
        assert all(a == {"bytes_in_use": None, "live_array_bytes": left[0]["live_array_bytes"]} for a in left), left
        assert left[0]["live_array_bytes"] > 0
    assert x["sequence_bytes"] > r["rows"][0]["sequence_bytes"]  # chain3 adds the draft's cache
    assert out.count("max B 4 ") == 2 and "cap reached" in out
    # a device's share: the target's caches over 4 devices, the draft's and the rows' over 2
    t, d = step_timing.random_pair(step_timing.preset_config("tiny", 2))
    plan = step_timing.step_plan(d, step_timing.parse_shape("chain3"), 64)
    whole = step_timing.state_bytes(t, d, 2, 64, plan)
    per = step_timing.state_bytes(t, d, 2, 64, plan, mesh=types.SimpleNamespace(shape={"data": 2, "model": 2}))
    assert x["sequence_bytes"] == per / 2 and whole / 4 < per < whole / 2
