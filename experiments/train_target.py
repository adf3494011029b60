"""Pretrain the small GPT-OSS target on the stdlib corpus and write it in the HF layout (MXFP4 experts).

  python experiments/make_data.py --out_dir data/stdlib
  python experiments/train_target.py --data_dir data/stdlib --out_dir runs/target --steps 3000

Next-token cross-entropy on random windows of the train split (eagle3_jax.train.target, .loop):
float32 weights and dense experts while training, then the experts packed to MXFP4 and the rest cast
to bf16. Resumable: rerun with the same --ckpt_dir. Writes out_dir/{config.json, model.safetensors,
tokenizer.json} and out_dir/train_log.json (loss curve, eval loss of the trained and of the packed
model, command, device, JAX version), all at once when done (eagle3_jax.convert.folders: a run
stopped at any point leaves out_dir as it was). A non-empty out_dir is refused before training
unless --overwrite (its checkpoint files are then replaced, other files kept).
"""

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from lib import cli, train_flags
from lib.timing import device_info

from eagle3_jax.convert import folders, save_gpt_oss
from eagle3_jax.models import gpt_oss
from eagle3_jax.train import data, loop
from eagle3_jax.train import target as ttarget

train_flags.define("runs/target", steps=2500, batch=64)

flags.DEFINE_integer("eval_batches", 8, "eval-split windows of batch x seq_len for the eval loss", lower_bound=1)
flags.DEFINE_string("size", "small", "small (the shipped pair) or tiny (smoke tests: 2 layers, one sliding and one "
                    "full, at a quarter of the width)")
flags.DEFINE_bool("overwrite", False, "replace the checkpoint files of a non-empty --out_dir (other files kept)")
FLAGS = flags.FLAGS
WRITER = "train_target.py --out_dir"


def config(vocab_size):
    if FLAGS.size == "tiny":
        return ttarget.small_config(vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return ttarget.small_config(vocab_size)


def eval_loss(model, tokens, n):
    """Mean next-token loss over n fixed eval windows [batch, seq_len + 1]."""
    rng = np.random.default_rng(1234)
    return float(np.mean([_loss(model, {"tokens": jnp.asarray(data.sample_windows(tokens, rng, FLAGS.batch,
                                                                                   FLAGS.seq_len + 1))})
                          for _ in range(n)]))


@jax.jit
def _loss(model, batch):
    return ttarget.lm_loss(model, batch)[0]


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    folders.check_target(FLAGS.out_dir, WRITER, FLAGS.overwrite, "--overwrite")  # before the work
    meta = json.load(open(os.path.join(FLAGS.data_dir, "meta.json")))
    train, evals = data.load_split(FLAGS.data_dir, "train"), data.load_split(FLAGS.data_dir, "eval")
    cfg = config(meta["vocab_size"])
    model = ttarget.new_model(cfg, FLAGS.seed)
    print(f"target {gpt_oss.param_bytes(model) / 4e6:.1f}M weights on {jax.devices()[0].device_kind}; "
          f"{len(train)} train tokens, {FLAGS.batch}x{FLAGS.seq_len} per step", flush=True)

    def batch_fn(step):
        rng = np.random.default_rng((FLAGS.seed, step))
        return {"tokens": data.sample_windows(train, rng, FLAGS.batch, FLAGS.seq_len + 1)}

    t0 = time.time()
    history = loop.fit(model, ttarget.lm_loss, batch_fn, eval_fn=lambda m: {"loss": eval_loss(m, evals, 2)},
                       **train_flags.fit_kwargs())
    train_seconds = time.time() - t0
    packed = ttarget.to_mxfp4(model)
    result = dict(**device_info(), config=cfg.to_hf(), data=meta["splits"], history=history,
                  train_seconds=train_seconds, eval_loss_f32_dense=eval_loss(model, evals, FLAGS.eval_batches))
    ttarget.set_moe_path(packed, "dense")  # many tokens at once: every expert, dequantized once
    result["eval_loss_bf16_mxfp4"] = eval_loss(packed, evals, FLAGS.eval_batches)
    ttarget.set_moe_path(packed, None)
    with folders.staged(FLAGS.out_dir, WRITER, FLAGS.overwrite, "--overwrite") as tmp:
        save_gpt_oss(packed, tmp)
        shutil.copy(os.path.join(FLAGS.data_dir, "tokenizer.json"), tmp)
        with open(os.path.join(tmp, "train_log.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"eval loss: trained {result['eval_loss_f32_dense']:.4f}, packed {result['eval_loss_bf16_mxfp4']:.4f} "
          f"nats/token; wrote {FLAGS.out_dir}", flush=True)


if __name__ == "__main__":
    cli.run(main)
