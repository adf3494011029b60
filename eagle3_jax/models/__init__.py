"""Flax NNX models and their configs. `gpt_oss` and `eagle3` load on first use, so that the configs
(`models.config`) import without the models (`eagle3_jax.parallel` needs only the configs; the
models need `parallel`)."""
import importlib

from eagle3_jax.models.config import Eagle3Config, GptOssConfig, RopeConfig

__all__ = ["eagle3", "gpt_oss", "Eagle3Config", "GptOssConfig", "RopeConfig"]


def __getattr__(name):
    if name in ("eagle3", "gpt_oss"):
        return importlib.import_module(f"eagle3_jax.models.{name}")
    raise AttributeError(f"module 'eagle3_jax.models' has no attribute {name!r}")
