"""The draft-tree and sampling-filter flags of the scripts that decode prompts (decode.py, eval_tau.py).

- `--branching`: children per expanded draft node (1: a chain), decode()'s `branching`; `--topk`, its
  old name, still works with a warning on stderr (both given: ValueError).
- `--top_k`, `--top_p`, `--min_p`: the sampling filters of generate() and decode() (None: off), the
  names transformers and vLLM use; the library checks their values (top_p in (0, 1], min_p in [0, 1])
  and ignores them at temperature 0, where `note` says so.
"""

from __future__ import annotations

import sys

from absl import flags

FLAGS = flags.FLAGS


def define() -> None:
    """Defines --branching, --topk (deprecated), --top_k, --top_p and --min_p."""
    flags.DEFINE_integer("branching", 1, "children per expanded draft node (1 = chain)", lower_bound=1)
    flags.DEFINE_integer("topk", None, "deprecated name of --branching (children per draft node; the sampling "
                         "filter is --top_k)", lower_bound=1)
    flags.DEFINE_integer("top_k", None, "sampling filter: the k likeliest tokens (and those tied with the k-th)",
                         lower_bound=1)
    flags.DEFINE_float("top_p", None, "sampling filter: the likeliest tokens holding this share of the mass, in "
                       "(0, 1]", lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_float("min_p", None, "sampling filter: tokens at least this times as likely as the likeliest, in "
                       "[0, 1]", lower_bound=0.0, upper_bound=1.0)


def branching() -> int:
    """--branching, or the deprecated --topk (a warning on stderr); ValueError when both are given."""
    if FLAGS.topk is None:
        return FLAGS.branching
    if FLAGS["branching"].present:
        raise ValueError(f"--topk {FLAGS.topk} and --branching {FLAGS.branching}: --topk is the deprecated name of "
                         "--branching; give --branching only")
    print("warning: --topk is deprecated: it is --branching (children per draft node); the sampling filter is "
          "--top_k", file=sys.stderr, flush=True)
    return FLAGS.topk


def filters() -> dict:
    """generate() / decode() keyword arguments of the filter flags: top_k, top_p, min_p (None: off)."""
    return dict(top_k=FLAGS.top_k, top_p=FLAGS.top_p, min_p=FLAGS.min_p)


def note() -> str | None:
    """A line for filters given at temperature 0 (where they change nothing), else None."""
    given = [f"--{k}" for k, v in filters().items() if v is not None]
    if given and FLAGS.temperature == 0:
        return f"note: {', '.join(given)} change nothing at --temperature 0 (greedy takes the likeliest token)"
    return None
