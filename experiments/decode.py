"""Main job: speculative decoding with an EAGLE-3 draft (default: the embedded tiny random pair).

  python experiments/decode.py                                  # embedded pair, greedy, vs baseline
  python experiments/decode.py --target /ckpt/gpt-oss-120b --draft /ckpt/gpt-oss-120b-eagle3 \
      --prompt "Write a haiku" --num_spec_tokens 3 --max_new_tokens 128 --baseline

The embedded pair has random weights: its output ids and acceptance are meaningless; it shows
the pipeline end to end. Prompts are token ids ("1,2,3"), or text when the target folder has a
`tokenizer.json` and `tokenizers` is installed. `--draft none` runs the baseline alone.
"""

import json
import os
import sys
import time

from absl import app, flags

import jax
import jax.numpy as jnp

import eagle3_jax
from eagle3_jax.convert import load_eagle3, load_gpt_oss
from eagle3_jax.spec import decode, generate

ASSETS = os.path.join(os.path.dirname(eagle3_jax.__file__), "assets")

flags.DEFINE_string("target", os.path.join(ASSETS, "tiny-random-gpt-oss"), "HF GPT-OSS checkpoint folder")
flags.DEFINE_string("draft", os.path.join(ASSETS, "tiny-random-eagle3"), "HF EAGLE-3 draft folder, or 'none'")
flags.DEFINE_multi_string("prompt", None, "prompt: comma-separated token ids, or text when a tokenizer exists")
flags.DEFINE_string("prompts_file", None, "JSON list of prompts (id lists or strings)")
flags.DEFINE_integer("max_new_tokens", 24, "tokens to generate per prompt")
flags.DEFINE_integer("num_spec_tokens", 3, "draft depth")
flags.DEFINE_integer("topk", 1, "children per expanded draft node (1 = chain)")
flags.DEFINE_integer("num_draft_tokens", None, "tree nodes including the root (default: chain length + 1)")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_bool("baseline", True, "also run generate() in the same process and compare")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights / activations dtype")
flags.DEFINE_string("json_out", None, "write tokens and metrics here")
FLAGS = flags.FLAGS


def _say(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _tokenizer(path):
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print("tokenizer.json found but `tokenizers` is not installed: using token ids", file=sys.stderr)
        return None
    return Tokenizer.from_file(file)


def _encode(p, tok):
    if isinstance(p, list):
        return p
    if tok is not None:
        return tok.encode(p).ids
    try:
        return [int(t) for t in p.split(",") if t.strip()]
    except ValueError:
        raise app.UsageError(f"prompt {p!r}: no tokenizer.json in the target folder, give comma-separated ids")


def _metrics_line(m):
    keys = ("mean_accept_length", "accept_rate", "steps", "tokens_per_second", "compile_seconds")
    return ", ".join(f"{k} {m[k]:.3f}" if isinstance(m[k], float) else f"{k} {m[k]}" for k in keys if k in m)


def main(argv):
    del argv
    tok = _tokenizer(FLAGS.target)
    if FLAGS.prompts_file:
        with open(FLAGS.prompts_file) as f:
            prompts = json.load(f)
    else:
        prompts = FLAGS.prompt or ["1,2,3,4,5", "7,7,7", "200,100,50,25,12,6"]
    prompts = [_encode(p, tok) for p in prompts]
    dtype = jnp.dtype(FLAGS.dtype)
    _say(f"loading target {os.path.abspath(FLAGS.target)} on {jax.devices()[0].device_kind}")
    target = load_gpt_oss(FLAGS.target, dtype=dtype)
    draft = None
    if FLAGS.draft.lower() != "none":
        _say(f"loading draft {os.path.abspath(FLAGS.draft)}")
        draft = load_eagle3(FLAGS.draft, target=target, dtype=dtype)
    kw = dict(temperature=FLAGS.temperature, seed=FLAGS.seed)
    result = {}
    if draft is not None:
        _say("compiling and running decode (one executable per batch, cache length and tree shape) ...")
        out = decode(target, draft, prompts, FLAGS.max_new_tokens, num_spec_tokens=FLAGS.num_spec_tokens,
                     topk=FLAGS.topk, num_draft_tokens=FLAGS.num_draft_tokens, **kw)
        result["decode"] = dict(tokens=out.tokens, metrics=out.metrics)
        for p, t in zip(prompts, out.tokens):
            print("prompt:", tok.decode(p) if tok else p)
            print("output:", tok.decode(t) if tok else t)
        _say("decode: " + _metrics_line(out.metrics))
    if draft is None or FLAGS.baseline:
        _say("compiling and running the baseline generate ...")
        base = generate(target, prompts, FLAGS.max_new_tokens, **kw)
        result["baseline"] = dict(tokens=base.tokens, metrics=base.metrics)
        if draft is None:
            for p, t in zip(prompts, base.tokens):
                print("prompt:", tok.decode(p) if tok else p)
                print("output:", tok.decode(t) if tok else t)
        _say("baseline: " + _metrics_line(base.metrics))
        if draft is not None:
            same = base.tokens == result["decode"]["tokens"]
            speed = result["decode"]["metrics"]["tokens_per_second"] / base.metrics["tokens_per_second"]
            _say(f"speculative / baseline throughput {speed:.2f}x; outputs identical: {same}"
                 + ("" if FLAGS.temperature == 0 else " (sampling: not expected to match)"))
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
