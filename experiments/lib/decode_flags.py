"""The flags that the scripts decoding prompts (decode.py, eval_tau.py) share: the draft's shape and
proposal, the temperature and the sampling filters, and the chat template's settings and stop tokens.

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
    """Defines --num_spec_tokens, --branching, --topk (deprecated), --num_draft_tokens, --temperature,
    --proposal, --top_k, --top_p, --min_p, --chat_template, --reasoning_effort and --eos."""
    flags.DEFINE_integer("num_spec_tokens", 3, "draft depth", lower_bound=1)
    flags.DEFINE_integer("branching", 1, "children per expanded draft node (1 = chain)", lower_bound=1)
    flags.DEFINE_integer("topk", None, "deprecated name of --branching (children per draft node; the sampling "
                         "filter is --top_k)", lower_bound=1)
    flags.DEFINE_integer("num_draft_tokens", None, "tree nodes including the root (default: chain length + 1)",
                         lower_bound=2)
    flags.DEFINE_float("temperature", 0.0, "0 = greedy", lower_bound=0.0)
    flags.DEFINE_enum("proposal", "deterministic", ["deterministic", "sample"], "drafts: top-k (deterministic), or "
                      "drawn from the draft at --temperature > 0 and verified by rejection with its probabilities")
    flags.DEFINE_integer("top_k", None, "sampling filter: the k likeliest tokens (and those tied with the k-th)",
                         lower_bound=1)
    flags.DEFINE_float("top_p", None, "sampling filter: the likeliest tokens holding this share of the mass, in "
                       "(0, 1]", lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_float("min_p", None, "sampling filter: tokens at least this times as likely as the likeliest, in "
                       "[0, 1]", lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_string("chat_template", None, "a jinja chat template file to use instead of the target's")
    flags.DEFINE_enum("reasoning_effort", None, ["low", "medium", "high"], "gpt-oss's reasoning effort, a chat "
                      "template variable (default: the template's own)")
    flags.DEFINE_multi_string("eos", None, "stop token: an id or a token's text such as '<|call|>' (repeatable; "
                              "'none': no stop tokens); default: the checkpoint's (generation_config.json's "
                              "eos_token_id, else config.json's)")


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
