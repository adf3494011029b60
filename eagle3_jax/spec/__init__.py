"""Speculative decoding and the baseline generator."""
from eagle3_jax.spec.decode import Output, decode, generate

__all__ = ["Output", "decode", "generate"]
