"""Loaders and constructors that place parameters on a mesh as they build them (`load_gpt_oss`,
`load_eagle3`, `restore_checkpoint`, `random_gpt_oss` with `mesh=`): a subprocess with 4 CPU devices
(tests/parallel_load.py) checks them against `parallel.shard` of the one-device result, the byte
ranges they read and the bad-mesh errors; here, the block reader and assembler they stand on."""

import itertools
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from eagle3_jax.convert import params
from eagle3_jax.convert import safetensors_io as stio

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_sharded_loads_match_shard_of_one_device_load():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, os.path.join(HERE, "parallel_load.py")], capture_output=True, text=True,
                       timeout=300, env=env, cwd=HERE)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), (r.stdout, r.stderr[-4000:])
    for line in ("load_gpt_oss mxfp4: meshes", "load_gpt_oss dense: meshes", "nothing read", "load_eagle3:",
                 "restore_checkpoint:", "random_gpt_oss:"):
        assert line in r.stdout, r.stdout


@pytest.fixture
def tensors(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((6, 5, 4)).astype(np.float32),
              "b": rng.integers(0, 255, (7, 3), dtype=np.uint8),
              "h": rng.standard_normal((5, 8)).astype(ml_dtypes.bfloat16), "s": np.array(2.0, np.float32)}
    file = str(tmp_path / "x.safetensors")
    safetensors.numpy.save_file(arrays, file)
    return arrays, stio.read_header(file)


def test_read_blocks(tensors, monkeypatch):
    arrays, infos = tensors
    reads = []
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: reads.append(n) or pread(fd, n, at))
    cuts = [slice(None), slice(1, 3), slice(0, 1), slice(2, None), None]
    for key, a in arrays.items():
        for index in itertools.product(cuts, repeat=a.ndim):
            reads.clear()
            got = infos[key].read(index)
            want = a[tuple(slice(None) if s is None else s for s in index)]
            assert got.dtype == a.dtype and np.array_equal(got, want), (key, index)
            assert sum(reads) == want.nbytes, (key, index, reads)  # the block's bytes, nothing more
    reads.clear()
    infos["a"].read((slice(2, 4),))  # a leading-axis block: one read of its rows
    assert reads == [2 * 5 * 4 * 4]
    with pytest.raises(ValueError, match="slice step 2"):
        infos["a"].read((slice(0, 6, 2),))
    with pytest.raises(ValueError, match="3 slices for shape"):
        infos["b"].read((slice(None),) * 3)


def test_blocks_of_fused_and_transposed_parameters(tensors):
    """The draft's wqkv: [in, q | k | v] filled by three [out, in] tensors transposed, and the
    target's: [q | k | v, in] filled by them as stored; every block equals the same slice of the
    parameter assembled whole."""
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((n, 6)).astype(np.float32) for n in (8, 4, 4)]
    whole = np.concatenate([p.T for p in parts], axis=1).astype(ml_dtypes.bfloat16)
    cols = [(0, 8), (8, 12), (12, 16)]
    read = lambda a: lambda index: a[index].copy()  # noqa: E731
    sources = [params.Source(read(p), True, c) for p, c in zip(parts, cols)]
    for r0, r1, c0, c1 in [(0, 6, 0, 8), (0, 6, 8, 16), (2, 5, 6, 14), (0, 6, 0, 16), (1, 2, 12, 13)]:
        got = params.block(whole.shape, whole.dtype, sources, [(r0, r1), (c0, c1)])
        assert got.dtype == whole.dtype and np.array_equal(got, whole[r0:r1, c0:c1]), (r0, r1, c0, c1)
    # the target's wqkv: [q | k | v, in] filled along the first axis by the tensors as stored
    whole = np.concatenate(parts, axis=0).astype(ml_dtypes.bfloat16)
    sources = [params.Source(read(p), False, c, axis=0) for p, c in zip(parts, cols)]
    for r0, r1, c0, c1 in [(0, 8, 0, 6), (8, 16, 0, 6), (6, 14, 2, 5), (0, 16, 0, 6), (12, 13, 1, 2)]:
        got = params.block(whole.shape, whole.dtype, sources, [(r0, r1), (c0, c1)])
        assert got.dtype == whole.dtype and np.array_equal(got, whole[r0:r1, c0:c1]), (r0, r1, c0, c1)
    arrays, infos = tensors  # a plain tensor read from the file, cast
    got = params.block((6, 5, 4), np.float64, [params.Source(infos["a"].read)], [(1, 3), (0, 5), (2, 4)])
    assert got.dtype == np.float64 and np.array_equal(got, arrays["a"][1:3, :, 2:4])
