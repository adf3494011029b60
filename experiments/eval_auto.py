"""decode(depth="auto") against generate and the best fixed draft shape, in one process, over batch sizes,
temperatures and both proposals; measures the cost table it uses on the way.

  python experiments/eval_auto.py --out auto.json --table_out table.json      # the embedded pair

For each batch B (the first B held-out prompts, --max_new_tokens new tokens) and proposal mode
(greedy at temperature 0; "deterministic" and "sample" at each --temperatures > 0), with --shape a
tree treeDxKnN (options: chains of 0 .. D drafts and that tree):
  1. decode(depth="auto") of the tree configuration, compiled once; each option forced in turn
     (lib/auto_timing.py) gives its seconds a step (the cost table of B and the mode, at the mode's
     first temperature; written to --table_out) and, at every temperature, its run's wall clock;
  2. "auto tree": that executable with the measured table; "auto chain": the same without the tree,
     i.e. the chain configuration's choice (run by the tree configuration's program: its arms are the
     chain configuration's; --check_chain_program compiles the chain configuration's own once, B=1 greedy);
  3. the fixed shapes, each its own decode program: the chain of 1 .. D drafts whose forced run was
     fastest at that temperature, and the tree where its forced run was within 5% of that chain's;
     and generate.
Per row: median run seconds of --repeats calls (compile excluded), speedup over generate and over
the best fixed row (the chain for "auto chain", the faster of chain and tree for "auto tree"), tau,
and auto's histogram of choices with its predicted and realised tokens. Rows are written as they
come (--out); blocks stop starting once --budget_seconds have passed.
"""

import json
import os
import time

import jax.numpy as jnp
from absl import flags
from lib import auto_timing, cli
from lib.step_timing import decode_kwargs, median_seconds, parse_shape
from lib.timing import device_info, write_json

from eagle3_jax import assets
from eagle3_jax.convert import load_eagle3, load_gpt_oss
from eagle3_jax.spec import cost_table, decode, generate

flags.DEFINE_string("target", assets.TARGET_DIR, "HF GPT-OSS checkpoint folder")
flags.DEFINE_string("draft", assets.DRAFT_DIR, "HF EAGLE-3 draft folder")
flags.DEFINE_string("prompts_file", os.path.join(assets.PAIR_DIR, "eval_prompts.json"), "JSON list of token-id lists")
flags.DEFINE_string("shape", "tree3x4n8", "the tree configuration treeDxKnN (its chains: 1 .. D drafts)")
flags.DEFINE_list("batches", ["1", "4", "16"], "batch sizes (the first B prompts)")
cli.positive_ints("batches")
flags.DEFINE_list("temperatures", ["0.6", "1.0"], "temperatures > 0 (0, greedy, always runs first)")
flags.DEFINE_integer("max_new_tokens", 96, "new tokens a prompt (the short run of a step time shares its program)",
                     lower_bound=8)
flags.DEFINE_integer("repeats", 3, "runs per wall-clock figure (median)", lower_bound=1)
flags.DEFINE_integer("seed", 0, "sampling seed", lower_bound=0)
flags.DEFINE_bool("check_chain_program", True, "compile the chain configuration's own auto program once (B=1, "
                  "greedy) and time it beside the tree configuration's program restricted to chains")
flags.DEFINE_float("budget_seconds", None, "start no new (batch, mode) block after this many seconds", lower_bound=0)
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "dtype (default: bfloat16 on GPUs, float32 on CPUs)")
flags.DEFINE_string("out", None, "JSON output path")
flags.DEFINE_string("table_out", None, "cost table file written from the forced runs (cost_table.py's format)")
cli.progress_flag()
FLAGS = flags.FLAGS


def _tree(shape):
    if parse_shape(shape)["topk"] == 1:
        raise ValueError(f"expected a tree (treeDxKnN with K > 1), got {shape}")


def _temperatures(ts):
    try:
        ok = all(0 < float(t) < float("inf") for t in ts)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"expected finite temperatures > 0, got {ts}")


