"""Flax NNX models and their configs."""
from eagle3_jax.models import gpt_oss
from eagle3_jax.models.config import GptOssConfig, RopeConfig

__all__ = ["gpt_oss", "GptOssConfig", "RopeConfig"]
