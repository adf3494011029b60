import os
import shutil
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

# float32 parity tests mean float32: without this, GPUs run f32 matmuls in TF32 (~4e-3 error).
jax.config.update("jax_default_matmul_precision", "highest")

# One persistent XLA compilation cache for the whole run: the xdist workers and the experiment
# scripts that tests/test_experiments.py and test_bench_scripts.py run compile many of the same programs
# (the tiny models' initializers, their train steps, decode and generate loops, ...), and on CPU
# compiling is most of the suite's time. The process that starts first (the xdist controller, or
# the only process) makes a fresh directory and removes it at the end; workers and subprocesses
# inherit it through the environment, so a run never reads a cache left by an earlier run (a
# JAX_COMPILATION_CACHE_DIR set outside is used as it is and left alone).
# No size limit: with one, every write scans the whole directory (most of the time saved, spent
# again). Without one there is no file lock either; a process reading an entry another is still
# writing fails to decompress it, and JAX then warns and compiles the program itself.
_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
_made_cache_dir = None

# Compiling for speed costs more than the tests' programs run: on CPU, with LLVM at -O0 and without
# its expensive passes (jax_disable_most_optimizations) and with XLA's older CPU fusion emitters,
# which at -O0 compile in about half the time of the new MLIR ones, a tiny model's decode loop
# compiles in ~30% of the default's time (4.6 against 15.8 CPU-seconds for three of them) and the
# suite takes about half as long. The programs compute the same thing (no fast-math either way).
# Both reach the experiment scripts that tests run as subprocesses through the environment. Not on
# GPUs: there the settings stay as users have them. The XLA flag is only set where this jaxlib knows
# it (XLA aborts on an unknown flag): a probe process, started by the process that starts first.
_FAST_CPU_XLA_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _add_cpu_xla_flag():
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_use_fusion_emitters" in flags:
        return
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                           env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{flags} {_FAST_CPU_XLA_FLAG}"})
    if probe.returncode == 0:
        os.environ["XLA_FLAGS"] = f"{flags} {_FAST_CPU_XLA_FLAG}".strip()


# The files that take longest (mostly compiling), slowest first; the others follow in collection
# order. `--dist loadfile` hands whole files to the workers, by default those with the most tests
# first, which let the two slowest (few tests, a quarter of the suite's time) start late, often on one
# worker while the other sat idle at the end. With that reordering off the files go out in this
# order: longest first, the short ones fill in at the end, and the two workers finish together. A
# name missing here only loses that balance. A worker is handed its next file when it has two tests
# of its current one left, so the files after these (each under ~10 s) even out the end. Seconds of
# each in a whole run on the 2-core machine (its --durations): 130, 128, 105, 85, 60, 59, 48, 44, 43, 41, 36,
# 30, 30, 28, 28, 27, 22, 18, 17, 17, 7.
SLOW_FILES = ("test_bench_scripts.py", "test_parallel.py", "test_experiments.py", "test_decode.py",
              "test_compile_cache.py",
              "test_pallas_moe.py", "test_readme.py", "test_train.py", "test_notebooks.py", "test_ring_cache.py",
              "test_bench_memory.py", "test_generate.py", "test_pair.py", "test_sample_proposal.py",
              "test_pallas_attention.py", "test_parallel_load.py", "test_gpt_oss.py", "test_accept.py",
              "test_pallas_moe_route.py", "test_eagle3.py", "test_gpu_lowering.py", "test_transformers_parity.py")


def pytest_configure(config):
    global _made_cache_dir
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's scheduler
        config.option.loadscopereorder = False
    if "PYTEST_XDIST_WORKER" not in os.environ:  # xdist's workers inherit the first process's environment
        _add_cpu_xla_flag()
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        _made_cache_dir = tempfile.mkdtemp(prefix="eagle3_jax_xla_cache_")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _made_cache_dir
        for k, v in _CACHE_ENV.items():
            os.environ.setdefault(k, v)
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    for k in _CACHE_ENV:
        if k in os.environ:
            jax.config.update(k.lower(), type(getattr(jax.config, k.lower()))(os.environ[k]))


def pytest_unconfigure(config):
    if _made_cache_dir is not None:
        shutil.rmtree(_made_cache_dir, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: otherwise collection order
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:  # set outside: used as it is
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # for the subprocesses
        jax.config.update("jax_disable_most_optimizations", True)
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
