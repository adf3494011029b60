"""The seed project's gates over a `bench.py` results JSON; exit code 1 when a gate fails, 2 when
the file is not a bench.py results JSON (a key missing).

  python experiments/gates.py --results experiments/results/bench_gpt-oss-120b_h200.json

Gate figure: projected speedup tau * T_base / T_step for the scenario's spec-3 chain, with the
seeds' own tau for that scenario (docs/reference.md 7). Beside it, the byte-roofline speedup
tau * bytes_base / bytes_step: verified tokens read the union of their experts, so on a MoE target
a gate may ask for more than the hardware allows; the reader sees which.
"""

import json
import sys

from absl import flags
from lib import cli

flags.DEFINE_string("results", None, "bench.py JSON", required=True)
FLAGS = flags.FLAGS

# (scenario name in bench.py, tree shape, the seeds' tau there, the speedup the gate asks for)
GATES = [("single-32k", "chain3", 3.22, 2.0), ("batch4-16k", "chain3", 3.08, 1.0)]


def _get(x, path: str, where: str):
    """x[k1][k2]... for path "k1.k2"; a missing key raises ValueError naming `where` and the path."""
    for k in path.split("."):
        if not isinstance(x, dict) or k not in x:
            raise ValueError(f"{where}: no key {path!r} (expected a bench.py results JSON)")
        x = x[k]
    return x


def evaluate(results: dict, source: str = "results") -> list[dict]:
    """A row per gate from a bench.py results dict (read from `source`, named in errors)."""
    rows, scenarios = [], _get(results, "scenarios", source)
    for scenario, shape, tau, need in GATES:
        r = next((x for i, x in enumerate(scenarios)
                  if _get(x, "name", f"{source} scenarios[{i}]") == scenario and x.get("shape") == shape), None)
        if r is None:
            rows.append(dict(gate=f"{scenario} {shape}", missing=True, passed=False, need=need))
            continue
        where = f"{source} scenario {scenario!r}"
        projected = tau * _get(r, "baseline_seconds_per_token", where) / _get(r, "step_seconds.step", where)
        roof = tau * _get(r, "bytes.baseline", where) / _get(r, "bytes.step", where)
        rows.append(dict(gate=f"{scenario} {shape}", tau=tau, need=need, projected=projected, roofline=roof,
                         passed=projected >= need, hardware_allows=roof >= need))
    return rows


def main(argv):
    del argv
    with open(FLAGS.results) as f:
        results = json.load(f)
    rows = evaluate(results, FLAGS.results)  # a missing key: ValueError, one line and exit 2 (cli.run)
    print(f"device {results.get('device')}, JAX {results.get('jax_version')}, {results.get('date')}")
    for r in rows:
        if r.get("missing"):
            print(f"{r['gate']:<22} MISSING from the results: FAIL")
            continue
        print(f"{r['gate']:<22} tau {r['tau']:.2f}: projected {r['projected']:.2f}x (need {r['need']:.1f}x) "
              f"{'PASS' if r['passed'] else 'FAIL'}; byte roofline allows {r['roofline']:.2f}x"
              + ("" if r["hardware_allows"] else " (the gate is above the hardware's limit)"))
    sys.exit(0 if all(r["passed"] for r in rows) else 1)


if __name__ == "__main__":
    cli.run(main, error_exitcode=2)
