"""Flax NNX models and their configs."""
from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.models.config import Eagle3Config, GptOssConfig, RopeConfig

__all__ = ["eagle3", "gpt_oss", "Eagle3Config", "GptOssConfig", "RopeConfig"]
