"""CPU smoke tests of the experiment scripts that decode, train and evaluate (decode.py, make_data.py,
train_target.py, train_draft.py, eval_pair.py, fr_spec.py), and every script's flag checks: flags
parse, output and JSON schema written. The benchmark scripts: tests/test_bench_scripts.py."""

import json
import os
import re
import sys

import numpy as np
import pytest
from experiment_runner import fails, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))  # the scripts, and their shared modules in experiments/lib


@pytest.mark.slow
def test_decode_main_job_on_embedded_default(tmp_path):
    path = tmp_path / "d.json"
    # the embedded trained pair, text in and out (float32 on CPU: decode == generate exactly)
    out = run("decode.py", "--prompt", "def f(x):\n    return", "--prompt", "import", "--max_new_tokens", "5",
              "--json_out", str(path))
    # each prompt from the start of a line, under a header; tau named; the batch in the speed line
    assert "--- prompt 1 (" in out and " tokens) ---\ndef f(x):\n    return\n--- output (5 tokens) ---\n" in out
    assert "--- prompt 2 (" in out and "decode: tau " in out and "accept rate" in out
    r = json.loads(path.read_text())
    # the speed line states what this run measured, and the note after it why a CPU gains little (no figures)
    speed = r["decode"]["metrics"]["tokens_per_second"] / r["baseline"]["metrics"]["tokens_per_second"]
    assert f"speculative / baseline throughput {speed:.2f}x at B=2; outputs identical: True" in out
    note = " ".join(out[out.index("note: "):].split())  # wrapped at 100 columns
    assert "compute-bound" in note and "memory-bound" in note and not re.search(r"\d", note), note
    assert r["decode"]["tokens"] == r["baseline"]["tokens"] and all(len(t) == 5 for t in r["decode"]["tokens"])
    assert r["decode"]["metrics"]["mean_accept_length"] >= 1.0
    # over the first 4 of 6 (fake CPU) devices: the same tokens
    mesh_path = tmp_path / "m.json"
    out = run("decode.py", "--prompt", "def f(x):\n    return", "--prompt", "import", "--max_new_tokens", "5",
              "--mesh", "model=2,data=2", "--experts", "tensor", "--nobaseline", "--repeats", "2", "--json_out",
              str(mesh_path),
              env={"XLA_FLAGS": "--xla_force_host_platform_device_count=6"})
    assert "sharded over {'data': 2, 'model': 2} (4 devices, 1 processes)" in out
    m = json.loads(mesh_path.read_text())
    assert m["decode"]["tokens"] == r["decode"]["tokens"] and m["mesh"] == {"data": 2, "model": 2, "processes": 1,
                                                                 "experts": "tensor", "mailbox": False}  # no GPUs
    assert m["decode"]["metrics"]["compile_seconds"] == 0.0  # the second run, reported, reused the executable


def test_bad_flags_stop_at_parse():
    # each stops when flags are parsed: before a model is built or a checkpoint loaded
    err = fails("bench.py", "--preset", "tiny", "--scenarios", "gates,bogus")
    assert "flag --scenarios=['gates', 'bogus']: expected names of single,gates,batch,large,sweep,stress" in err
    err = fails("bench_step.py", "--preset", "tiny", "--shapes", "chain3,nonsense")
    assert "flag --shapes=['chain3', 'nonsense']: draft shape 'nonsense': expected chainK or treeDxKnN" in err
    err = fails("eval_pair.py", "--speed_shapes", "tree3x4")
    assert "flag --speed_shapes=['tree3x4']: draft shape 'tree3x4': expected chainK or treeDxKnN" in err
    err = fails("fr_spec.py", "--corpus", "/nonexistent/corpus.npy")
    assert "flag --corpus=/nonexistent/corpus.npy: expected a readable file" in err
    err = fails("decode.py", "--mesh", "model=x")
    assert err.strip().endswith("error: --mesh: 'model=x', expected model=M,data=D with integers >= 1 "
                                "(each at most once)")
    err = fails("decode.py", "--mesh", "model=2")  # one CPU device here
    assert err.count("\n") == 1 and err.startswith("error: make_mesh: ") and "2" in err
    err = fails("decode.py", "--experts", "tensor")
    assert err.strip() == "error: --experts tensor: splits the experts over a mesh; pass --mesh", err
    err = fails("capacity.py", "--contexts=")  # an empty list is not a default
    assert "flag --contexts=[]: expected a non-empty list of positive integers" in err, err
    err = fails("bench_step.py", "--proposals", "deterministic,greedy")
    assert "flag --proposals=['deterministic', 'greedy']: expected deterministic, sample or both" in err, err
    err = fails("fr_spec.py", "--ks", "256,0")
    assert "flag --ks=['256', '0']: --ks: 0 must be >= 1" in err, err
    err = fails("bench.py", "--preset", "tiny", "--scenarios", "single", "--dense_rows", "batch4")
    assert err.strip() == "error: --dense_rows: ['batch4'] are not rows of --scenarios single (its rows: single)", err


