"""eagle3_jax.parallel: sharded generate / decode give the one-device tokens (a subprocess with 4 CPU
devices, tests/parallel_decode.py; two processes of 2 CPU devices each through jax.distributed,
tests/parallel_multiprocess.py), the sharding table, and every promised error."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import local_processes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from eagle3_jax import parallel
from eagle3_jax.convert import random_gpt_oss
from eagle3_jax.models import Eagle3Config, GptOssConfig, eagle3, gpt_oss

HERE = os.path.dirname(os.path.abspath(__file__))


def abstract(data, model):
    return AbstractMesh((data, model), ("data", "model"))


@pytest.mark.slow
def test_sharded_generate_and_decode_match_one_device():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, os.path.join(HERE, "parallel_decode.py")], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), (r.stdout, r.stderr[-4000:])
    assert "mesh data=2 model=2: tokens equal (chain, sampled tree)" in r.stdout, r.stdout
    assert "mesh data=1 model=4: tokens equal (chain, generate)" in r.stdout, r.stdout


@pytest.mark.slow
def test_two_processes_match_one_device():
    port = local_processes.free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    outs = local_processes.run_all("parallel_multiprocess.py", [(i, port) for i in range(2)], [env] * 2)
    got = [json.loads(out.rstrip().splitlines()[-2]) for out in outs]  # process 0 checked its against one device
    assert got[0] == got[1] and set(got[0]) == {"tree"}, got


@pytest.mark.parametrize("experts", ["mxfp4", "dense"])
def test_sharding_table(experts):
    cfg = GptOssConfig.preset("tiny").replace(experts_format=experts)
    model = nnx.eval_shape(lambda: gpt_oss.GptOss(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    specs = {path: parallel.param_partition(model, path) for path, _ in parallel.variables(model)}
    experts_params = {p for p in specs if "/mlp/experts/" in p}
    assert len(experts_params) == cfg.num_hidden_layers * (6 if experts == "mxfp4" else 4)
    for path, spec in specs.items():
        name = path.split("/")[-1]
        if path in ("embed", "lm_head") or name in ("wqkv", "sinks", "bqkv") or path in experts_params:
            assert spec == P("model", None) or spec == P("model"), (path, spec)
        elif name == "wo":
            assert spec == P(None, "model"), (path, spec)
        else:  # norms, the o_proj bias, the router
            assert spec == P(), (path, spec)
    # the draft: replicated, but the target's embedding keeps the target's placement
    d = Eagle3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=256, draft_vocab_size=256, target_hidden_size=64, aux_layer_ids=(0, 1, 2),
                     target_num_layers=4, own_embed=False)
    draft = nnx.eval_shape(lambda: eagle3.random_eagle3(d, target=model))
    dspecs = {path: parallel.param_partition(draft, path) for path, _ in parallel.variables(draft)}
    assert dspecs.pop("embed") == P("model", None) and set(dspecs.values()) == {P()}, dspecs


@pytest.mark.parametrize("experts", ["mxfp4", "dense"])
def test_tensor_expert_split(experts):
    """experts="tensor": every expert's units over "model" (gate_up's rows, down's groups or columns),
    down's bias replicated; the units padded to what the mesh divides in whole groups, padding that
    adds nothing, cut off again by resize_units."""
    cfg = GptOssConfig.preset("tiny").replace(experts_format=experts, intermediate_size=96)
    model = nnx.eval_shape(lambda: gpt_oss.GptOss(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    for layer in model.layers:
        layer.mlp.expert_split = "tensor"
    specs = {p.split("/")[-1]: parallel.param_partition(model, p)
             for p, _ in parallel.variables(model) if "/experts/" in p}
    want = {"gate_up_bias": P(None, "model"), "down_bias": P()}
    want.update({"gate_up_blocks": P(None, "model"), "gate_up_scales": P(None, "model"),
                 "down_blocks": P(None, None, "model"), "down_scales": P(None, None, "model")} if experts == "mxfp4"
                else {"gate_up": P(None, "model"), "down": P(None, None, "model")})
    assert specs == want, specs
    assert parallel.expert_units(cfg, abstract(1, 4), "tensor") == (128 if experts == "mxfp4" else 96)
    assert parallel.expert_units(cfg, abstract(1, 4), "expert") == 96
    assert parallel.expert_units(cfg.replace(intermediate_size=2880), abstract(1, 4), "tensor") == (
        2944 if experts == "mxfp4" else 2880)
    rng = np.random.default_rng(np.random.randint(1 << 30))
    scales = jnp.asarray(rng.integers(0, 256, (2, 6, 3)), jnp.uint8)  # [E, 2I, H/32], I = 3
    grown = parallel.resize_units("gate_up_scales", scales, 5)
    assert grown.shape == (2, 10, 3) and (np.asarray(grown[:, 6:]) == 127).all()
    np.testing.assert_array_equal(np.asarray(parallel.resize_units("gate_up_scales", grown, 3)), np.asarray(scales))
    down = jnp.asarray(rng.integers(0, 256, (2, 4, 3, 16)), jnp.uint8)  # [E, H, I/32, 16], I = 96
    assert parallel.resize_units("down_blocks", down, 128).shape == (2, 4, 4, 16)
    assert not np.asarray(parallel.resize_units("down_blocks", down, 128)[:, :, 3]).any()
    with pytest.raises(ValueError, match=r"experts: 'heads', expected one of \('expert', 'tensor'\)"):
        parallel.expert_units(cfg, abstract(1, 2), "heads")
    for split in parallel.EXPERT_SPLITS:  # a split without a mesh: no default to fall back on
        with pytest.raises(ValueError, match=rf"experts='{split}' splits the experts over a mesh; pass mesh= or leave"):
            random_gpt_oss(cfg, experts=split)
    assert parallel.EXPERTS == "tensor"  # the default split (docs/perf/multi_gpu.md: faster at B=1 and 4)


def test_one_device_shard_and_cache_layout():
    (dev,) = jax.devices()[:1]
    mesh = parallel.make_mesh(devices=[dev])
    t = parallel.shard(gpt_oss.GptOss(GptOssConfig.preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0)), mesh)
    assert parallel.mesh_of(t) is mesh and t.embed.get_value().sharding.spec == P("model", None)
    assert parallel.cache_partition() == P("data", "model", None, None)
    assert parallel.cache_partition(heads=False) == P("data", None, None, None)
    assert parallel.mesh_of(gpt_oss.GptOss(GptOssConfig.preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))) is None


@pytest.mark.parametrize("change, what", [
    (dict(num_key_value_heads=2, num_attention_heads=4), "num_key_value_heads=2"),
    (dict(num_local_experts=6, num_experts_per_tok=2), "num_local_experts=6"),
    (dict(vocab_size=250, eos_token_ids=(1,)), "vocab_size=250"),
    (dict(num_key_value_heads=4, num_attention_heads=12), "num_attention_heads=12"),
])
def test_model_axis_must_divide(change, what):
    cfg = GptOssConfig.preset("tiny").replace(**change)
    with pytest.raises(ValueError, match=rf'mesh axis "model" of size 8 must divide .*{what}'):
        parallel.check_mesh(cfg, abstract(1, 8))
    parallel.check_mesh(cfg, abstract(4, 1))  # "data" splits rows only: no constraint


def test_gpt_oss_120b_fits_its_meshes():
    cfg = GptOssConfig.preset("gpt-oss-120b")
    for model in (1, 2, 4, 8):
        parallel.check_mesh(cfg, abstract(1, model))
    with pytest.raises(ValueError, match=r'"model" of size 16 must divide num_key_value_heads=8'):
        parallel.check_mesh(cfg, abstract(1, 16))


def test_bad_meshes():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"model={n + 1} = {n + 1} devices, but {n} available \(pass devices="):
        parallel.make_mesh(model=n + 1)
    with pytest.raises(ValueError, match=r"data=2 \* model=1 = 2 devices, but 1 given"):
        parallel.make_mesh(data=2, devices=jax.devices()[:1])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="make_mesh: model"):
            parallel.make_mesh(model=bad)
    with pytest.raises(ValueError, match="axes"):
        parallel.check_mesh(GptOssConfig.preset("tiny"), AbstractMesh((1, 1), ("batch", "model")))
    with pytest.raises(ValueError, match="GptOss"):
        parallel.shard(object(), parallel.make_mesh(devices=jax.devices()[:1]))
