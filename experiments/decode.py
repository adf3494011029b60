"""Main job: speculative decoding with an EAGLE-3 draft (default: the embedded trained pair).

  python experiments/decode.py                                  # embedded pair, greedy, vs baseline
  python experiments/decode.py --prompt "def fibonacci(n):" --max_new_tokens 128
  python experiments/decode.py --target /ckpt/gpt-oss-120b --draft /ckpt/gpt-oss-120b-eagle3 \
      --prompt "Write a haiku" --num_spec_tokens 3 --max_new_tokens 128 --baseline

The embedded pair (eagle3_jax/assets/stdlib-gpt-oss) is a small GPT-OSS trained on the Python
standard library and its EAGLE-3 draft; without --prompt it continues two held-out stdlib snippets.
Prompts are text when the target folder has a `tokenizer.json`, else token ids ("1,2,3").
`--draft none` runs the baseline alone.
"""

import json
import os
import time

from absl import app, flags

import jax
import jax.numpy as jnp

import eagle3_jax
from eagle3_jax.convert import load_eagle3, load_gpt_oss
from eagle3_jax.spec import decode, generate
from eagle3_jax.train import data

PAIR = os.path.join(os.path.dirname(eagle3_jax.__file__), "assets", "stdlib-gpt-oss")

flags.DEFINE_string("target", os.path.join(PAIR, "target"), "HF GPT-OSS checkpoint folder")
flags.DEFINE_string("draft", os.path.join(PAIR, "draft"), "HF EAGLE-3 draft folder, or 'none'")
flags.DEFINE_multi_string("prompt", None, "prompt: text when the target has a tokenizer.json, else comma-separated ids")
flags.DEFINE_string("prompts_file", None, "JSON list of prompts (id lists or strings); default: two held-out "
                    "stdlib snippets of the embedded pair")
flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate per prompt")
flags.DEFINE_integer("num_spec_tokens", 3, "draft depth")
flags.DEFINE_integer("topk", 1, "children per expanded draft node (1 = chain)")
flags.DEFINE_integer("num_draft_tokens", None, "tree nodes including the root (default: chain length + 1)")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_bool("baseline", True, "also run generate() in the same process and compare")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "weights / activations dtype (default: bfloat16 on "
                  "GPUs, float32 on CPUs, where it is faster and decode == generate holds bit for bit)")
flags.DEFINE_string("json_out", None, "write tokens and metrics here")
FLAGS = flags.FLAGS


def _say(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _tokenizer(path):
    return data.load_tokenizer(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None


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
    if FLAGS.prompt:
        prompts = FLAGS.prompt
    else:
        with open(FLAGS.prompts_file or os.path.join(PAIR, "eval_prompts.json")) as f:
            prompts = json.load(f)
        prompts = prompts if FLAGS.prompts_file else prompts[:2]
    prompts = [_encode(p, tok) for p in prompts]
    dtype = jnp.dtype(FLAGS.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
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
            _say(f"speculative / baseline throughput {speed:.2f}x; outputs identical: {same}")
            if not same and FLAGS.temperature == 0:
                first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                         for x, y in zip(base.tokens, result["decode"]["tokens"])]
                _say(f"first differing generated token per prompt: {first}. In {dtype.name} the verify pass "
                     "rounds differently from one-token steps, so near-tied argmaxes can part; float32 "
                     "(--dtype float32) must match exactly.")
            elif FLAGS.temperature > 0:
                _say("(sampling: outputs are independent exact draws, not expected to match)")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
