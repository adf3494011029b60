"""CPU smoke test of experiments/fr_spec.py on the embedded tiny pair: flags parse, JSON schema."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))


def run(script, *args):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), *args], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_eval_windows_avoid_eos():
    from fr_spec import eval_windows

    t = np.array([5, 6, 0, 7, 8, 9, 0, 3, 4, 5, 6, 0])
    w = eval_windows(t, 3, 3, eos_id=0, seed=1)
    assert len(w) == 3 and all(len(x) == 3 and 0 not in x for x in w)
    assert sorted(map(tuple, w)) == [(3, 4, 5), (4, 5, 6), (7, 8, 9)]  # the only eos-free windows


def test_fr_spec_writes_json(tmp_path):
    # two ks keep it near 30 s on 2 CPU cores: each k compiles its own decode and step (~7 s each)
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.npy"
    np.save(corpus, np.minimum(rng.zipf(1.3, 5000), 255).astype(np.int32))  # skewed: coverage grows with k
    evald = tmp_path / "eval.npy"
    np.save(evald, rng.integers(0, 256, 400).astype(np.int32))
    path, png = tmp_path / "fr.json", tmp_path / "fr.png"
    out = run("fr_spec.py", "--ks", "64,full", "--corpus", str(corpus), "--eval_data", str(evald),
              "--num_prompts", "2", "--prompt_len", "8", "--max_new_tokens", "6", "--context", "16", "--iters", "2",
              "--copy_bytes", "1000000", "--dtype", "float32", "--json_out", str(path), "--plot", str(png))
    r = json.loads(path.read_text())
    for k in ("command", "device", "jax_version", "date", "corpus", "prompts", "baseline_step_seconds", "rows"):
        assert k in r
    assert r["corpus"]["source"] == "corpus" and r["corpus"]["tokens"] == 5000
    assert r["prompts"]["source"] == "eval_data" and r["prompts"]["lengths"] == [8, 8]
    assert [x["k"] for x in r["rows"]] == [64, "full"]
    assert [x["draft_vocab_size"] for x in r["rows"]] == [64, 2048]  # the embedded pair's draft vocab
    cov = [x["coverage"] for x in r["rows"]]
    assert all(a <= b for a, b in zip(cov, cov[1:])) and cov[0] < 1.0
    for x in r["rows"]:
        assert x["identical"] is True and x["tau"] >= 1.0 and 0.0 <= x["accept_rate"] <= 1.0
        assert len(x["accept_rate_per_position"]) == 3
        assert x["head_seconds"] > 0 and x["step_seconds"] > 0 and x["projected_speedup"] > 0
    assert png.exists() or "matplotlib is not installed" in out
