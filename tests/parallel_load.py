"""Run by tests/test_parallel_load.py in a fresh process with 4 CPU devices: the loaders and
constructors that place parameters on a mesh as they build them (`load_gpt_oss`, `load_eagle3`,
`restore_checkpoint`, `random_gpt_oss` with `mesh=`) give exactly `parallel.shard` of the one-device
result (values bitwise, the same shardings), read only the byte ranges of each device's shard, and
refuse a mesh that does not divide the config before reading anything.

Prints one line per check and "ok" at the end; any mismatch is an AssertionError (exit status 1)."""

import os
import re
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from eagle3_reference_np import random_draft_weights, tiny_draft_config, write_draft_checkpoint  # noqa: E402
from hf_fixtures import dense_from_mxfp4, random_hf_weights, tiny_hf_config, write_hf_checkpoint  # noqa: E402
from parallel_util import raises  # noqa: E402

from eagle3_jax import parallel  # noqa: E402
from eagle3_jax.convert import (  # noqa: E402
    load_eagle3,
    load_gpt_oss,
    random_gpt_oss,
    restore_checkpoint,
    save_checkpoint,
    save_gpt_oss,
)
from eagle3_jax.convert import safetensors_io as stio  # noqa: E402
from eagle3_jax.models import GptOssConfig  # noqa: E402

MESHES = [(1, 2), (2, 2), (1, 4)]  # (data, model)
# 8 query / 4 kv heads, so that model = 4 divides them; vocab 256 as the draft's
HF = tiny_hf_config(num_attention_heads=8, num_key_value_heads=4, vocab_size=256)
SHARDED_KEYS = r"model\.embed_tokens\.weight|lm_head\.weight|.*self_attn\.([qkv]_proj\.weight|o_proj\.weight)|" \
               r".*self_attn\.sinks|.*mlp\.experts\..*"


class Reads:
    """Records every TensorInfo.read (key, bytes, whole tensor or not, the tensor's bytes);
    TensorInfo.load (a whole memory map) raises meanwhile, but for a draft's d2t / t2d."""

    def __init__(self):
        self.log, self.read, self.load = [], stio.TensorInfo.read, stio.TensorInfo.load

    def __enter__(self):
        log, read, load = self.log, self.read, self.load

        def recording(info, index=()):
            a = read(info, index)
            log.append((info.key, a.nbytes, a.shape == tuple(info.shape), info.nbytes))
            return a

        def refuse(info):
            if info.key not in ("d2t", "t2d"):  # the draft's id maps: small, whole on every device
                raise AssertionError(f"{info.key}: whole tensor memory-mapped by a sharded load")
            return load(info)

        stio.TensorInfo.read, stio.TensorInfo.load = recording, refuse
        return self

    def __exit__(self, *exc):
        stio.TensorInfo.read, stio.TensorInfo.load = self.read, self.load


def mesh_of(data, model):
    return parallel.make_mesh(model=model, data=data, devices=jax.devices()[:data * model])


def same(got, want, what):
    """Every variable of `got` equals `want`'s bitwise, with the same sharding (modules or pytrees), and
    a GptOss's q|k|v columns are in the same order."""
    if hasattr(got, "layers"):
        assert [x.self_attn.qkv_blocks for x in got.layers] == [x.self_attn.qkv_blocks for x in want.layers], what
        assert [x.mlp.expert_split for x in got.layers] == [x.mlp.expert_split for x in want.layers], what
    g, w = parallel.variables(got), parallel.variables(want)
    assert [p for p, _ in g] == [p for p, _ in w], what
    for (path, x), (_, y) in zip(g, w):
        x, y = x.get_value(), y.get_value()
        assert x.dtype == y.dtype and x.shape == y.shape, (what, path, x.dtype, y.dtype)
        assert x.sharding == y.sharding, (what, path, x.sharding, y.sharding)
        assert np.array_equal(np.asarray(x), np.asarray(y)), (what, path)


def check_table(model, mesh, what):
    """Each parameter is on the table's NamedSharding, and sharded ones are really split."""
    for path, var in parallel.variables(model):
        x = var.get_value()
        assert x.sharding == parallel.param_sharding(model, mesh, path), (what, path, x.sharding)
    wqkv = model.layers[0].self_attn.wqkv.get_value()
    m = parallel.model_size(mesh)
    assert wqkv.addressable_shards[0].data.shape[0] == wqkv.shape[0] // m, (what, wqkv.sharding)