cli.check_with("shape", _tree)
cli.check_with("temperatures", _temperatures)


def auto_summary(m: dict) -> dict:
    return dict(tau=m["mean_accept_length"], steps=m["steps"], histogram=m["depth_histogram"],
                predicted_tokens=m["auto"]["predicted_tokens"], realised_tokens=m["auto"]["realised_tokens"],
                predicted_seconds=m["auto"]["predicted_seconds"])


def main(argv):
    del argv
    t_start = time.perf_counter()
    dtype = jnp.dtype(FLAGS.dtype) if FLAGS.dtype else assets.default_dtype()
    target = load_gpt_oss(FLAGS.target, dtype=dtype, progress=cli.load_progress())
    draft = load_eagle3(FLAGS.draft, target=target, progress=cli.load_progress())
    with open(FLAGS.prompts_file) as f:
        prompts = json.load(f)
    n, R = FLAGS.max_new_tokens, FLAGS.repeats
    tree_kw = decode_kwargs(FLAGS.shape)
    D = tree_kw["num_spec_tokens"]
    names = auto_timing.options_of(tree_kw)
    tree_name, chains = names[-1], names[1:-1]
    batches = [int(b) for b in FLAGS.batches]
    modes = [("greedy", "deterministic", [0.0])] + [(p, p, [float(t) for t in FLAGS.temperatures])
                                                     for p in ("deterministic", "sample")]
    info = device_info()
    res = dict(**info, target=FLAGS.target, draft=FLAGS.draft, shape=FLAGS.shape, max_new_tokens=n, repeats=R,
               dtype=dtype.name, seed=FLAGS.seed, rows=[], blocks=[])
    table = {}
    for b in batches:
        ps = prompts[:b]
        for mode, proposal, temps in modes:
            if FLAGS.budget_seconds is not None and time.perf_counter() - t_start > FLAGS.budget_seconds:
                res["stopped"] = f"budget of {FLAGS.budget_seconds} s reached before B={b} {mode}"
                write_json(FLAGS.out, res)
                cli.write(res["stopped"])
                continue
            t_block = time.perf_counter()
            base = dict(eos_ids=(), seed=FLAGS.seed, proposal=proposal)
            # 1. the auto program, each option forced: step times (first temperature) and wall clock (each)
            steps = auto_timing.option_seconds(target, draft, ps, n, dict(tree_kw, temperature=temps[0], **base), R)
            m_table = table.setdefault(mode, dict(
                model=cost_table.model_fields(target.config, draft.config, target.dtype), proposal=proposal,
                greedy=mode == "greedy", batches=[], contexts=[len(ps[0]) + n // 2], seconds={}, runs={}))
            m_table["batches"].append(b)
            for name in names:
                m_table["seconds"].setdefault(name, []).append([steps[name]["seconds"]])
                m_table["runs"].setdefault(name, {})[f"B={b}"] = {k: v for k, v in steps[name].items()
                                                                 if k != "seconds"}
            block = dict(batch=b, mode=mode, step_seconds={k: v["seconds"] for k, v in steps.items()},
                         compile_seconds={})
            measured = {"batches": [1], "contexts": [0],
                        "seconds": {k: [[v["seconds"]]] for k, v in steps.items() if v["seconds"] is not None}}
            chain_only = dict(measured, seconds={k: v for k, v in measured["seconds"].items() if k != tree_name})
            fixed_seen = set()
            for T in temps:
                kw = dict(base, temperature=T)
                auto_kw = dict(tree_kw, depth="auto", **kw)
                forced = {k: median_seconds(lambda k=k: decode(target, draft, ps, n, cost_table=auto_timing.forced(k),
                                                               **auto_kw), R) for k in names}
                best_chain = min(chains, key=forced.get)
                shapes = [best_chain] + ([tree_name] if forced[tree_name] <= 1.05 * forced[best_chain] else [])
                walls = {}
                g = generate(target, ps, n, temperature=T, seed=FLAGS.seed, eos_ids=())
                block["compile_seconds"].setdefault(f"generate T={T}", g.metrics["compile_seconds"])
                walls["generate"] = median_seconds(lambda T=T: generate(target, ps, n, temperature=T, seed=FLAGS.seed,
                                                                        eos_ids=()), R)
                for s in shapes:
                    first = decode(target, draft, ps, n, **decode_kwargs(s), **kw)
                    if s not in fixed_seen:
                        block["compile_seconds"][s] = first.metrics["compile_seconds"]
                        fixed_seen.add(s)
                    walls[s] = median_seconds(lambda s=s: decode(target, draft, ps, n, **decode_kwargs(s), **kw), R)
                for label, tab in (("auto chain", chain_only), ("auto tree", measured)):
                    last = decode(target, draft, ps, n, cost_table=tab, **auto_kw)
                    walls[label] = median_seconds(lambda tab=tab: decode(target, draft, ps, n, cost_table=tab,
                                                                         **auto_kw), R)
                    best_fixed = walls[best_chain] if label == "auto chain" else min(walls[s] for s in shapes)
                    best = min(best_fixed, walls["generate"])
                    row = dict(batch=b, temperature=T, proposal=proposal, family=label.split()[1],
                               auto_seconds=walls[label], generate_seconds=walls["generate"],
                               best_fixed=best_chain if label == "auto chain" else min(shapes, key=walls.get),
                               best_fixed_seconds=best_fixed, speedup_vs_generate=walls["generate"] / walls[label],
                               ratio_vs_best=best / walls[label], forced_seconds=forced, fixed_seconds=walls,
                               auto=auto_summary(last.metrics))
                    res["rows"].append(row)
                    cli.write(f"B={b:<2d} T={T:.1f} {proposal:13s} {label:10s} auto {walls[label] * 1e3:7.1f} ms  "
                              f"generate {walls['generate'] * 1e3:7.1f}  best fixed {row['best_fixed']} "
                              f"{best_fixed * 1e3:7.1f}  -> {row['ratio_vs_best']:.3f}x of the best, "
                              f"{row['speedup_vs_generate']:.2f}x generate  {row['auto']['histogram']}")
                    write_json(FLAGS.out, res)
            if FLAGS.check_chain_program and b == batches[0] and mode == "greedy":
                own_kw = dict(num_spec_tokens=D, depth="auto", cost_table=chain_only, temperature=0.0, **base)
                run_kw = dict(tree_kw, depth="auto", cost_table=chain_only, temperature=0.0, **base)
                own = decode(target, draft, ps, n, **own_kw)
                block["chain_program"] = dict(
                    compile_seconds=own.metrics["compile_seconds"],
                    seconds=median_seconds(lambda: decode(target, draft, ps, n, **own_kw), R),
                    restricted_seconds=median_seconds(lambda: decode(target, draft, ps, n, **run_kw), R),
                    same_tokens=own.tokens == decode(target, draft, ps, n, **run_kw).tokens)
            block["auto_compile_seconds"] = steps[names[0]]["compile_seconds"]
            block["seconds"] = time.perf_counter() - t_block
            res["blocks"].append(block)
            res["elapsed_seconds"] = time.perf_counter() - t_start
            write_json(FLAGS.out, res)
            cli.write(f"block B={b} {mode}: {block['seconds']:.1f} s (auto program compiled in "
                      f"{block['auto_compile_seconds']:.1f} s; fixed {block['compile_seconds']})")
            if FLAGS.table_out:
                write_json(FLAGS.table_out, {"format": 1, "device_kind": info["device"], "tables": [
                    dict(t, source=f"measured by experiments/eval_auto.py on {info['device']} ({info['date']}): "
                                   f"{info['command']}; (seconds of a {n}-token run - of the shortest run of the same "
                                   "program) / (their difference in steps), the option forced at every step "
                                   "(experiments/lib/auto_timing.py)", jax_version=info["jax_version"])
                    for t in table.values()]})
    write_json(FLAGS.out, res)


if __name__ == "__main__":
    cli.run(main)
