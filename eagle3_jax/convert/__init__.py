"""Checkpoint converters: Hugging Face layouts <-> this library's modules."""
from eagle3_jax.convert import folders, frspec
from eagle3_jax.convert.frspec import coverage, restrict_head, select_draft_vocab, token_frequencies
from eagle3_jax.convert.hf_eagle3 import load_eagle3, save_eagle3
from eagle3_jax.convert.hf_gpt_oss import (
    load_gpt_oss,
    random_gpt_oss,
    restore_checkpoint,
    save_checkpoint,
    save_gpt_oss,
)
from eagle3_jax.formats.tokenizer import load_tokenizer
from eagle3_jax.models.eagle3 import random_eagle3

__all__ = ["load_gpt_oss", "load_tokenizer", "save_gpt_oss", "save_checkpoint", "restore_checkpoint", "random_gpt_oss",
           "load_eagle3", "save_eagle3", "random_eagle3", "folders", "frspec", "token_frequencies",
           "select_draft_vocab", "coverage", "restrict_head"]
