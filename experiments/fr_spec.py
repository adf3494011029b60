"""FR-Spec study: for draft vocabulary sizes k, coverage, tau, draft head time and step time.

  python experiments/fr_spec.py                                     # the embedded trained pair
  python experiments/fr_spec.py --target /ckpt/gpt-oss-120b --draft /ckpt/gpt-oss-120b-eagle3 \
      --corpus train_tokens.npy --eval_data eval_tokens.npy --num_prompts 64 --prompt_len 256 \
      --ks 4096,8192,16384,full --max_new_tokens 256 --batch 1 \
      --json_out experiments/results/fr_spec.json --plot experiments/results/fr_spec.png

For each k: the k most frequent target ids of the corpus (frspec.select_draft_vocab) and the
share of corpus tokens they cover (frspec.coverage); the draft with its head restricted to those
ids (frspec.restrict_head; `--source draft` re-ranks rows of the draft's own head, `--source
target` takes rows of the target's lm_head); greedy `decode` on the prompts: tau (mean accept
length, bonus counted), accept rate, per-position accept rates, and whether the output equals
greedy `generate` (`identical`: always in float32; in bf16 near-tied argmaxes may part, see
eval_pair.py); the draft head alone (`eagle3.logits` for h [batch, H]) and one
full speculative chain step at `--context` committed tokens (experiments/lib/step_timing.py), timed
on the current device, with a baseline decode step for the projected speedup tau * baseline /
step. "full" uses the draft as it is, and so does k >= the draft's vocabulary with `--source
draft`; with `--source target` every numeric k (capped at the target's vocabulary) gets a head of
target rows, so k past the draft's vocabulary is a larger head.

Frequencies come from `--corpus` (a .npy of token ids), else from the target's own greedy
generations on the prompts (the JSON's `corpus.source` says which; the second is optimistic:
coverage is then measured on the very text the study decodes). Prompts come from
`--prompts_file` (JSON list of id lists), else `--eval_data` (.npy token ids: `--num_prompts`
windows of `--prompt_len` tokens that contain no `--eval_eos_id`, eagle3_jax.train.data.eval_prompts),
else random ids.
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from lib import cli, timing
from lib.step_timing import time_baseline, time_step

from eagle3_jax import assets
from eagle3_jax.convert import frspec, load_eagle3, load_gpt_oss
from eagle3_jax.models import eagle3
from eagle3_jax.spec import decode, generate
from eagle3_jax.train import data

flags.DEFINE_string("target", assets.TARGET_DIR, "HF GPT-OSS checkpoint folder")
flags.DEFINE_string("draft", assets.DRAFT_DIR, "HF EAGLE-3 draft folder")
flags.DEFINE_string("corpus", None, ".npy token ids for the frequencies (default: the target's greedy "
                    "generations on the prompts)")
flags.DEFINE_string("prompts_file", None, "JSON list of prompts (token id lists)")
flags.DEFINE_string("eval_data", None, ".npy eval token ids: prompts are windows of it")
flags.DEFINE_integer("num_prompts", 4, "prompts taken from --eval_data (or random ids)", lower_bound=1)
flags.DEFINE_integer("prompt_len", 16, "tokens per prompt taken from --eval_data (or random ids)", lower_bound=1)
flags.DEFINE_integer("eval_eos_id", 0, "windows of --eval_data contain no such token", lower_bound=0)
flags.DEFINE_list("ks", ["256", "512", "1024", "2048", "full"], "draft vocabulary sizes; 'full' = the draft's own")
flags.DEFINE_enum("source", "draft", ["draft", "target"], "rows of the restricted head: the draft's own head, "
                  "or the target's lm_head")
flags.DEFINE_integer("num_spec_tokens", 3, "draft depth (chain)", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate per prompt", lower_bound=1)
flags.DEFINE_integer("batch", 1, "batch of the head and step timings", lower_bound=1)
flags.DEFINE_integer("context", 512, "committed tokens per sequence in the step timing", lower_bound=1)
flags.DEFINE_integer("iters", 10, "steps per timed loop (step timing)", lower_bound=1)
flags.DEFINE_integer("copy_bytes", 1 << 30, "buffer of the copy-bandwidth measurement (head roofline); 0 skips")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "weights / activations dtype (default: the library's, "
                  "assets.default_dtype(): bfloat16 on GPUs, float32 on CPUs)")
flags.DEFINE_integer("seed", 0, "prompt sampling seed", lower_bound=0)
flags.DEFINE_string("json_out", None, "JSON output path")
flags.DEFINE_string("plot", None, "PNG output path (needs matplotlib)")
flags.DEFINE_string("plot_from", None, "only draw --plot from this results JSON (no study)")
cli.progress_flag()
FLAGS = flags.FLAGS
for _name in ("corpus", "prompts_file", "eval_data"):  # checked when flags are parsed: before the loads
    flags.register_validator(_name, lambda p: p is None or (os.path.isfile(p) and os.access(p, os.R_OK)),
                             "expected a readable file")
flags.register_validator("copy_bytes", lambda n: n == 0 or n >= 1 << 10, "expected 0 (skip) or at least 1024")


def _say(msg):
    cli.write(f"[{time.strftime('%H:%M:%S')}] {msg}")  # above the bar over ks


def load_prompts(vocab_size):
    if FLAGS.prompts_file:
        with open(FLAGS.prompts_file) as f:
            prompts = json.load(f)
        if not all(isinstance(p, list) for p in prompts):
            raise ValueError(f"--prompts_file {FLAGS.prompts_file}: expected a JSON list of token id lists")
        return prompts, dict(source="prompts_file", path=os.path.abspath(FLAGS.prompts_file))
    if FLAGS.eval_data:
        tokens = np.load(FLAGS.eval_data, mmap_mode="r")
        return (data.eval_prompts(np.asarray(tokens).reshape(-1), FLAGS.num_prompts, FLAGS.prompt_len,
                                  FLAGS.eval_eos_id, FLAGS.seed),
                dict(source="eval_data", path=os.path.abspath(FLAGS.eval_data), eos_id=FLAGS.eval_eos_id,
                     seed=FLAGS.seed))
    rng = np.random.default_rng(FLAGS.seed)
    lo = min(3, vocab_size - 1)
    return ([rng.integers(lo, vocab_size, FLAGS.prompt_len).tolist() for _ in range(FLAGS.num_prompts)],
            dict(source="random_ids", seed=FLAGS.seed))


def parse_ks(ks, draft_vocab):
    """--ks -> [(label, k)]: 'full' the draft's own vocabulary size, else an integer >= 1 (ValueError
    naming the entry otherwise, or for an empty list)."""
    if not ks:
        raise ValueError("--ks: expected at least one draft vocabulary size")
    out = []
    for k in ks:
        k = k.strip().lower()
        if k == "full":
            out.append(("full", draft_vocab))
        else:
            try:
                v = int(k)
            except ValueError:
                raise ValueError(f"--ks: {k!r} is neither an integer nor 'full'") from None
            if v < 1:
                raise ValueError(f"--ks: {v} must be >= 1")
            out.append((v, v))
    return out


cli.check_with("ks", lambda ks: parse_ks(ks, 1))  # checked when flags are parsed: before the models load


def head_seconds(draft, B):
    """Seconds per call of the draft-vocab head `eagle3.logits(draft, h)`, h [B, H]."""
    graphdef, state = nnx.split(draft)
    H = draft.config.hidden_size
    sets = [(state, jax.random.normal(jax.random.key(i), (B, H), draft.dtype)) for i in range(8)]
    return timing.time_calls(lambda st, h: eagle3.logits(nnx.merge(graphdef, st), h), sets)


def plot(result, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    rows = sorted(result["rows"], key=lambda r: (r["as_is"], r["draft_vocab_size"]))
    cut = [r for r in rows if not r["as_is"]]  # restricted heads: a line; the draft as it is: stars
    whole = [r for r in rows if r["as_is"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a2, b2 = a.twinx(), b.twinx()
    series = [(a, "tau", 1, "C0", "tau (mean accept length)"), (a2, "coverage", 1, "C1", "corpus coverage"),
              (b, "head_seconds", 1e6, "C2", "draft head, us per call"),
              (b2, "step_seconds", 1e3, "C3", "speculative step, ms")]
    for n, (ax, key, scale, color, label) in enumerate(series):
        style = "o-" if n % 2 == 0 else "s--"
        ax.plot([r["draft_vocab_size"] for r in cut], [r[key] * scale for r in cut], style, color=color)
        ax.plot([r["draft_vocab_size"] for r in whole], [r[key] * scale for r in whole], "*", ms=12, color=color)
        ax.set_ylabel(label, color=color)
    a2.set_ylim(0, 1.02)
    x = sorted({r["draft_vocab_size"] for r in rows})
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels([str(v) for v in x])
        ax.set_xlabel("draft vocabulary size (star: the draft as it is)")
    a.set_title(f"tau and coverage ({result['corpus']['source']})")
    b.set_title(f"time, batch {result['batch']}, {result['device']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    _say(f"plot written to {path}")


def corpus_counts(base_tokens, V):
    """(token counts [V] of --corpus, else of the target's greedy outputs `base_tokens`; the JSON's
    "corpus" record)."""
    if FLAGS.corpus:
        counts = frspec.token_frequencies(np.load(FLAGS.corpus, mmap_mode="r"), V)
        corpus = dict(source="corpus", path=os.path.abspath(FLAGS.corpus))
    else:
        counts = frspec.token_frequencies(base_tokens, V)
        corpus = dict(source="target_greedy_generations",
                      note="counted from the target's greedy outputs on the study's own prompts (optimistic)")
    return counts, dict(corpus, tokens=int(counts.sum()), distinct_ids=int((counts > 0).sum()))


def k_row(name, d, ids, as_is, target, prompts, counts, base, base_step, bw):
    """One draft vocabulary's row: coverage, decode's acceptance against greedy `base`, the head's and
    the speculative step's time."""
    K = FLAGS.num_spec_tokens
    cov = frspec.coverage(counts, ids)
    _say(f"k={name}: draft vocab {d.config.draft_vocab_size}, coverage {cov:.4f}; decode ...")
    out = decode(target, d, prompts, FLAGS.max_new_tokens, num_spec_tokens=K)
    m = out.metrics
    head = head_seconds(d, FLAGS.batch)
    head_bytes = d.config.draft_vocab_size * d.config.hidden_size * jnp.dtype(d.dtype).itemsize
    shape = dict(depth=K, topk=1, num_nodes=K + 1)
    step = time_step(target, d, FLAGS.batch, shape, FLAGS.context, FLAGS.iters, parts=False)["seconds"]["step"]
    row = dict(k=name, draft_vocab_size=d.config.draft_vocab_size, as_is=as_is, coverage=cov,
               tau=m["mean_accept_length"], accept_rate=m["accept_rate"],
               accept_rate_per_position=m["accept_rate_per_position"],
               accept_length_histogram=m["accept_length_histogram"],
               identical=out.tokens == base.tokens, decode_tokens_per_second=m["tokens_per_second"],
               decode_compile_seconds=m["compile_seconds"], head_seconds=head, head_bytes=int(head_bytes),
               head_roofline_fraction=head_bytes / bw / head if bw else None,
               step_seconds=step, projected_speedup=m["mean_accept_length"] * base_step / step)
    _say(f"k={name}: tau {row['tau']:.3f}, accept rate {row['accept_rate']:.3f}, identical to generate "
         f"{row['identical']}, head {head * 1e6:.1f} us, step {step * 1e3:.3f} ms, projected speedup "
         f"{row['projected_speedup']:.2f}")
    return row


