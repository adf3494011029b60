"""Train an EAGLE-3 draft for a GPT-OSS target with training-time test, and write it in the HF layout.

  python experiments/train_draft.py --target runs/target --data_dir data/stdlib --out_dir runs/draft

The draft vocabulary is the `--draft_vocab` most frequent train-split tokens (FR-Spec ranking,
eagle3_jax.convert.frspec); the draft shares the target's embedding (frozen) and reads the target
features at `--aux_layer_ids`. Loss: eagle3_jax.train.draft.ttt_loss (`--ttt_length` unrolled
steps, weights 0.8^i, soft targets restricted to the draft vocabulary). Resumable with the same
--ckpt_dir. Writes out_dir/{config.json, model.safetensors} (LlamaForCausalLMEagle3) and
out_dir/train_log.json (per-step losses and per-depth agreement with the target, eval figures), all
at once when done (eagle3_jax.convert.folders: a run stopped at any point leaves out_dir as it was).
A non-empty out_dir is refused before training unless --overwrite (its checkpoint files are then
replaced, other files kept).
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from lib import cli, train_flags
from lib.timing import device_info

from eagle3_jax.convert import folders, frspec, load_gpt_oss, save_eagle3
from eagle3_jax.spec import generate
from eagle3_jax.train import data, loop
from eagle3_jax.train import draft as tdraft
from eagle3_jax.train import target as ttarget

train_flags.define("runs/draft", steps=6000, batch=32)

flags.DEFINE_string("target", "runs/target", "HF GPT-OSS checkpoint folder (the frozen target)")
flags.DEFINE_integer("draft_vocab", 2048, "draft vocabulary size (most frequent train tokens)", lower_bound=1)
flags.DEFINE_list("aux_layer_ids", ["1", "3", "5"], "target blocks whose outputs the draft reads")
cli.positive_ints("aux_layer_ids", least=0)
flags.DEFINE_integer("ttt_length", 7, "training-time-test steps", lower_bound=1)
flags.DEFINE_integer("eval_batches", 4, "eval-split windows for the eval TTT figures", lower_bound=1)
flags.DEFINE_integer("regenerate", 8192, "train on this many target-written sequences (a train-split prompt of "
                     "--prompt_len tokens, then the target's greedy continuation to seq_len; 0: corpus windows)",
                     lower_bound=0)
flags.DEFINE_integer("prompt_len", 64, "prompt tokens of each regenerated sequence", lower_bound=1)
flags.DEFINE_integer("regenerate_batch", 2048, "sequences per generate call", lower_bound=1)
flags.DEFINE_bool("overwrite", False, "replace the checkpoint files of a non-empty --out_dir (other files kept)")
FLAGS = flags.FLAGS
WRITER = "train_draft.py --out_dir"


def regenerate(target, train, n):
    """[n, seq_len] int32: train-split prompts continued by the target's greedy output (eos does not
    stop it: the target goes on into a new document), as EAGLE-3 drafts are trained on responses
    the target itself wrote."""
    rng = np.random.default_rng((FLAGS.seed, 1 << 20))
    out, t0 = [], time.time()
    for start in range(0, n, FLAGS.regenerate_batch):
        b = min(FLAGS.regenerate_batch, n - start)
        prompts = data.sample_windows(train, rng, b, FLAGS.prompt_len)
        cont = generate(target, prompts.tolist(), FLAGS.seq_len - FLAGS.prompt_len, eos_ids=()).tokens
        out.append(np.concatenate([prompts, np.asarray(cont, np.int32)], axis=1))
    print(f"regenerated {n} sequences of {FLAGS.seq_len} tokens in {time.time() - t0:.1f} s", flush=True)
    return np.concatenate(out)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    folders.check_target(FLAGS.out_dir, WRITER, FLAGS.overwrite, "--overwrite")  # before the work
    train, evals = data.load_split(FLAGS.data_dir, "train"), data.load_split(FLAGS.data_dir, "eval")
    target = load_gpt_oss(FLAGS.target, dtype=jnp.bfloat16)
    ttarget.set_moe_path(target, "dense")  # whole windows at once: every expert dequantized once
    counts = frspec.token_frequencies(np.asarray(train), target.config.vocab_size)
    vocab = frspec.select_draft_vocab(counts, FLAGS.draft_vocab)
    cfg = tdraft.draft_config(target.config, FLAGS.draft_vocab, tuple(int(i) for i in FLAGS.aux_layer_ids))
    draft = tdraft.new_draft(cfg, target, vocab, FLAGS.seed)
    print(f"draft vocab {FLAGS.draft_vocab}: coverage {frspec.coverage(counts, vocab):.4f} of train tokens; "
          f"{FLAGS.batch}x{FLAGS.seq_len} per step, TTT {FLAGS.ttt_length} on {jax.devices()[0].device_kind}",
          flush=True)

    def loss_fn(d, batch, t):
        return tdraft.ttt_loss(d, batch, t, ttt_length=FLAGS.ttt_length)

    written = regenerate(target, train, FLAGS.regenerate) if FLAGS.regenerate else None

    def batch_fn(step):
        rng = np.random.default_rng((FLAGS.seed, step))
        if written is not None:
            return {"tokens": written[rng.integers(0, len(written), FLAGS.batch)]}
        return {"tokens": data.sample_windows(train, rng, FLAGS.batch, FLAGS.seq_len)}

    t0 = time.time()
    history = loop.fit(draft, loss_fn, batch_fn, extra=(target,), **train_flags.fit_kwargs())
    train_seconds = time.time() - t0
    out = tdraft.export(draft, target)
    ev = jax.jit(loss_fn)
    rng = np.random.default_rng(1234)
    recs = [ev(out, {"tokens": jnp.asarray(data.sample_windows(evals, rng, FLAGS.batch, FLAGS.seq_len))}, target)[1]
            for _ in range(FLAGS.eval_batches)]
    eval_metrics = {k: float(np.mean([r[k] for r in recs])) for k in recs[0]}
    result = dict(**device_info(), draft_vocab=FLAGS.draft_vocab, coverage=frspec.coverage(counts, vocab),
                  aux_layer_ids=cfg.aux_layer_ids, ttt_length=FLAGS.ttt_length, regenerate=FLAGS.regenerate,
                  prompt_len=FLAGS.prompt_len, history=history,
                  train_seconds=train_seconds, eval_bf16=eval_metrics)
    with folders.staged(FLAGS.out_dir, WRITER, FLAGS.overwrite, "--overwrite") as tmp:
        save_eagle3(out, tmp)
        with open(os.path.join(tmp, "train_log.json"), "w") as f:
            json.dump(result, f, indent=1)
    print("eval (bf16 draft): " + ", ".join(f"{k} {v:.3f}" for k, v in eval_metrics.items()), flush=True)


if __name__ == "__main__":
    cli.run(main)
