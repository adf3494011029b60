"""Speculative decoding and the baseline generator."""
from eagle3_jax.spec.decode import Output, generate

__all__ = ["Output", "generate"]