def test_numeric_flags_state_their_range():
    # every integer and float flag of the scripts is checked when flags are parsed (a lower_bound or a
    # validator of its own), so a negative count or size stops a script in one line, not in a traceback
    # or a silent nonsense figure (bench_tp.py --context -1 once timed a step at context -1)
    import ast
    import glob

    unchecked = []
    for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py")) +
                       glob.glob(os.path.join(ROOT, "experiments", "lib", "*.py"))):
        calls = [c for c in ast.walk(ast.parse(open(path).read())) if isinstance(c, ast.Call)]
        validated = {c.args[0].value for c in calls if getattr(c.func, "attr", "") == "register_validator"
                     and isinstance(c.args[0], ast.Constant)}
        for c in calls:
            if getattr(c.func, "attr", "") in ("DEFINE_integer", "DEFINE_float"):
                name = c.args[0].value
                if name not in validated and not any(k.arg == "lower_bound" for k in c.keywords):
                    unchecked.append(f"{os.path.relpath(path, ROOT)}: --{name}")
    assert not unchecked, unchecked
    err = fails("bench_tp.py", "--iters", "0")
    assert "flag --iters=0: 0 is not a positive integer" in err, err


@pytest.mark.slow
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
              "--copy_bytes", "1000000", "--json_out", str(path), "--plot", str(png))
    r = json.loads(path.read_text())
    for k in ("command", "device", "jax_version", "date", "corpus", "prompts", "baseline_step_seconds", "rows"):
        assert k in r
    assert r["dtype"] == "float32"  # the default on a CPU (assets.default_dtype)
    assert r["corpus"]["source"] == "corpus" and r["corpus"]["tokens"] == 5000
    assert r["prompts"]["source"] == "eval_data" and r["prompts"]["lengths"] == [8, 8]
    assert [x["k"] for x in r["rows"]] == [64, "full"]
    assert [x["draft_vocab_size"] for x in r["rows"]] == [64, 2048]  # the embedded pair's draft vocab
    cov = [x["coverage"] for x in r["rows"]]
    assert all(a <= b for a, b in zip(cov, cov[1:], strict=False)) and cov[0] < 1.0
    for x in r["rows"]:
        assert x["identical"] is True and x["tau"] >= 1.0 and 0.0 <= x["accept_rate"] <= 1.0
        assert len(x["accept_rate_per_position"]) == 3
        assert x["head_seconds"] > 0 and x["step_seconds"] > 0 and x["projected_speedup"] > 0
    assert png.exists() or "matplotlib is not installed" in out


@pytest.mark.slow
def test_make_data_train_and_eval_pair(tmp_path):
    # the whole recipe of the shipped pair at toy size: corpus -> tokenizer -> target -> draft -> eval
    root = tmp_path / "lib"
    root.mkdir()
    for i in range(12):
        (root / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x * {j} + {i}\n\n" for j in range(40)))
    d, t, dr = tmp_path / "data", tmp_path / "target", tmp_path / "draft"
    run("make_data.py", "--root", str(root), "--out_dir", str(d), "--vocab_size", "300", "--eval_fraction", "0.2")
    common = ["--data_dir", str(d), "--steps", "3", "--batch", "2", "--seq_len", "32", "--log_every", "1",
              "--save_every", "2", "--warmup", "1"]
    run("train_target.py", "--size", "tiny", "--out_dir", str(t), "--eval_batches", "1", *common)
    log = json.loads((t / "train_log.json").read_text())
    assert [r["step"] for r in log["history"]] == [1, 2, 3] and "eval_loss" in log["history"][-1]
    assert json.loads((t / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    # train_target ran with its progress bar (the default); here --noprogress prints the logged records
    # (train_target's tiny target has 2 layers: the draft reads blocks 0 and 1)
    out = run("train_draft.py", "--target", str(t), "--out_dir", str(dr), "--draft_vocab", "128", "--aux_layer_ids",
              "0,1,1", "--ttt_length", "2", "--regenerate", "4", "--prompt_len", "8", "--regenerate_batch", "2",
              "--eval_batches", "1", "--noprogress", *common)
    assert "{'step': 3, 'loss': " in out
    assert [r["step"] for r in json.loads((dr / "train_log.json").read_text())["history"]] == [1, 2, 3]
    draft_config = json.loads((dr / "config.json").read_text())
    assert draft_config["draft_vocab_size"] == 128, draft_config
    assert draft_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1], draft_config
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[5, 6, 7, 8], [9, 10, 11]]))
    out = tmp_path / "e.json"
    # speed at B=2, both prompts: the acceptance pass's executables (generate, decode chain2) run again; and
    # so do the float32 check's (full-precision matmuls): the scripts run at that precision (experiment_runner's
    # CPU_ENV) and in float32, the default dtype on a CPU
    run("eval_pair.py", "--target", str(t), "--draft", str(dr), "--prompts_file", str(prompts), "--max_new_tokens",
        "6", "--shapes", "chain2", "--speed_batches", "2", "--speed_shapes", "chain2", "--repeats", "1",
        "--exact_check", "chain2", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["dtype"] == "float32"
    assert [a["shape"] for a in r["acceptance"]] == ["chain2"]
    assert all(a["identical"] and a["tau"] >= 1 for a in r["acceptance"]) and r["identical_float32"] == {"chain2": True}
    assert r["speed"][0]["speedup"] > 0


def test_gpu_only_script_refuses_cpu():
    assert "needs a GPU" in fails("attention_floor.py")
