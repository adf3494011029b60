import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

# float32 parity tests mean float32: without this, GPUs run f32 matmuls in TF32 (~4e-3 error).
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
