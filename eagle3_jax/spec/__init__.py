"""Speculative decoding and the baseline generator."""
from eagle3_jax.checks import ArgumentError
from eagle3_jax.spec.decode import Output, decode, generate, prefill_chunk_for

__all__ = ["ArgumentError", "Output", "decode", "generate", "prefill_chunk_for"]