def check_reads(log, tensors, model, what, units=False):
    """Every tensor is read exactly once in all (a block that local devices share: once), and no
    read of a tensor split over "model" is more than its device's share: 1/model of the parameter
    it fills (for q/k/v: of the fused wqkv / bqkv, whose row blocks a whole q, k or v may fit).
    units: the experts were placed split by their units as read (down's bias whole on every device)."""
    total = {}
    for key, nbytes, _whole, full in log:
        total[key] = total.get(key, 0) + nbytes
        if units and key.endswith("down_proj_bias"):  # replicated under the units split: read whole
            assert nbytes == full, (what, key, nbytes, full)
        elif re.fullmatch(SHARDED_KEYS, key):
            fused = re.fullmatch(r"(.*self_attn\.)[qkv](_proj\.\w+)", key)
            param = sum(tensors[fused[1] + c + fused[2]].nbytes for c in "qkv") if fused else full
            assert nbytes <= param // model, (what, key, nbytes, param)
    assert total == {k: t.nbytes for k, t in tensors.items()}, (what, {k: (v, tensors[k].nbytes) for k, v in
                                                                       total.items() if v != tensors[k].nbytes})


def check_written(model, tensors, path, what):
    """save_gpt_oss of a model placed on a mesh writes exactly the checkpoint's tensors."""
    save_gpt_oss(model, path, overwrite=True)  # the same folder for every placement
    written = stio.open_checkpoint(path)
    assert set(written) == set(tensors), what
    for key, info in tensors.items():
        assert np.array_equal(written[key].load(), info.load()), (what, key)


