"""Main job: speculative decoding with an EAGLE-3 draft (default: the embedded trained pair).

  python experiments/decode.py                                  # embedded pair, greedy, vs baseline
  python experiments/decode.py --prompt "def fibonacci(n):\n" --max_new_tokens 128
  python experiments/decode.py --target /ckpt/gpt-oss-120b --draft /ckpt/gpt-oss-120b-eagle3 \
      --chat --prompt "Write a haiku" --reasoning_effort low --num_spec_tokens 3 --max_new_tokens 128
  python experiments/decode.py ... --chat --prompts_file questions.jsonl    # conversations or strings
  python experiments/decode.py --mesh model=2,data=1           # over two devices (eagle3_jax.parallel)

The embedded pair (eagle3_jax/assets/stdlib-gpt-oss) is a small GPT-OSS trained on the Python
standard library and its EAGLE-3 draft; without prompts it continues two held-out stdlib snippets
in one batch (B=2). Prompts (experiments/lib/prompts.py): --prompt (repeatable; `\n`, `\t`, `\r`
and `\\` decoded, other backslashes kept; --noescapes: taken as written) or --prompts_file (.jsonl:
a JSON value a line, a string, id list, conversation or {"messages": [...]}; .json: a list of those;
other files: one text prompt a line, escapes decoded). Text is tokenized with the target's
tokenizer.json (else token ids "1,2,3"). --chat renders text prompts as one user turn (after
--system) with the target's chat template (--chat_template: another file); conversations are always
rendered with it. Stops: --eos (ids or token strings), default the checkpoint's stop ids
(generation_config.json's eos_token_id, else config.json's). `--draft none` runs the baseline alone.
Sampling (--temperature > 0): --top_k, --top_p, --min_p filter it (experiments/lib/decode_flags.py);
--branching sets the children per draft node (--topk: its deprecated name). Prints each prompt and
its continuation, tau (mean committed tokens per decode step, the bonus token
included) and the accept rate, and the throughput against `generate` in the same process.
"""

import json
import os
import textwrap
import time

import jax
import jax.numpy as jnp
from absl import flags
from lib import cli, decode_flags
from lib import prompts as prompt_io

from eagle3_jax import assets, parallel
from eagle3_jax.convert import load_eagle3, load_gpt_oss
from eagle3_jax.formats import chat
from eagle3_jax.spec import decode, generate

flags.DEFINE_string("target", assets.TARGET_DIR, "HF GPT-OSS checkpoint folder")
flags.DEFINE_string("draft", assets.DRAFT_DIR, "HF EAGLE-3 draft folder, or 'none'")
flags.DEFINE_multi_string("prompt", None, "prompt: text when the target has a tokenizer.json, else comma-separated "
                          "ids; \\n \\t \\r \\\\ are decoded (--noescapes: not)")
flags.DEFINE_string("prompts_file", None, "prompts: .jsonl (a string, id list, conversation or {\"messages\": ...} a "
                    "line), .json (a list of those) or text (one prompt a line); default: two held-out stdlib "
                    "snippets of the embedded pair")
flags.DEFINE_bool("escapes", True, "decode \\n, \\t, \\r and \\\\ in --prompt and in text-file lines")
flags.DEFINE_bool("chat", False, "render text prompts as a user turn with the target's chat template (conversations "
                  "from a file are always rendered)")
flags.DEFINE_string("system", None, "with --chat: a system message before each prompt (not where a conversation "
                    "has its own)")
flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate per prompt", lower_bound=1)
decode_flags.define()  # draft shape, --temperature, --proposal, filters, --chat_template, --reasoning_effort, --eos
flags.DEFINE_integer("seed", 0, "sampling seed", lower_bound=0)
flags.DEFINE_bool("baseline", True, "also run generate() in the same process and compare")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "weights / activations dtype (default: bfloat16 on "
                  "GPUs, float32 on CPUs, where it is faster and decode == generate holds bit for bit)")
flags.DEFINE_integer("repeats", 1, "runs of decode and of generate, the last one reported: a first run may pay "
                     "one-time device setup (on 2 GPUs the first program on the mesh was seen to take 0.8 s more)",
                     lower_bound=1)
