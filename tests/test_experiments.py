"""CPU smoke tests of the experiment scripts: flags parse, output and JSON schema written."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))


def run(script, *args):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), *args], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_decode_main_job_on_embedded_default(tmp_path):
    path = tmp_path / "d.json"
    # the embedded trained pair, text in and out (float32 on CPU: decode == generate exactly)
    out = run("decode.py", "--prompt", "def f(x):\n    return", "--prompt", "import", "--max_new_tokens", "5",
              "--json_out", str(path))
    assert "prompt: def f(x):\n    return" in out and "outputs identical: True" in out
    r = json.loads(path.read_text())
    assert r["decode"]["tokens"] == r["baseline"]["tokens"] and all(len(t) == 5 for t in r["decode"]["tokens"])
    assert r["decode"]["metrics"]["mean_accept_length"] >= 1.0


def test_bench_baseline_writes_json(tmp_path):
    path = tmp_path / "r.json"
    run("bench_baseline.py", "--preset", "tiny", "--prompt_len", "20", "--new_tokens", "24", "--prefill_chunk", "8",
        "--repeats", "2", "--out", str(path))
    r = json.loads(path.read_text())
    for k in ("command", "device", "jax_version", "date", "prefill_seconds", "seconds_per_generated_token",
              "param_bytes", "memory_after_run"):
        assert k in r
    assert r["seconds_per_generated_token"] > 0 and r["preset"] == "tiny"


def test_bench_step_writes_json(tmp_path):
    path = tmp_path / "s.json"
    run("bench_step.py", "--preset", "tiny", "--context", "24", "--iters", "2", "--batch", "1", "--shapes",
        "tree2x2n4", "--out", str(path))
    r = json.loads(path.read_text())
    assert r["recompile_check"]["second_call_compile_seconds"] == 0.0
    (row,) = r["rows"]
    assert row["topk"] == 2 and row["seconds"]["step"] > 0 and row["sum_of_parts"] > 0
    assert set(row["seconds"]) == {"step", "draft", "verify", "accept", "rewind", "extend"}


def test_bench_and_gates(tmp_path):
    path = tmp_path / "b.json"
    run("bench.py", "--preset", "tiny", "--scenarios", "gates,sweep,stress", "--sweep_shapes", "tree2x2n4",
        "--sweep_context", "48", "--iters", "1", "--copy_bytes", "1000000", "--out", str(path))
    r = json.loads(path.read_text())
    names = [x["name"] for x in r["scenarios"]]
    assert names.count("sweep") == 1 and "single-32k" in names and "batch4-16k" in names and "stress" in names
    gate = next(x for x in r["scenarios"] if x["name"] == "single-32k")
    assert set(gate["step_seconds"]) == {"step", "draft", "verify", "accept_rewind", "extend"}
    assert gate["bytes"]["step"] > gate["bytes"]["baseline"] > 0 and "3.22" in gate["projected_speedup"]
    stress = next(x for x in r["scenarios"] if x["name"] == "stress")
    assert len(stress["lengths"]) == 16 and min(stress["lengths"]) < 64  # early eos ended some slots
    g = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "gates.py"), "--results", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert g.returncode in (0, 1) and "single-32k chain3" in g.stdout and "byte roofline allows" in g.stdout
    passed = all(x["projected"] >= x["need"] for x in __import__("gates").evaluate(r) if not x.get("missing"))
    assert g.returncode == (0 if passed else 1)
