"""generate / decode refuse a batch x context that cannot fit device memory before they allocate it
(eagle3_jax/spec/memory.py): the state's bytes before compiling, the compiled program's after
compiling and before running, a device's share on a mesh. The CPU reports no free memory, so these
tests name it (memory_limit=, or stand-in devices for `free_bytes`)."""

import re
import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from test_soak import CONFIG, DRAFT  # the soak's pair: the program compiled here is one of its programs

from eagle3_jax import parallel
from eagle3_jax.checks import ArgumentError
from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.spec import decode, generate, loop, memory
from eagle3_jax.spec.state import Plan

PROMPTS = [[5, 6, 7], [9, 8, 7, 6]]
KW = dict(eos_ids=(), prefill_chunk=8)


@pytest.fixture(scope="module")
def pair():
    t = gpt_oss.GptOss(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0))
    return t, eagle3.Eagle3(DRAFT, dtype=jnp.float32, rngs=nnx.Rngs(1))


def largest(message) -> int:
    return int(re.search(r"the largest batch that fits is (?:about )?(\d+)", message).group(1))


def test_a_state_that_cannot_fit_is_refused_before_compiling(pair):
    t, d = pair
    before = len(loop.COMPILED)
    plan = Plan(cache_len=256, out_len=256, chunk=8, greedy=True)
    need = memory.state_bytes((t, None), plan, 2)
    with pytest.raises(ValueError, match=r"^prompts: a batch of 2 with 256 cache slots a row does not fit device "
                                         rf"memory: its decode state \(KV caches and outputs\) needs {need} bytes a "
                                         rf"device, {need - 1} bytes is free a device \(memory_limit\); the largest "
                                         r"batch that fits is 1$"):
        generate(t, PROMPTS, 4, **KW, memory_limit=need - 1)
    # decode's state holds the draft's caches too: a limit its target's state fits still refuses it
    plan = Plan(cache_len=256, out_len=256, chunk=8, greedy=True, depth=3, num_nodes=4)
    spec_need = memory.state_bytes((t, d), plan, 2)
    assert spec_need > need + 2 * 4 * 256  # more than the target's state and the outputs: the draft's cache
    with pytest.raises(ValueError, match=rf"needs {spec_need} bytes a device, {need} bytes is free") as e:
        decode(t, d, PROMPTS, 4, **KW, memory_limit=need)
    n = largest(str(e.value))
    assert memory.state_bytes((t, d), plan, n) <= need < memory.state_bytes((t, d), plan, n + 1)
    assert len(loop.COMPILED) == before  # refused before compiling


def test_a_program_that_cannot_fit_is_refused_after_compiling_before_running(pair):
    t, _ = pair
    plan = Plan(cache_len=256, out_len=256, chunk=8, greedy=True)
    state = memory.state_bytes((t, None), plan, 1)
    with pytest.raises(ValueError, match=r"the compiled program needs .* a device \(XLA's buffer assignment: the "
                                         rf"decode state {state} bytes, other.* the largest batch that fits is "
                                         r"about 0 "):
        generate(t, PROMPTS[:1], 4, **KW, memory_limit=state)  # the state fits, its temporaries do not
    program = memory.program_bytes(next(reversed(loop.COMPILED.values())))
    assert program > state
    out = generate(t, PROMPTS[:1], 4, **KW, memory_limit=program + 4096)  # the program and its host arguments
    assert out.metrics["compile_seconds"] == 0  # compiled once, by the call that was refused
    assert out.tokens == generate(t, PROMPTS[:1], 4, **KW).tokens  # CPU: no figures, no check


def test_a_mesh_counts_each_devices_share():
    """Per device: the target's caches over data x model (as parallel.cache_partition splits them), the
    rest of a row over data; the batch rounded up to the data axis."""
    t = nnx.eval_shape(lambda: gpt_oss.GptOss(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    plan = Plan(cache_len=256, out_len=256, chunk=8, greedy=True)
    mesh = AbstractMesh((2, 2), ("data", "model"))
    caches = jax.eval_shape(lambda: gpt_oss.init_cache(t, 6, plan.cache_len, max_step_tokens=plan.step_tokens))
    shard = NamedSharding(mesh, parallel.cache_partition())
    cache_share = sum(4 * int(jnp.prod(jnp.array(shard.shard_shape(a.shape)))) for a in jax.tree.leaves(caches))
    rows = memory.state_bytes((t, None), plan, 6, mesh) - cache_share
    assert rows == 3 * (plan.out_len * 4 + memory.ROW_SCALARS)  # 3 of the 6 rows a device
    assert memory.state_bytes((t, None), plan, 5, mesh) == memory.state_bytes((t, None), plan, 6, mesh)
    need = memory.state_bytes((t, None), plan, 6, mesh)
    with pytest.raises(ValueError, match=rf"needs {need} bytes a device, {need - 1} bytes is free .* fits is 4$"):
        memory.check_state((t, None), plan, 6, need - 1, mesh)  # a multiple of the data axis


def test_free_memory_is_the_fewest_bytes_any_device_has():
    def device(stats):
        return types.SimpleNamespace(memory_stats=lambda: stats)

    gpu = [device(dict(bytes_limit=80, bytes_in_use=30)), device(dict(bytes_limit=80, bytes_in_use=50))]
    assert memory.free_bytes(gpu) == 30
    assert memory.free_bytes(gpu + [device(None)]) is None  # a CPU: no figures, no check
    assert memory.free_bytes(jax.devices("cpu")) is None


def test_bad_memory_limit(pair):
    t, d = pair
    with pytest.raises(ArgumentError, match=r"^memory_limit: expected an integer or None, got 1.5$"):
        generate(t, PROMPTS, 4, memory_limit=1.5)
    with pytest.raises(ValueError, match=r"^memory_limit: must be an integer >= 0, got -1$"):
        decode(t, d, PROMPTS, 4, memory_limit=-1)


def added_row_bytes(models, plan, prompt_len: int) -> int:
    """The bytes one more row adds to the DecodeState `loop.init_state` builds for `plan` (traced, not
    run; prompts of prompt_len tokens, PRNG keys not counted)."""
    def state_bytes(B):
        state = jax.eval_shape(lambda: loop.init_state(
            models, jnp.zeros((B, prompt_len), jnp.int32), jnp.full((B,), 3, jnp.int32), jnp.int32(4),
            jnp.zeros((8,), jnp.int32), jnp.float32(1.0), jax.random.key(0), None, plan, parallel.ONE_DEVICE))
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state) if not jnp.issubdtype(
            a.dtype, jax.dtypes.prng_key))

    return state_bytes(2) - state_bytes(1)


def test_row_bytes_are_the_decode_states(pair):
    """`memory.row_bytes`, counted by hand (the caches, outputs, ROW_SCALARS, the draft's hidden state),
    equals what one more row adds to the DecodeState that `loop.init_state` builds for a chain of 3
    (traced, not run): a field added to the state's rows without updating the count fails here."""
    t, d = pair
    plan = Plan(cache_len=64, out_len=32, chunk=8, greedy=True, depth=3, branching=1, num_nodes=4,
                feature_ids=tuple(d.config.feature_layers))

    assert memory.row_bytes((t, d), plan) == added_row_bytes((t, d), plan, prompt_len=8)