flags.DEFINE_string("json_out", None, "write tokens and metrics here")
cli.progress_flag()
cli.mesh_flags()
FLAGS = flags.FLAGS

CPU_NOTE = ("note: a CPU is compute-bound: verifying N tokens in one pass costs about as much as N one-token "
            "steps, so speculative decoding gains little over generate there. On a GPU decoding is memory-bound (a "
            "step reads every weight once, whatever the tokens), which is where the draft pays off "
            "(docs/perf/end_to_end.md).")


def _say(msg):
    if jax.process_index() == 0:  # several processes (--coordinator_address) share one output
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _tokenizer(path):
    return assets.load_tokenizer(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None


def _show(prompts, outputs, tok):
    """Each prompt and its continuation, each from the start of its own lines (process 0 only)."""
    if jax.process_index():
        return
    for i, (p, t) in enumerate(zip(prompts, outputs, strict=True)):
        print(f"--- prompt {i + 1} ({len(p)} tokens) ---")
        print(tok.decode(p) if tok else ",".join(map(str, p)))
        print(f"--- output ({len(t)} tokens) ---")
        print(tok.decode(t) if tok else ",".join(map(str, t)))
    print("---", flush=True)


def _rate(m):
    return f"{m['generated_tokens']} tokens in {m['steps']} steps, {m['tokens_per_second']:.1f} tokens/s " \
           f"(compile {m['compile_seconds']:.1f} s)"


def _repeat(run):
    """run() --repeats times (the same tokens each time: same seed); the last result."""
    out = run()
    for _ in range(FLAGS.repeats - 1):
        again = run()
        if again.tokens != out.tokens:
            raise RuntimeError("a repeated run gave other tokens than the first")
        out = again
    return out


def _chat_format():
    """The target's chat format (--chat_template: that file's template); None where it has no template and
    none is given (then neither --chat nor a conversation can be used)."""
    template = prompt_io.template_file_of(FLAGS.chat_template)
    if template is None and not chat.has_template(FLAGS.target):
        return None
    return chat.ChatFormat.load(FLAGS.target, template)


def _prompts(tok, fmt):
    """The prompts as token-id lists: --prompt, else --prompts_file, else two held-out stdlib snippets."""
    if FLAGS.prompt:
        prompts = [prompt_io.unescape(p) if FLAGS.escapes else p for p in FLAGS.prompt]
        where = "--prompt"
    elif FLAGS.prompts_file:
        prompts = prompt_io.read_prompts(FLAGS.prompts_file, FLAGS.escapes)
        where = f"{FLAGS.prompts_file}: prompt"
    else:
        if FLAGS.chat:
            raise ValueError("--chat: give the prompts (--prompt or --prompts_file); the default prompts are token ids")
        return assets.eval_prompts()[:2]
    kwargs = {}
    if FLAGS.reasoning_effort is not None:
        if fmt is None or "reasoning_effort" not in fmt.variables:
            what = f"the chat template {fmt.source} does not read it" if fmt else ("the target has no chat template "
                                                                                 "(--chat_template gives one)")
            raise ValueError(f"--reasoning_effort {FLAGS.reasoning_effort}: {what}")
        kwargs["reasoning_effort"] = FLAGS.reasoning_effort
    if (FLAGS.system is not None or kwargs) and not (FLAGS.chat or any(map(prompt_io.is_conversation, prompts))):
        raise ValueError("--system and --reasoning_effort shape chat-formatted prompts: pass --chat (or conversations)")
    return prompt_io.encode(prompts, tok, fmt, chat_on=FLAGS.chat, system=FLAGS.system, template_kwargs=kwargs,
                            where=where)


def _eos_ids(tok):
    """--eos as ids ([] for 'none'), else the checkpoint's stop ids (`chat.stop_ids`; None: the library
    takes config.json's)."""
    if FLAGS.eos:
        if [e.strip().lower() for e in FLAGS.eos] == ["none"]:
            return []
        return prompt_io.token_ids(FLAGS.eos, tok)
    ids = chat.stop_ids(FLAGS.target, tok)
    return None if ids is None else list(ids)


def _compare(decoded, base, B, dtype):
    """The throughput this run measured, decode's over generate's, and whether the outputs agree."""
    same = base.tokens == decoded.tokens
    speed = decoded.metrics["tokens_per_second"] / base.metrics["tokens_per_second"]
    _say(f"speculative / baseline throughput {speed:.2f}x at B={B}; outputs identical: {same}")
    if not same and FLAGS.temperature == 0:
        first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
                 for x, y in zip(base.tokens, decoded.tokens, strict=True)]
        _say(f"first differing generated token per prompt: {first}. In {dtype.name} the verify pass "
             "rounds differently from one-token steps, so near-tied argmaxes can part; float32 "
             "(--dtype float32) must match exactly.")
    elif FLAGS.temperature > 0:
        _say("(sampling: outputs are independent exact draws, not expected to match)")


