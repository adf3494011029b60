"""Build the offline training corpus: the standard library's *.py, a byte-level BPE, train / eval arrays.

  python experiments/make_data.py --out_dir data/stdlib --vocab_size 4096

Writes tokenizer.json, train.npy, eval.npy and meta.json (eagle3_jax.train.data.build_dataset) and
prints files, tokens and bytes per token of each split.
"""

import time

from absl import flags
from lib import cli

from eagle3_jax.train.data import build_dataset

flags.DEFINE_string("out_dir", "data/stdlib", "output directory")
flags.DEFINE_integer("vocab_size", 4096, "BPE vocabulary size, eos and the 256 bytes included", lower_bound=257)
flags.DEFINE_float("eval_fraction", 0.02, "fraction of files (by sha256 of the path) in the eval split",
                   lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_string("root", None, "corpus root (default: this Python's standard library)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    t0 = time.perf_counter()
    meta = build_dataset(FLAGS.out_dir, FLAGS.vocab_size, FLAGS.eval_fraction, FLAGS.root)
    seconds = time.perf_counter() - t0
    print(f"corpus {meta['stdlib_root']} (Python {meta['python_version']}), "
          f"{len(meta['skipped_non_utf8'])} non-UTF-8 files skipped")
    print(f"vocab {meta['vocab_size']}, eos id {meta['eos_id']}, dtype {meta['dtype']}")
    for split, s in meta["splits"].items():
        print(f"{split:5s}: {s['files']:5d} files {s['tokens']:10d} tokens {s['bytes']:11d} bytes "
              f"{s['bytes'] / s['tokens']:.2f} bytes/token")
    print(f"wrote {FLAGS.out_dir} in {seconds:.1f} s")


if __name__ == "__main__":
    cli.run(main)
