"""gpt-oss-120b-sized MoE layers split over 2 or 4 GPUs of one process, both splits of `parallel`
(every expert's units: the default, padded to 2944 at 4 devices; whole experts a device), through
the Pallas MoE kernels each GPU runs on its shard: equal to the same layer on one GPU. Decode-sized
calls take the decode kernel, prefill-sized ones the grouped kernel. Skipped without 2 GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax import parallel
from eagle3_jax.convert import random_gpt_oss
from eagle3_jax.models import GptOssConfig
from eagle3_jax.pallas import select

pytestmark = pytest.mark.gpu

# one layer of gpt-oss-120b's sizes (H = I = 2880, 4 of 16 experts a token: tokens share experts),
# the vocabulary cut to what every mesh divides
CONFIG = GptOssConfig.preset("gpt-oss-120b").replace(num_hidden_layers=1, layer_types=(), num_local_experts=16,
                                                     vocab_size=1024, eos_token_ids=(1,), pad_token_id=1,
                                                     bos_token_id=0)


def gpus():
    return [d for d in jax.devices() if d.platform == "gpu"]


def moe_out(moe, x, mesh=None, path=None):
    """The layer's f32 output for bf16 rows x [T, H] through `path` (None: chosen by size), traced
    under the mesh as decode traces it."""
    ctx = parallel.context(mesh)

    @jax.jit
    def run(moe, rows):
        return moe(rows, path=path, dtype=jnp.float32, ctx=ctx)

    rows = x if mesh is None else jax.device_put(x, NamedSharding(mesh, P()))
    return np.asarray(run(moe, rows), np.float64)


@pytest.mark.parametrize("split", ["tensor", "expert"])
def test_split_layers_equal_one_gpu(split):
    if len(gpus()) < 2:
        pytest.skip("needs 2 GPUs")
    M = 4 if len(gpus()) >= 4 else 2
    mesh = parallel.make_mesh(model=M, devices=gpus()[:M])
    one = random_gpt_oss(CONFIG, seed=3).layers[0].mlp
    split_moe = random_gpt_oss(CONFIG, seed=3, mesh=mesh, experts=split).layers[0].mlp
    assert split_moe.expert_split == split
    for moe in (one, split_moe):  # biases as large as the experts' outputs: added once, or the sum shows it
        for name in ("gate_up_bias", "down_bias"):
            var = getattr(moe.experts, name)
            var.set_value(jax.device_put(var.get_value() * 50, var.get_value().sharding))
    I, step = CONFIG.intermediate_size, 32 * M  # units split: whole 32-input groups a device (2880 -> 2944 at 4)
    units = -(-I // step) * step if split == "tensor" else I
    assert split_moe.experts.gate_up_bias.get_value().shape == (CONFIG.num_local_experts, 2 * units)
    rng = np.random.default_rng(np.random.randint(1 << 30))
    # the decode kernel (1, 16 rows, chosen by size) and the grouped kernel (300 rows; by size 16 experts
    # would run dense)
    for T, path in ((1, None), (16, None), (300, "grouped")):
        x = jnp.asarray(rng.normal(0, 4, (T, CONFIG.hidden_size)), jnp.bfloat16)
        by_size = select.moe(x, num_experts=CONFIG.num_local_experts, top_k=CONFIG.num_experts_per_tok, packed=True)
        assert path or by_size == "kernel", by_size
        want, got = moe_out(one, x, path=path), moe_out(split_moe, x, mesh, path)
        assert np.isfinite(got).all()
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 1e-2, (split, M, T, err)