def main(argv):
    del argv
    mesh = cli.setup_devices()
    tok = _tokenizer(FLAGS.target)
    fmt = _chat_format()
    prompts = _prompts(tok, fmt)
    eos_ids = _eos_ids(tok)
    branching = decode_flags.branching()
    if decode_flags.note():
        _say(decode_flags.note())
    B = len(prompts)
    dtype = jnp.dtype(FLAGS.dtype) if FLAGS.dtype else assets.default_dtype()
    load = dict(dtype=dtype, progress=cli.load_progress(), mesh=mesh)  # with a mesh: each process reads its shards
    _say(f"loading target {os.path.abspath(FLAGS.target)} ({dtype.name}, {jax.devices()[0].device_kind})")
    target = load_gpt_oss(FLAGS.target, **load, **({} if mesh is None else {"experts": FLAGS.experts}))
    draft = None
    if FLAGS.draft.lower() != "none":
        _say(f"loading draft {os.path.abspath(FLAGS.draft)}")
        draft = load_eagle3(FLAGS.draft, target=target, **load)
    if mesh is not None:
        _say(f"sharded over {dict(mesh.shape)} ({mesh.size} devices, {jax.process_count()} processes)")
    # how both run: the parameters' mesh, the one-shot all-reduce's Mailbox where it has one (every process asks)
    ctx = parallel.context_for(target)
    kw = dict(temperature=FLAGS.temperature, seed=FLAGS.seed, eos_ids=eos_ids, ctx=ctx, **decode_flags.filters())
    result, out = dict(prompts=prompts, eos_ids=eos_ids, filters=decode_flags.filters()), None
    if draft is not None:
        _say(f"compiling and running decode, B={B} (one executable per batch, cache length and tree shape) ...")
        out = _repeat(lambda: decode(target, draft, prompts, FLAGS.max_new_tokens,
                                     num_spec_tokens=FLAGS.num_spec_tokens, branching=branching,
                                     num_draft_tokens=FLAGS.num_draft_tokens, proposal=FLAGS.proposal, **kw))
        result["decode"] = dict(tokens=out.tokens, metrics=out.metrics)
        _show(prompts, out.tokens, tok)
        m = out.metrics
        _say(f"decode: tau {m['mean_accept_length']:.2f} (tokens per step), accept rate {m['accept_rate']:.2f}; "
             + _rate(m))
    if draft is None or FLAGS.baseline:
        _say(f"compiling and running the baseline generate, B={B} ...")
        base = _repeat(lambda: generate(target, prompts, FLAGS.max_new_tokens, **kw))
        result["baseline"] = dict(tokens=base.tokens, metrics=base.metrics)
        if draft is None:
            _show(prompts, base.tokens, tok)
        _say("generate: " + _rate(base.metrics))
        if out is not None:
            _compare(out, base, B, dtype)
            if jax.default_backend() == "cpu" and jax.process_index() == 0:
                print(textwrap.fill(CPU_NOTE, 100), flush=True)
    if FLAGS.json_out and jax.process_index() == 0:
        if mesh is not None:
            result["mesh"] = dict(mesh.shape, processes=jax.process_count(), experts=FLAGS.experts,
                                  mailbox=ctx.mailbox is not None)
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    cli.run(main)
