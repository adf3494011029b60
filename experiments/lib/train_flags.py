"""Flags and loop settings the two trainers (train_target.py, train_draft.py) share."""

import os

from absl import flags

from eagle3_jax.train import loop

FLAGS = flags.FLAGS


def define(out_dir: str, steps: int, batch: int) -> None:
    """The data, output, optimizer and logging flags, with this trainer's defaults."""
    flags.DEFINE_string("data_dir", "data/stdlib", "make_data.py output (train.npy, eval.npy, tokenizer.json)")
    flags.DEFINE_string("out_dir", out_dir, "HF checkpoint folder to write")
    flags.DEFINE_string("ckpt_dir", None, "orbax checkpoints (resume); default <out_dir>.ckpt")
    flags.DEFINE_integer("steps", steps, "optimizer steps", lower_bound=1)
    flags.DEFINE_integer("batch", batch, "sequences per step", lower_bound=1)
    flags.DEFINE_integer("seq_len", 512, "tokens per sequence", lower_bound=1)
    flags.DEFINE_float("lr", 2e-3, "peak learning rate", lower_bound=0.0)
    flags.DEFINE_integer("warmup", 200, "warmup steps", lower_bound=0)
    flags.DEFINE_integer("seed", 0, "init and data seed", lower_bound=0)
    flags.DEFINE_integer("save_every", 500, "checkpoint period (steps)", lower_bound=1)
    flags.DEFINE_integer("log_every", 500, "period (steps) of the records in train_log.json (loss, eval loss)",
                         lower_bound=1)
    flags.DEFINE_bool("progress", True, "a progress bar over the steps (loss, tokens/s) on stderr; --noprogress: "
                      "print each logged record instead")


def fit_kwargs() -> dict:
    """`loop.fit` keyword arguments from the flags: steps, AdamW schedule, checkpoints, logging."""
    return dict(steps=FLAGS.steps, tx=loop.adamw(FLAGS.lr, FLAGS.steps, FLAGS.warmup),
                ckpt_dir=FLAGS.ckpt_dir or os.path.abspath(FLAGS.out_dir) + ".ckpt", save_every=FLAGS.save_every,
                log_every=FLAGS.log_every, progress=FLAGS.progress)
