"""The embedded trained pair (`stdlib-gpt-oss/`): a 6-layer GPT-OSS and its EAGLE-3 draft.

    from eagle3_jax.assets import load_pair, eval_prompts
    target, draft, tokenizer = load_pair()         # float32 on CPU, bfloat16 on GPU
    prompts = eval_prompts()[:2]                   # held-out stdlib snippets, 128 token ids each
    text = tokenizer.decode(prompts[0])

Both models are ordinary checkpoints (`load_gpt_oss(TARGET_DIR)`, `load_eagle3(DRAFT_DIR,
target=...)`); `stdlib-gpt-oss/README.md` says how they were trained and what they score.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from eagle3_jax.convert import load_eagle3, load_gpt_oss, load_tokenizer  # load_tokenizer: re-exported

PAIR_DIR = os.path.join(os.path.dirname(__file__), "stdlib-gpt-oss")
TARGET_DIR = os.path.join(PAIR_DIR, "target")
DRAFT_DIR = os.path.join(PAIR_DIR, "draft")

__all__ = ["PAIR_DIR", "TARGET_DIR", "DRAFT_DIR", "default_dtype", "load_pair", "load_tokenizer", "eval_prompts"]


def default_dtype() -> jnp.dtype:
    """bfloat16 on GPUs; float32 elsewhere (faster on CPUs, and decode == generate bit for bit)."""
    return jnp.dtype(jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)


def load_pair(dtype=None):
    """(target GptOss, draft Eagle3, tokenizers.Tokenizer) of the embedded pair, on the default device.

    dtype None: `default_dtype()`; the draft follows the target's dtype and shares its embedding."""
    target = load_gpt_oss(TARGET_DIR, dtype=default_dtype() if dtype is None else dtype)
    return target, load_eagle3(DRAFT_DIR, target=target), load_tokenizer(TARGET_DIR)


def eval_prompts() -> list[list[int]]:
    """The 32 held-out prompts (128 token ids each, from stdlib files outside the training split)."""
    with open(os.path.join(PAIR_DIR, "eval_prompts.json")) as f:
        return json.load(f)
