"""CPU smoke tests of the benchmark scripts (bench.py and gates.py, bench_tp.py, bench_step.py,
bench_baseline.py, the kernel benchmarks bench_moe.py, bench_gemv.py, bench_spec_ops.py and
bench_attention.py, bench_allreduce.py, bench_reduce_norm.py) and their shared modules in
experiments/lib: flags parse, output and JSON schema written."""

import dataclasses
import json
import os
import re
import sys

import numpy as np
import pytest
from experiment_runner import CPU_ENV, execute, fails, run
from jax.sharding import AbstractMesh

from eagle3_jax import parallel
from eagle3_jax.models import GptOssConfig
from eagle3_jax.pallas import moe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))  # the scripts, and their shared modules in experiments/lib
# The smoke runs build the tiny preset with 2 layers (--layers 2: one sliding and one full layer), compiling in
# about two thirds of the time of its 4; TINY is that target
TINY = GptOssConfig.preset("tiny").replace(num_hidden_layers=2, layer_types=())


@pytest.mark.slow
def test_bench_on_a_mesh(tmp_path):
    # two fake CPU devices: the target created split over them (whole experts a device; decode.py's and
    # capacity.py's tests split every expert's units), the timed states laid out as decode's. The shapes
    # are test_bench_tp_rows's at tp 2 (B=1, context 64, chain3): its programs come from the compilation cache
    path = tmp_path / "m.json"
    run("bench.py", "--preset", "tiny", "--layers", "2", "--mesh", "model=2", "--experts", "expert", "--scenarios",
        "single",
        "--short_context", "64", "--iters", "1", "--copy_bytes", "1000000", "--out", str(path),
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    r = json.loads(path.read_text())
    row = r["scenarios"][0]
    assert r["num_devices"] == 2 and r["mesh"] == {"data": 1, "model": 2, "experts": "expert"}
    assert row["step_seconds"]["step"] > 0 and set(row["step_seconds"]) == {"step", "draft", "verify",
                                                                               "accept_rewind", "extend"}
    assert set(row["memory"]["parts"]) == {"draft", "verify", "accept", "extend"}
    from lib import roofline  # the roofline of one device: its half of the split weights and K/V

    cfg = TINY
    assert r["layers"] == 2 and row["bytes"]["baseline"] == roofline.target_bytes(cfg, 1, 1, row["context"], model=2,
                                                             experts="expert")["total"] < \
        roofline.target_bytes(cfg, 1, 1, row["context"])["total"]
    # a layer's 2 all-reduces (o_proj's, the MoE's psum) in each step; no all-gather a layer (each device
    # projects its own heads' q|k|v: parallel.align_heads), a few for the argmax over the split vocabulary
    n_layers = cfg.num_hidden_layers
    for loop in ("baseline", "step"):
        c = row["collectives"][loop]
        assert c["all-gather"] < n_layers and c["all-reduce"] >= 2 * n_layers and c["collective-permute"] == 0, c
    assert set(r["allreduce_seconds"]) == {"1", "4", "16", "64"} and all(t > 0 for t in r["allreduce_seconds"].values())
    # a batch-1 row on a data axis of 2: refused before any weights are made, in one line
    err = fails("bench.py", "--preset", "tiny", "--mesh", "data=2", "--scenarios", "single,batch", "--batch_sizes",
                "2,3", env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert err.strip() == ("error: --scenarios: rows single (batch 1), batch3 (batch 3) have a batch that is not "
                           "a multiple of the mesh's data axis (2); choose scenarios or --batch_sizes that it "
                           "divides"), err


def test_busiest_device_experts_by_enumeration():
    # expert parallel: the expected most routed experts one device holds, against every routed set
    import itertools

    from lib import roofline

    for E, M, d in ((8, 2, 3), (8, 4, 3), (12, 3, 5), (8, 2, 8), (8, 4, 1)):
        cfg = GptOssConfig.preset("tiny").replace(num_local_experts=E, num_experts_per_tok=2)
        sets = list(itertools.combinations(range(E), d))
        want = sum(max(sum(1 for e in s if e // (E // M) == g) for g in range(M)) for s in sets) / len(sets)
        assert roofline.busiest_experts(cfg, d, M) == pytest.approx(want), (E, M, d)
    cfg = GptOssConfig.preset("gpt-oss-120b")  # a token's 4 of 128: 2.74 on the busier of 2, 2.11 of 4
    assert round(roofline.busiest_experts(cfg, 4, 2), 2) == 2.74
    assert round(roofline.busiest_experts(cfg, 4, 4), 2) == 2.11
    assert roofline.busiest_experts(cfg, 4.5, 2) == pytest.approx((roofline.busiest_experts(cfg, 4, 2)
                                                                   + roofline.busiest_experts(cfg, 5, 2)) / 2)
    assert roofline.busiest_experts(cfg, 3.5, 1) == 3.5


def test_bench_reduce_norm_needs_gpus():
    # the fused kernel has no CPU path: one line naming what is missing, and bad flags refused
    want = "error: bench_reduce_norm: needs a GPU (the kernel has no CPU path), found none"
    assert want in fails("bench_reduce_norm.py", "--tp", "2")
    assert "--rows" in fails("bench_reduce_norm.py", "--rows", "0", code=1)
    assert "--parts: a list of positive integers or auto" in fails("bench_reduce_norm.py", "--parts", "1,two", code=1)


def test_reduce_timing_reference(tmp_path):
    # the reduction benchmarks' reference programs on a one-device "model" axis: s = bf16(x + r) and
    # y its RMSNorm times the scale; the timed loop feeds each call's outputs to the next
    import jax
    import jax.numpy as jnp
    from lib import reduce_timing

    from eagle3_jax import parallel

    mesh = parallel.make_mesh(model=1, devices=jax.devices()[:1])
    args = reduce_timing.inputs(mesh, 3, 128, np.random.default_rng(0))
    once, loop = reduce_timing.fused(mesh, False, chain=2)
    s, y = (np.asarray(a, np.float64)[0] for a in once(*args))
    x, r, w = (np.asarray(a, np.float64) for a in args)
    want = np.asarray(jnp.asarray((x[0] + r).astype(np.float32), jnp.bfloat16), np.float64)
    np.testing.assert_array_equal(s, want)
    norm = want / np.sqrt(np.mean(want ** 2, axis=-1, keepdims=True) + reduce_timing.EPS) * w
    np.testing.assert_allclose(y, norm, rtol=2 ** -7, atol=1e-2)
    out = np.asarray(loop(*args, jnp.int32(2)), np.float32)
    assert out.shape == (1, 3, 128) and np.isfinite(out).all() and not np.array_equal(out[0], y)
    assert np.isfinite(reduce_timing.per_call(loop, args, iters=2, chain=2))
    # feed "direct": the next partial is y itself (one call: s1 = bf16(y + s), y1 its norm); "scaled"
    # multiplies it by the device's factor ((0 + 1) / 1 here: the same values through f32)
    for feed in reduce_timing.FEEDS:
        _, one = reduce_timing.fused(mesh, False, chain=1, feed=feed)
        s1 = np.asarray(jnp.asarray((y + s).astype(np.float32), jnp.bfloat16), np.float64)
        want = s1 / np.sqrt(np.mean(s1 ** 2, axis=-1, keepdims=True) + reduce_timing.EPS) * w
        np.testing.assert_allclose(np.asarray(one(*args, jnp.int32(1)), np.float64)[0], want, rtol=2 ** -6, atol=2e-2)
    with pytest.raises(ValueError, match="feed 'both', expected one of"):
        reduce_timing.fused(mesh, False, feed="both")


@pytest.mark.slow
def test_bench_tp_rows(tmp_path):
    # tp 1 and 2 over two fake CPU devices: a row each, the ratio against tp 1 of the same run; the experts
    # split "expert" (whole experts a device), as test_bench_on_a_mesh splits them at the same shapes
    from lib import roofline

    path = tmp_path / "tp.json"
    out = run("bench_tp.py", "--preset", "tiny", "--layers", "2", "--tp", "1,2", "--batch_sizes", "1", "--context",
              "64", "--iters", "1", "--allreduce_rows", "1,4", "--copy_bytes", "1000000", "--profile", "--experts",
              "expert", "--shares", "2", "--noprogress", "--out", str(path),
              env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    r = json.loads(path.read_text())
    assert r["num_devices"] == 2 and [(x["tp"], x["batch"], x["experts"]) for x in r["rows"]] == [
        (1, 1, None), (2, 1, "expert")]
    for x in r["rows"]:
        assert x["ms_per_token"] > 0 and x["step_ms"] > 0 and 0 < x["roofline_fraction"]
        nbytes = roofline.target_bytes(TINY, 1, 1, 64, model=x["tp"],
                                       experts=x["experts"] or "expert")["total"]
        assert x["roofline_fraction"] == pytest.approx(nbytes / r["copy_bandwidth"] / (x["ms_per_token"] / 1e3))
        assert x["tokens_per_second"] == pytest.approx(x["batch"] / x["ms_per_token"] * 1e3)
        one = next(y for y in r["rows"] if y["tp"] == 1 and y["batch"] == x["batch"])
        assert x["speedup_vs_tp1"] == pytest.approx(one["ms_per_token"] / x["ms_per_token"])
        # tp 2: o_proj's and the MoE's all-reduce a layer, a few for the embedding and the argmax
        n, layers = sum(x["collectives"]["baseline"].values()), TINY.num_hidden_layers
        assert n == 0 if x["tp"] == 1 else 2 * layers <= n <= 2 * layers + 3, (x["tp"], n)
        assert x["reduction"] == (None if x["tp"] == 1 else "xla")  # no GPU: psum, no Mailbox
        assert x["baseline_kernels_ms"] == {} and x["baseline_launches"] == 0  # no device profile on CPU
        units = TINY.intermediate_size  # whole experts a device at tp 2 ("expert")
        assert x["moe_config"] == dict(units=units, **dataclasses.asdict(moe.config_for(units))), x["moe_config"]
    assert [(a["tp"], a["rows"]) for a in r["allreduce"]] == [(2, 1), (2, 4)]
    assert all(a["xla_us"] > 0 and a["kernel_us"] is None and a["reference_us"] is None for a in r["allreduce"])
    assert "tp=2 B=1 " in out and "x tp1)" in out
    # one device's share of tp 2 alone: half the heads, kv heads, vocabulary and (padded) units of each expert
    (s,) = r["share_rows"]
    cfg = TINY
    units = parallel.expert_units(cfg, AbstractMesh((1, 2), ("data", "model")), "tensor") // 2
    assert (s["share"], s["batch"]) == (2, 1) and s["config"] == dict(
        num_attention_heads=cfg.num_attention_heads // 2, num_key_value_heads=cfg.num_key_value_heads // 2,
        intermediate_size=units, vocab_size=cfg.vocab_size // 2)
    assert s["moe_config"]["units"] == units and s["ms_per_token"] > 0
    assert s["baseline_kernels_ms"] == {} and s["baseline_launches"] == 0  # --profile: none on CPU
    assert s["speedup_vs_tp1"] == pytest.approx(r["rows"][0]["ms_per_token"] / s["ms_per_token"])
    nbytes = roofline.target_bytes(cfg, 1, 1, 64, model=2)["total"]
    assert s["roofline_fraction"] == pytest.approx(nbytes / r["copy_bandwidth"] / (s["ms_per_token"] / 1e3))
    assert "share of tp=2 B=1 " in out
    # a degree the devices cannot hold, refused before any model is made
    err = fails("bench_tp.py", "--preset", "tiny", "--tp", "1,4",
                env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert err.strip() == "error: --tp: 4 devices, but 2 available", err
    err = fails("bench_tp.py", "--preset", "tiny", "--tp", "1", "--shares", "4")  # tiny's 2 kv heads
    assert err.strip() == 'error: --shares: 4: mesh axis "model" of size 4 must divide num_key_value_heads=2', err
    assert "--reductions" in fails("bench_tp.py", "--reductions", "nccl", code=1)
    assert "--experts" in fails("bench_tp.py", "--experts", "heads", code=1)


def test_bench_allreduce_routes(tmp_path):
    # each route in its own process on two fake CPU devices; tp 4 skipped (two devices), sums checked
    path = tmp_path / "ar.json"
    out = run("bench_allreduce.py", "--routes", "xla,nccl_ll", "--tp", "2,4", "--rows", "1,4", "--out", str(path),
              env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    r = json.loads(path.read_text())
    assert r["num_devices"] == 2 and list(r["routes"]) == ["xla", "nccl_ll"]
    for route in r["routes"].values():
        assert route["error"] is None and [(x["tp"], x["rows"]) for x in route["results"]] == [(2, 1), (2, 4)], route
        assert all(x["us"] > 0 for x in route["results"])
    assert r["routes"]["nccl_ll"]["env"] == {"NCCL_PROTO": "LL"} and "nccl_ll    tp2 1 rows " in out


def test_bench_baseline_writes_json(tmp_path):
    path = tmp_path / "r.json"
    run("bench_baseline.py", "--preset", "tiny", "--layers", "2", "--prompt_len", "20", "--new_tokens", "96",
        "--prefill_chunk", "8", "--repeats", "3", "--out", str(path))
    r = json.loads(path.read_text())
    for k in ("command", "device", "jax_version", "date", "prefill_seconds", "seconds_per_generated_token",
              "param_bytes", "memory_after_run"):
        assert k in r
    assert r["seconds_per_generated_token"] > 0 and r["preset"] == "tiny"


@pytest.mark.slow
def test_bench_step_writes_json(tmp_path):
    path = tmp_path / "s.json"
    run("bench_step.py", "--preset", "tiny", "--layers", "2", "--context", "24", "--iters", "2", "--batch", "1",
        "--shapes", "tree2x2n4", "--out", str(path))
    r = json.loads(path.read_text())
    assert r["recompile_check"]["second_call_compile_seconds"] == 0.0
    (row,) = r["rows"]
    assert row["topk"] == 2 and row["seconds"]["step"] > 0 and row["sum_of_parts"] > 0
    assert set(row["seconds"]) == {"step", "draft", "verify", "accept", "rewind", "extend"}


def test_kernel_families_and_step_minus_parts():
    import bench_step
    from lib import timing
    g = timing.kernel_group
    assert g("loop_fusion_12") == g("loop_fusion") == "loop_fusion"
    assert g("input_reduce_fusion.3") == "input_reduce_fusion"
    assert g("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == g("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert g("mxfp4_moe_gate_up") == "mxfp4_moe_gate_up" and g("MemcpyD2D") == "MemcpyD2D"
    kernels = {"step": {"gemm": 5e-4, "mxfp4_moe_down": 3e-4, "launches": 30.0},
               "verify": {"gemm": 2e-4, "mxfp4_moe_down": 3e-4, "launches": 20.0},
               "draft": {"gemm": 1e-4, "tree_attention": 1e-5, "launches": 6.0}}
    d = bench_step.kernel_diff(kernels)
    assert np.isclose(d["by_family"]["gemm"], 2e-4) and np.isclose(d["by_family"]["tree_attention"], -1e-5)
    assert d["launches"] == 4.0 and list(d["by_family"])[0] == "gemm" and "launches" not in d["by_family"]
    assert np.isclose(d["kernel_seconds_step"], 8e-4) and np.isclose(d["kernel_seconds_parts"], 6.1e-4)


@pytest.mark.slow
def test_bench_and_gates(tmp_path):
    path = tmp_path / "b.json"
    # gates and stress: the sweep / large / single rows go through the same `measure` as the gate rows
    # (tree shapes through step_timing: test_bench_step_writes_json), so they are left out for time; so
    # are the step's parts (--noparts; timed in test_bench_on_a_mesh)
    # and the stress rows' 16 prompts are short (64-127 tokens: the prefill on CPU took 11 s of 16 at up to 1023)
    out = run("bench.py", "--preset", "tiny", "--layers", "2", "--scenarios", "gates,stress", "--iters", "1",
              "--copy_bytes", "1000000", "--dense_rows", "single-32k", "--noparts", "--stress_new_tokens", "16",
              "--stress_prompt_max", "128", "--profile", "--out", str(path))
    r = json.loads(path.read_text())
    names = [x["name"] for x in r["scenarios"]]
    # --profile: each row's kernels by family for the baseline and the step; none recorded on CPU
    assert all(x["kernels"] == {"baseline": {}, "step": {}} for x in r["scenarios"][:2])
    assert names == ["single-32k", "batch4-16k", "stress"]
    gate = next(x for x in r["scenarios"] if x["name"] == "single-32k")
    assert set(gate["step_seconds"]) == {"step"}
    assert gate["bytes"]["step"] > gate["bytes"]["baseline"] > 0 and "3.22" in gate["projected_speedup"]
    assert gate["dense_sliding"]["step_seconds"] > 0  # the same row, full-length sliding caches
    # a row's memory: each timed loop's compiled buffers (the baseline, the step; no parts timed)
    m = gate["memory"]
    assert set(m) == {"baseline", "step", "parts", "device"} and m["parts"] == {}
    loops = (m["baseline"], m["step"])
    for loop in loops:
        p = loop["program"]
        assert set(p) == {"argument", "output", "alias", "temp", "code", "peak"}
        assert p["peak"] == p["argument"] + p["output"] - p["alias"] + p["temp"] > 0
    assert m["step"]["program"]["alias"] > 0  # the state is updated in place
    assert m["device"] is None  # CPU keeps no allocator figures
    from lib import timing  # the row's line ends with the largest peak of its loops

    line = next(x for x in out.splitlines() if re.match(r"single-32k +B=1 ", x))
    assert line.endswith(f"  peak {timing.gib(max(loop['program']['peak'] for loop in loops))}"), line
    kv = r["kv_bytes_per_token"]  # a full and a sliding layer (window 8) of 2 kv heads of 16, bf16
    assert kv["dense"] == 2 * kv["ring"] == 2 * 2 * 2 * 16 * 2 and kv["ring_fixed"] == (8 + 128) * kv["ring"]
    stress = next(x for x in r["scenarios"] if x["name"] == "stress")
    assert len(stress["lengths"]) == 16 and min(stress["lengths"]) < 16  # early eos ended some slots
    g = execute(os.path.join(ROOT, "experiments", "gates.py"), "--results", str(path), timeout=120,
                env={**os.environ, **CPU_ENV})
    assert g.returncode in (0, 1) and "single-32k chain3" in g.stdout and "byte roofline allows" in g.stdout
    passed = all(x["projected"] >= x["need"] for x in __import__("gates").evaluate(r) if not x.get("missing"))
    assert g.returncode == (0 if passed else 1)


def test_parse_shape():
    from lib.step_timing import parse_shape
    assert parse_shape("chain3") == dict(depth=3, topk=1, num_nodes=4)
    assert parse_shape("tree5x8n16") == dict(depth=5, topk=8, num_nodes=16)
    for bad in ("nonsense", "chain", "chain0", "chain3x", "tree3x4", "tree3x4n8x", "tree3n8", " chain3"):
        with pytest.raises(ValueError, match=f"draft shape {bad!r}: expected chainK or treeDxKnN"):
            parse_shape(bad)


def test_copy_buffer_that_does_not_fit_is_named():
    from lib import timing
    with pytest.raises(ValueError, match=r"^--copy_bytes 35184372088832: the copy-bandwidth buffer does not "
                                         r"fit on .*; pass a smaller --copy_bytes$"):
        timing.copy_bandwidth(1 << 45, "--copy_bytes")


def test_program_memory_without_buffer_stats():
    # a backend without XLA's buffer-assignment statistics: None (the rows then record None), not an error
    import jax
    from lib import timing

    class Compiled:
        def __init__(self, answer):
            self.answer = answer

        def memory_analysis(self):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    for answer in (NotImplementedError("no stats"), jax.errors.JaxRuntimeError("UNIMPLEMENTED"), None):
        assert timing.program_memory(Compiled(answer)) is None, answer
    with pytest.raises(ValueError, match="other"):  # any other failure is not swallowed
        timing.program_memory(Compiled(ValueError("other")))
    real = timing.program_memory(jax.jit(lambda x: x * 2).lower(np.ones(4, np.float32)).compile())
    assert real["peak"] == real["argument"] + real["output"] - real["alias"] + real["temp"] > 0


def test_gates_names_file_and_missing_key(tmp_path):
    import gates
    path = tmp_path / "not_bench.json"
    path.write_text(json.dumps({"rows": [{"k": 64}]}))  # e.g. an fr_spec.py JSON
    # bad input: one line on stderr and exit status 2 (1 means a gate failed)
    assert fails("gates.py", "--results", str(path), code=2) == \
        f"error: {path}: no key 'scenarios' (expected a bench.py results JSON)\n"
    row = dict(name="single-32k", shape="chain3", baseline_seconds_per_token=1e-3, step_seconds=dict(step=2e-3),
               bytes=dict(baseline=1))
    with pytest.raises(ValueError, match=r"r\.json scenario 'single-32k': no key 'bytes\.step' \(expected a bench"):
        gates.evaluate(dict(scenarios=[row]), "r.json")
    with pytest.raises(ValueError, match=r"r\.json scenarios\[1\]: no key 'name'"):
        gates.evaluate(dict(scenarios=[{"name": "stress"}, {"shape": "chain3"}]), "r.json")


@pytest.mark.slow
def test_kernel_benches_write_json(tmp_path):
    # each kernel family's script on CPU, the kernels interpreted at small shapes: flags parse, the JSON's
    # sections and rows written, each kernel agreeing with its reference or the model's other path
    path = tmp_path / "moe.json"
    # with --moe_units, one device's share of each expert under the units split (96 of the tiny 64: more);
    # --moe_config reaches the model's kernel path through KernelPolicy(moe_config=...); a 1 MB
    # copy-bandwidth buffer (the default 256 MiB took most of a run on CPU)
    out = run("bench_moe.py", "--moe_preset", "tiny", "--moe_units", "96", "--moe_tokens", "1", "--moe_routings", "1",
              "--moe_config", "fma_warps=1", "--nomoe_jnp", "--grouped_tokens", "80", "--copy_bytes", "1000000",
              "--out", str(path))
    result = json.loads(path.read_text())
    res = result["moe"]
    (row,) = res["tokens"]
    assert res["units"] == 96 and res["config"] == dataclasses.asdict(moe.MoeConfig(fma_warps=1))
    assert res["rel_err_T5_vs_reference"] < 1e-3 and row["tokens"] == 1 and row["distinct_experts"] == 4
    assert row["kernel_us"] > 0 and row["layer_kernel_us"] > 0 and "layer_jnp_grouped_us" not in row  # --nomoe_jnp
    assert "  T experts" in out and "fma_warps': 1" in out
    res = result["moe_grouped"]
    (row,) = res["rows"]
    assert res["units"] == 96 and row["tokens"] == 80 and row["live_tiles"] >= 1
    assert row["rel_err_kernel_vs_scan"] < 1e-3
    # gemv at a ragged shape: rows_matmul (interpreted) against XLA's dot
    run("bench_gemv.py", "--gemv_shapes", "96x40", "--gemv_rows", "1,3", "--gemv_blocks", "8/64", "--gemv_weights",
        "2", "--copy_bytes", "1000000", "--out", str(path))
    rows = json.loads(path.read_text())["gemv"]["rows"]
    assert [(r["rows"], r["impl"], r["block_n"]) for r in rows] == [(1, "xla", None), (1, "rows_matmul", 8),
                                                                     (3, "xla", None), (3, "rows_matmul", 8)]
    assert all(r["K"] == 96 and r["N"] == 40 and r["seconds"] > 0 and r["max_diff"] < 1e-5 for r in rows), rows
    # tree_mask and kv_rewind: the kernels against the references, each through its dispatcher (accept's
    # dispatchers take the same KernelPolicy; its section, the slowest to interpret, is left out for time)
    out = run("bench_spec_ops.py", "--only", "tree_mask,kv_rewind", "--sets", "1", "--out", str(path))
    result = json.loads(path.read_text())
    assert [len(result[k]["rows"]) for k in ("tree_mask", "kv_rewind")] == [2, 1] and "accept" not in result, result
    assert all(r["matches_reference"] and r["seconds"] > 0 for k in ("tree_mask", "kv_rewind")
               for r in result[k]["rows"])
    assert "kv_rewind 4 layers K+V" in out
    # attention: the Pallas kernel against the reference at a full and a sliding layer
    run("bench_attention.py", "--attn_nqs", "4", "--attn_stream", "1", "--attn_lengths", "128", "--copy_bytes",
        "1000000", "--out", str(path))
    rows = json.loads(path.read_text())["attention"]["rows"]
    assert [(r["L"], r["Nq"], r["window"]) for r in rows] == [(128, 4, None), (128, 1, 128)]
    assert all(r["rel_err"] < 1e-2 and r["kernel_seconds"] > 0 for r in rows), rows
    # bad input: one line, before anything runs
    err = fails("bench_moe.py", "--only", "moe_grouped", "--moe_preset", "tiny", "--moe_units", "80")
    assert "moe_units=80: intermediate_size: 80 must be a multiple of 32 for MXFP4 experts" in err
    assert "Traceback" not in err
    err = fails("bench_gemv.py", "--gemv_blocks", "6/64")
    assert "--gemv_blocks: block_n/block_k, powers of two" in err and "Traceback" not in err
    err = fails("bench_spec_ops.py", "--only", "attention")
    assert err.strip() == "error: --only: unknown sections ['attention']; known: ['accept', 'kv_rewind', 'tree_mask']"