def check_gpt_oss(root):
    w = random_hf_weights(HF, seed=3)
    target = None
    for experts, weights in (("mxfp4", w), ("dense", dense_from_mxfp4(w))):
        t0 = time.perf_counter()
        path = os.path.join(root, experts)
        write_hf_checkpoint(path, HF, weights, num_shards=3)
        tensors = stio.open_checkpoint(path)
        for data, model in MESHES:
            mesh = mesh_of(data, model)
            for dtype in (jnp.float32,) if (data, model) != (1, 4) else (jnp.float32, jnp.bfloat16):
                want = parallel.shard(load_gpt_oss(path, dtype=dtype, progress=False), mesh)
                with Reads() as reads:
                    got = load_gpt_oss(path, dtype=dtype, mesh=mesh, progress=False)
                same(got, want, (experts, data, model))
                check_table(got, mesh, (experts, data, model))
                # the default units split, placed as read where the mesh divides the units in whole
                # 32-input groups (64 units: 2 devices; over 4 they are padded, so placed whole-expert first)
                direct = HF["intermediate_size"] % ((32 if experts == "mxfp4" else 1) * model) == 0
                assert {layer.mlp.expert_split for layer in got.layers} == {"tensor"}
                check_reads(reads.log, tensors, model, (experts, data, model), units=direct)
                if dtype == jnp.bfloat16:  # written back from the mesh (q|k|v in head-aligned blocks): the same file
                    check_written(got, tensors, os.path.join(root, "written"), (experts, data, model))
                    # the experts split "tensor" (units padded 64 -> 128 over 4 devices): placed as shard
                    # places them, and written back unpadded
                    got = load_gpt_oss(path, dtype=dtype, mesh=mesh, experts="tensor", progress=False)
                    same(got, parallel.shard(load_gpt_oss(path, dtype=dtype, progress=False), mesh, experts="tensor"),
                         (experts, data, model, "tensor"))
                    check_table(got, mesh, (experts, data, model, "tensor"))
                    check_written(got, tensors, os.path.join(root, "written"), (experts, data, model, "tensor"))
                if experts == "mxfp4" and (data, model) == (1, 2) and dtype == jnp.float32:
                    target = (path, got)
        print(f"load_gpt_oss {experts}: meshes {MESHES} equal parallel.shard, byte ranges only: "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    # the tiny preset's 2 kv heads over 4 devices: refused before any tensor is read
    path = os.path.join(root, "two_kv_heads")
    write_hf_checkpoint(path, tiny_hf_config(), random_hf_weights(tiny_hf_config(), seed=4))
    with Reads() as reads:
        raises(lambda: load_gpt_oss(path, mesh=mesh_of(1, 4)), r'mesh axis "model" of size 4 must divide '
                                                                r'num_key_value_heads=2$')
    assert reads.log == [], reads.log
    print("load_gpt_oss: a mesh that does not divide the kv heads: ValueError, nothing read", flush=True)
    return target


def check_eagle3(root, target_path, target):
    t0 = time.perf_counter()
    mesh = parallel.mesh_of(target)
    ref_target = load_gpt_oss(target_path, dtype=jnp.float32, progress=False)
    for name, kw in (("own", {}), ("borrowed", dict(embed=False))):
        cfg = tiny_draft_config(hidden_size=64)
        path = os.path.join(root, f"draft_{name}")
        write_draft_checkpoint(path, cfg, random_draft_weights(cfg, 5, **kw))
        want = parallel.shard(load_eagle3(path, target=ref_target), mesh)
        with Reads() as reads:
            got = load_eagle3(path, target=target, mesh=mesh)
        same(got, want, name)
        for path_, var in parallel.variables(got):
            assert var.get_value().sharding == parallel.param_sharding(got, mesh, path_), (name, path_)
        assert all(key in ("d2t", "t2d") or whole for key, _, whole, _ in reads.log), reads.log  # replicated
        if name == "borrowed":
            assert got.embed is target.embed
    bad = parallel.make_mesh(model=3, devices=jax.devices()[:3])
    with Reads() as reads:
        raises(lambda: load_eagle3(path, target=ref_target, mesh=bad), r'mesh axis "model" of size 3 must divide '
                                                                        r'vocab_size=256$')
    assert reads.log == [], reads.log
    print(f"load_eagle3: own and borrowed embedding equal parallel.shard: {time.perf_counter() - t0:.1f} s",
          flush=True)


def check_orbax(root, target_path, target):
    """target: a model on a (1, 2) mesh (its q|k|v columns head-aligned): saved, it restores to the
    one-device load, and on a (2, 2) mesh to parallel.shard of that."""
    t0 = time.perf_counter()
    directory = os.path.join(root, "orbax")
    save_checkpoint(target, directory)
    same(restore_checkpoint(directory), load_gpt_oss(target_path, dtype=jnp.float32, progress=False), "orbax")
    mesh = mesh_of(2, 2)
    same(restore_checkpoint(directory, mesh=mesh), parallel.shard(restore_checkpoint(directory), mesh), "orbax")
    bad = parallel.make_mesh(model=3, devices=jax.devices()[:3])
    raises(lambda: restore_checkpoint(directory, mesh=bad), r'mesh axis "model" of size 3 must divide')
    # a model with its experts split "tensor" (padded over 4 devices) saves the unpadded experts
    mesh = mesh_of(1, 4)
    split = parallel.shard(restore_checkpoint(directory), mesh, experts="tensor")
    save_checkpoint(split, os.path.join(root, "orbax_tensor"))
    same(restore_checkpoint(os.path.join(root, "orbax_tensor")), restore_checkpoint(directory), "orbax tensor")
    same(restore_checkpoint(directory, mesh=mesh, experts="tensor"), split, "orbax tensor")
    print(f"restore_checkpoint: equals parallel.shard: {time.perf_counter() - t0:.1f} s", flush=True)


def check_random():
    t0 = time.perf_counter()
    cfg = GptOssConfig.preset("tiny").replace(num_attention_heads=8, num_key_value_heads=4)
    for experts, (data, model) in (("mxfp4", (2, 2)), ("dense", (1, 4))):  # seconds a build (compiling)
        c = cfg.replace(experts_format=experts)
        mesh = mesh_of(data, model)
        for split in ("expert", "tensor") if experts == "mxfp4" else ("expert",):
            got = random_gpt_oss(c, seed=7, dtype=jnp.float32, mesh=mesh, experts=split)
            same(got, parallel.shard(random_gpt_oss(c, seed=7, dtype=jnp.float32), mesh, experts=split),
                 (experts, data, model, split))
            check_table(got, mesh, ("random", experts, data, model, split))
    raises(lambda: random_gpt_oss(GptOssConfig.preset("tiny"), mesh=mesh_of(1, 4)),
           r'mesh axis "model" of size 4 must divide num_key_value_heads=2$')
    print(f"random_gpt_oss: equals parallel.shard of the one-device weights: {time.perf_counter() - t0:.1f} s",
          flush=True)


def main():
    assert jax.device_count() == 4, jax.devices()
    with tempfile.TemporaryDirectory() as root:
        target_path, target = check_gpt_oss(root)
        check_eagle3(root, target_path, target)
        check_orbax(root, target_path, target)
    check_random()
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
