"""Main job: generate from a GPT-OSS checkpoint (default: the embedded tiny random-weight model).

  python experiments/decode.py                       # embedded default, a few prompts, greedy
  python experiments/decode.py --target /path/to/gpt-oss-120b --prompt "12,345,678" --max_new_tokens 64

This runs the baseline `eagle3_jax.spec.generate`; speculative decoding (`--draft`) arrives with
`eagle3_jax.spec.decode`. Prompts are token ids; with a `tokenizer.json` in the target folder and
the `tokenizers` package installed, `--prompt` is text and the output is decoded.
"""

import json
import os
import sys

from absl import app, flags

import jax
import jax.numpy as jnp

import eagle3_jax

from eagle3_jax.convert import load_gpt_oss
from eagle3_jax.spec import generate

DEFAULT_TARGET = os.path.join(os.path.dirname(eagle3_jax.__file__), "assets", "tiny-random-gpt-oss")

flags.DEFINE_string("target", DEFAULT_TARGET, "HF GPT-OSS checkpoint folder")
flags.DEFINE_multi_string("prompt", None, "prompt: comma-separated token ids, or text when a tokenizer exists")
flags.DEFINE_string("prompts_file", None, "JSON list of prompts (id lists or strings)")
flags.DEFINE_integer("max_new_tokens", 24, "tokens to generate per prompt")
flags.DEFINE_float("temperature", 0.0, "0 = greedy")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "weights / activations dtype")
FLAGS = flags.FLAGS


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


def main(argv):
    del argv
    tok = _tokenizer(FLAGS.target)
    if FLAGS.prompts_file:
        with open(FLAGS.prompts_file) as f:
            prompts = json.load(f)
    else:
        prompts = FLAGS.prompt or ["1,2,3,4,5", "7,7,7", "200,100,50,25,12,6"]
    prompts = [_encode(p, tok) for p in prompts]
    print(f"loading {os.path.abspath(FLAGS.target)} on {jax.devices()[0].device_kind} ...", flush=True)
    target = load_gpt_oss(FLAGS.target, dtype=jnp.dtype(FLAGS.dtype))
    print("compiling and generating ...", flush=True)
    out = generate(target, prompts, FLAGS.max_new_tokens, temperature=FLAGS.temperature, seed=FLAGS.seed)
    for p, t in zip(prompts, out.tokens):
        print("prompt:", tok.decode(p) if tok else p)
        print("output:", tok.decode(t) if tok else t)
    m = out.metrics
    print(f"{m['generated_tokens']} tokens in {m['seconds']:.3f} s ({m['tokens_per_second']:.1f} tok/s), "
          f"{m['steps']} steps, compile {m['compile_seconds']:.1f} s")


if __name__ == "__main__":
    app.run(main)