def main(argv):
    del argv
    if FLAGS.plot_from:
        with open(FLAGS.plot_from) as f:
            return plot(json.load(f), FLAGS.plot)
    dtype = jnp.dtype(FLAGS.dtype) if FLAGS.dtype else assets.default_dtype()
    _say(f"loading target {os.path.abspath(FLAGS.target)} on {jax.devices()[0].device_kind}")
    load = dict(dtype=dtype, progress=cli.load_progress())
    target = load_gpt_oss(FLAGS.target, **load)
    _say(f"loading draft {os.path.abspath(FLAGS.draft)}")
    draft = load_eagle3(FLAGS.draft, target=target, **load)
    V, Vd = target.config.vocab_size, draft.config.draft_vocab_size
    prompts, prompt_info = load_prompts(V)
    _say("greedy generate (the reference output) ...")
    base = generate(target, prompts, FLAGS.max_new_tokens)
    counts, corpus = corpus_counts(base.tokens, V)
    # the draft's current vocabulary; with --source draft only those ids can be kept
    own_ids = np.arange(Vd) + np.asarray(draft.d2t[...]).astype(np.int64)
    pool = np.sort(own_ids) if FLAGS.source == "draft" else np.arange(V)  # ascending: ties go to the lower id
    bw = timing.copy_bandwidth(FLAGS.copy_bytes) if FLAGS.copy_bytes else None
    _say(f"baseline decode step, batch {FLAGS.batch}, context {FLAGS.context} ...")
    base_step = time_baseline(target, FLAGS.batch, FLAGS.context, FLAGS.iters)
    rows = []
    for name, k in cli.bar(parse_ks(FLAGS.ks, Vd), "draft vocabularies", unit="k"):
        if name == "full" or (k >= Vd and FLAGS.source == "draft"):
            d, ids, as_is = draft, own_ids, True
        else:  # --source target may also grow the head past the draft's vocabulary, up to the target's
            ids = pool[frspec.select_draft_vocab(counts[pool], min(k, pool.size))]
            d, as_is = frspec.restrict_head(draft, ids, source=FLAGS.source, target=target), False
        rows.append(k_row(name, d, ids, as_is, target, prompts, counts, base, base_step, bw))
    result = dict(timing.device_info(), target=os.path.abspath(FLAGS.target), draft=os.path.abspath(FLAGS.draft),
                  vocab_size=V, draft_vocab_size=Vd, source=FLAGS.source, dtype=dtype.name, corpus=corpus,
                  prompts=dict(prompt_info, count=len(prompts), lengths=[len(p) for p in prompts]),
                  num_spec_tokens=FLAGS.num_spec_tokens, max_new_tokens=FLAGS.max_new_tokens, batch=FLAGS.batch,
                  context=FLAGS.context, iters=FLAGS.iters, copy_bandwidth=bw,
                  baseline_tokens_per_second=base.metrics["tokens_per_second"], baseline_step_seconds=base_step,
                  rows=rows)
    timing.write_json(FLAGS.json_out, result)
    if FLAGS.json_out:
        _say(f"JSON written to {FLAGS.json_out}")
    if FLAGS.plot:
        plot(result, FLAGS.plot)


if __name__ == "__main__":
    cli.run(main)
