"""EAGLE-3 speculative decoding of GPT-OSS in JAX / Flax NNX / Pallas."""
