"""Run by tests/test_parallel.py in a fresh process with 4 CPU devices: generate and decode (chain,
sampled tree under the sampling filters; the greedy tree on a batch the data axis does not divide)
on sharded models give the one-device tokens (also with the experts split "expert", not only the
default "tensor"), and
parameters, caches and state are split; a verify step sums its sublayers through the fused
reduction and equals the unfused one; a bf16 step through the GPU's kernels (interpreted) on a mesh
gives one device's logits.

Two meshes: (data=2, model=2) runs every kind of decode (each run compiles its own loop, ~5 s on CPU);
(data=1, model=4) splits the heads, experts and vocabulary four ways and runs generate (through the
mailbox plumbing) and chain decode; the per-module checks (vocabulary split, argmax and filters, the fused
reduction, caches and state) run on both, the MoE paths under one experts split a mesh (MOE_SPLITS).

Prints one line per mesh and "ok" at the end; any mismatch is an AssertionError (exit status 1)."""

import collections
import functools
import os
import re
import sys
import time

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from parallel_util import raises  # noqa: E402

from eagle3_jax import parallel  # noqa: E402
from eagle3_jax.models import Eagle3Config, GptOssConfig, eagle3, gpt_oss  # noqa: E402
from eagle3_jax.pallas import allreduce  # noqa: E402
from eagle3_jax.pallas.select import KernelPolicy  # noqa: E402
from eagle3_jax.spec import decode, generate, loop, sampling, step  # noqa: E402
from eagle3_jax.spec.decode import pad_prompts  # noqa: E402
from eagle3_jax.spec.state import Plan  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# the tiny preset with 4 kv heads (8 query heads), so that model = 4 divides them, and 3 layers (sliding,
# full, sliding: each program has a layer of each kind, and the draft its 3 feature layers)
CONFIG = GptOssConfig.preset("tiny").replace(num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=3,
                                             layer_types=())
DRAFT = Eagle3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=256, draft_vocab_size=256, target_hidden_size=64, aux_layer_ids=(0, 1, 2),
                     target_num_layers=3, own_embed=False)  # borrows the target's embedding
RUNS = {"generate": None, "chain": dict(num_spec_tokens=3),
        "tree": dict(num_spec_tokens=3, branching=4, num_draft_tokens=8),
        # drafts drawn from the draft, verified by accept_sample (each device on its rows, the batch's draws),
        # under the three sampling filters (their cuts found across the vocabulary's shards)
        "sampled tree": dict(num_spec_tokens=3, branching=2, num_draft_tokens=6, temperature=0.9, seed=3,
                             proposal="sample", top_k=40, top_p=0.9, min_p=0.05)}
# (data, model): the RUNS compared there. The greedy tree on a mesh: the batch of 3 below (and the two
# processes of parallel_multiprocess.py); generate: on (1, 4), through the program that takes the Mailbox
MESHES = {(2, 2): ("chain", "sampled tree"), (1, 4): ("chain",)}
# (data, model): the experts split of check_moe_paths there. "tensor" where the units need padding, as
# gpt-oss-120b's 2880 do over 4 devices; "expert" with the rows split over "data" (the decode runs above
# place the default, "tensor", on both meshes)
MOE_SPLITS = {(2, 2): "expert", (1, 4): "tensor"}
KW = dict(eos_ids=(), prefill_chunk=8)
NEW = 14
# the GPU's glue kernels (the residual add + norm, tree_mask, accept, kv_rewind) in the Pallas interpreter
GLUE_KERNELS = KernelPolicy(norm="kernel", spec_ops="kernel", interpret=True)
# the GPU's path through a bf16 target layer: the fused rope_attention kernel on its heads' q|k|v columns,
# the add + norm kernel, a device's q|k|v and o_proj through rows_matmul at every row count it takes
ATTENTION_KERNELS = KernelPolicy(norm="kernel", target_attention="rope_kernel", rows_matmul="kernel", interpret=True)


def count(pattern, jaxpr_text):
    """Occurrences of `pattern` (a regex) in a jaxpr's text."""
    return len(re.findall(pattern, jaxpr_text))


def pair():
    t = gpt_oss.GptOss(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0))
    return t, eagle3.random_eagle3(DRAFT, seed=1, target=t)


def tokens(t, d, prompts, names=tuple(RUNS)):
    return {name: (generate(t, prompts, NEW, **KW) if RUNS[name] is None
                   else decode(t, d, prompts, NEW, **RUNS[name], **KW)).tokens for name in names}


def shard_shape(x):
    return tuple(x.addressable_shards[0].data.shape)


def check_params(t, d, data, model):
    """The large parameters are split over "model" (each device holds 1/model of them), the rest whole;
    the experts as the default split places them (every expert's units; down's bias whole)."""
    split = {r"embed|lm_head": 0, r".*/self_attn/(wqkv|bqkv|sinks)": 0, r".*/self_attn/wo": 1,
             r".*/mlp/experts/gate_up\w*": 1, r".*/mlp/experts/(down|down_blocks|down_scales)": 2}
    seen = set()
    assert {layer.mlp.expert_split for layer in t.layers} == {"tensor"}
    for path, var in parallel.variables(t):
        x = var.get_value()
        key = next((k for k in split if re.fullmatch(k, path)), None)
        want = list(x.shape)
        if key is not None:
            want[split[key]] //= model
            seen.add(key)
        assert shard_shape(x) == tuple(want), (path, x.shape, shard_shape(x), x.sharding)
        assert len(x.sharding.device_set) == data * model, (path, x.sharding)
    assert seen == set(split), seen
    assert all(layer.self_attn.qkv_blocks == model for layer in t.layers)  # each device's rows: its heads
    assert d.embed is t.embed and shard_shape(d.embed.get_value())[0] == CONFIG.vocab_size // model
    assert shard_shape(d.wqkv.get_value()) == d.wqkv.get_value().shape  # the draft's own weights: whole
    assert parallel.mesh_of((t, d)).shape == {"data": data, "model": model}


def loop_inputs(t, d, prompts, branching, num_nodes):
    """(run context, a greedy depth-3 Plan of branching / num_nodes, graphdef, params, the loop's other arguments)."""
    toks, lengths = pad_prompts(prompts, 24)
    plan = Plan(cache_len=64, out_len=32, chunk=8, greedy=True, depth=3, branching=branching, num_nodes=num_nodes,
                feature_ids=tuple(DRAFT.feature_layers))
    graphdef, params = nnx.split((t, d))
    args = (toks, lengths, np.int32(NEW), np.full(8, -1, np.int32), np.float32(1e-6), jax.random.key(0), None)
    return parallel.context_for(t), plan, graphdef, params, args


def check_state(t, d, prompts, data, model):
    """The caches and per-row state that the jitted prefill leaves: split as `loop.layout` says."""
    ctx, plan, graphdef, params, args = loop_inputs(t, d, prompts, branching=1, num_nodes=4)
    mesh = ctx.mesh
    state = jax.jit(lambda p, *a: loop.init_state(nnx.merge(graphdef, p), *a, plan, ctx))(params, *args)
    B = len(prompts)
    for k in state.target_cache.k + state.target_cache.v:
        assert k.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model")), 4), k.sharding
        assert shard_shape(k) == (B // data, CONFIG.num_key_value_heads // model) + k.shape[2:], shard_shape(k)
    for k in state.draft_cache.k:
        assert k.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 4), k.sharding
    for x in (state.lengths, state.root, state.out, state.n_out, state.done, state.h_root):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), x.ndim), x.sharding
        assert shard_shape(x)[0] == B // data


def check_local(t, d, prompts):
    """On the run context's mesh the loop traces every layer's attention and MoE, the draft's attention
    and the tree rewind as shard_maps (`RunContext.local`: the kernels' local shards)."""
    ctx, plan, graphdef, params, args = loop_inputs(t, d, prompts, branching=4, num_nodes=8)
    text = str(jax.make_jaxpr(lambda p, *a: loop.run(nnx.merge(graphdef, p), *a, plan, ctx))(params, *args))
    # prefill and step: 2 per target layer each; the draft's prefill, tree levels and extend; one rewind
    n = text.count("shard_map[")
    assert n >= 4 * CONFIG.num_hidden_layers + 4, n
    return n


def check_kernel_step():
    """A bf16 verify step (4 tokens over noisy caches, ragged lengths) through the GPU's kernels: on a
    (2, 2) mesh (rows over "data", heads over "model"), each device's heads from its head-aligned
    q|k|v block and its shares of q|k|v and o through rows_matmul, the logits equal one device's to
    bf16 rounding (here 0.04 of logits up to 4.3)."""
    cfg = CONFIG.replace(experts_format="dense")
    B, S, T = 2, 64, 4
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(3, 256, (B, T)), jnp.int32)
    lengths = jnp.array([20, 37], jnp.int32)
    positions = lengths[:, None] + jnp.arange(T)[None]

    def logits(model, mesh):
        cache = gpt_oss.init_cache(model, B, S, max_step_tokens=8)
        noise = np.random.default_rng(3)
        cache = cache.replace(k=tuple(jnp.asarray(noise.normal(size=k.shape), k.dtype) for k in cache.k),
                              v=tuple(jnp.asarray(noise.normal(size=v.shape), v.dtype) for v in cache.v))
        ctx = parallel.context(mesh, kernels=ATTENTION_KERNELS)
        run = jax.jit(lambda m, c: gpt_oss.step(m, c, tokens, positions, lengths, ctx=ctx)[0])
        used = count(r"= jit\[name=rows_matmul ", str(jax.make_jaxpr(run)(model, cache)))  # rows_matmul kernel calls
        return np.asarray(run(model, cache), np.float32), used

    want, used = logits(gpt_oss.GptOss(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), None)
    assert used == 0  # one device: the projections stay whole
    mesh = parallel.make_mesh(model=2, data=2)
    got, used = logits(parallel.shard(gpt_oss.GptOss(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), mesh), mesh)
    assert used == 2 * cfg.num_hidden_layers  # each layer's q|k|v and o shares
    np.testing.assert_allclose(got, want, atol=0.15)


def check_fused_reduction(mesh):
    """A verify-sized step on the mesh sums the embedding lookup and each sublayer through
    `parallel.reduce_add_norm` (one call for the lookup, two a layer: the fused structure; lax.psum
    here, no GPU) and gives the step of one device, float32; a prefill-sized step (more rows a device
    than allreduce.MAX_ROWS) leaves its sums to XLA (no such call) and gives one device's too."""
    B, S, T = 2, 64, 4
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(3, 256, (B, T)), jnp.int32)
    lengths = jnp.array([11, 30], jnp.int32)
    # a prefill-sized step: more rows a device than the fused reduction takes
    T_big = allreduce.MAX_ROWS // (B // mesh.shape["data"]) + 1
    big = jnp.asarray(rng.integers(3, 256, (B, T_big)), jnp.int32)

    def logits(model, mesh, toks):
        cache = gpt_oss.init_cache(model, B, S + T_big, max_step_tokens=T_big)
        noise = np.random.default_rng(6)
        cache = cache.replace(k=tuple(jnp.asarray(noise.normal(size=k.shape), k.dtype) for k in cache.k),
                              v=tuple(jnp.asarray(noise.normal(size=v.shape), v.dtype) for v in cache.v))
        ctx = parallel.context(mesh)
        pos = lengths[:, None] + jnp.arange(toks.shape[1])[None]
        run = jax.jit(lambda m, c: gpt_oss.step(m, c, toks, pos, lengths, ctx=ctx)[0])
        # reduce_add_norm's shard_maps: the only ones taking each device's partial sums (PARTIALS) in
        calls = count(r"in_specs=\(P\('model', 'data'\)", str(jax.make_jaxpr(run)(model, cache)))
        return np.asarray(run(model, cache)), calls

    one = gpt_oss.GptOss(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0))
    split = parallel.shard(gpt_oss.GptOss(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0)), mesh)
    for toks, fused_calls in ((tokens, 2 * CONFIG.num_hidden_layers + 1), (big, 0)):  # two a layer, the lookup's
        want, none = logits(one, None, toks)
        got, calls = logits(split, mesh, toks)
        assert (none, calls) == (0, fused_calls), (toks.shape, none, calls)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def check_mailbox_plumbing(t, prompts, want):
    """generate's program takes the run context's Mailbox as an argument (made here as on GPUs: no
    kernel runs on CPU, the psum path does) and gives the same tokens; CPUs get none by default."""
    mesh = parallel.mesh_of(t)
    assert parallel.context_for(t).mailbox is None
    ctx = parallel.RunContext(mesh=mesh, mailbox=allreduce.new_mailbox(mesh, CONFIG.hidden_size))
    assert len(jax.tree.leaves(ctx)) == 2  # the Mailbox's table and rank: the program's arguments
    got = generate(t, prompts, NEW, **KW, max_cache_len=64, ctx=ctx).tokens
    assert got == want, (got, want)
    raises(lambda: generate(t, prompts, NEW, **KW, ctx=parallel.ONE_DEVICE), r"ctx: its mesh None is not the one")


def check_kernel_collectives(t, d, prompts):
    """The Pallas glue kernels run on each device's rows: none of the compiled loop's collectives is
    inside one (outside shard_map XLA gathers a kernel's rows: a collective per norm)."""
    ctx, plan, graphdef, params, args = loop_inputs(t, d, prompts, branching=4, num_nodes=8)
    ctx = parallel.context(ctx.mesh, kernels=GLUE_KERNELS)
    text = jax.jit(lambda p, *a: loop.run(nnx.merge(graphdef, p), *a, plan, ctx)).trace(
        params, *args).lower().compile().as_text()
    seen = collections.Counter()
    for line in text.splitlines():
        op = re.search(r"\s(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(?:-start)?\(", line)
        if op:
            name = re.search(r'op_name="([^"]*)"', line)
            seen[name.group(1) if name else "?"] += 1
    inside = [n for n in seen if re.search(r"/(add_rms_norm|tree_mask|accept_greedy)/", n)]
    assert seen and not inside, inside


def check_vocab_split(mesh):
    """parallel.vocab_rows / vocab_logits on the mesh equal the plain lookup and product, ids at every
    shard's edges included; the logits come out split over "model" with no collective, the lookup's
    only collective is its all-reduce of rows (no gather of the table)."""
    M, V, H = mesh.shape["model"], 256, 64
    rng = np.random.default_rng(5)
    table = jnp.asarray(rng.normal(size=(V, H)), jnp.float32)
    edges = sorted({0, V - 1} | {k * V // M for k in range(M)} | {k * V // M - 1 for k in range(1, M)})
    ids = jnp.asarray((edges * 8)[:8], jnp.int32).reshape(4, 2)
    h = jnp.asarray(rng.normal(size=(4, 2, H)), jnp.float32)
    split = jax.device_put(table, NamedSharding(mesh, parallel.VOCAB))
    ctx = parallel.context(mesh)
    rows = jax.jit(functools.partial(parallel.vocab_rows, ctx)).trace(split, ids).lower().compile()
    parts = jax.jit(functools.partial(parallel.vocab_rows, ctx, partial=True)).trace(split, ids).lower().compile()
    head = jax.jit(functools.partial(parallel.vocab_logits, ctx)).trace(h, split).lower().compile()
    want = np.asarray(table)[np.asarray(ids)]
    np.testing.assert_array_equal(np.asarray(rows(split, ids)), want)
    # not summed: each id's row on the device holding it, zeros on the others, in N = B * T rows
    part = np.asarray(parts(split, ids))
    owner = np.asarray(ids).reshape(-1) // (V // M)
    assert part.shape == (M, ids.size, H) and part.dtype == np.float32
    np.testing.assert_array_equal(part[owner, np.arange(ids.size)], want.reshape(-1, H))
    np.testing.assert_array_equal(part.sum(0), want.reshape(-1, H))
    assert (np.abs(part).sum(-1) > 0).sum(0).tolist() == [1] * ids.size
    got = head(h, split)
    np.testing.assert_allclose(np.asarray(got), np.einsum("bth,vh->btv", h, table), rtol=1e-5, atol=1e-5)
    assert got.sharding.spec[-1] == "model", got.sharding
    def ops(text):
        return re.findall(r"\s(all-gather|all-reduce|collective-permute|all-to-all)(?:-start)?\(", text)

    assert ops(head.as_text()) == [] and ops(rows.as_text()) == ["all-reduce"], (ops(head.as_text()),
                                                                                ops(rows.as_text()))
    assert ops(parts.as_text()) == [], ops(parts.as_text())


def check_vocab_argmax(mesh):
    """The step's pick on logits split over "model" (`parallel.vocab_argmax`; `step.sample`'s greedy
    pick and its draws) equals one device's np.argmax and jax.random.categorical: maxima tied within
    a shard and across shards (the first index wins), on a shard's edges, the last column, a row
    all -inf, a row all equal, NaNs (the first counts as the maximum); its only collective is the
    psum of each device's best (no gather of the logits)."""
    M, V = mesh.shape["model"], 256
    n = V // M
    z = np.random.default_rng(8).normal(size=(4, 3, V)).astype(np.float32)
    z[0, 0, [n - 1, n]] = 9.0
    z[0, 1, V - 1] = 9.0
    z[0, 2, [V - n, V - n - 1, V - 1]] = 9.0
    z[1, 0] = -np.inf
    z[1, 1, [V - 2, n + 1]] = np.nan
    z[1, 2] = 0.5
    z[2, 0, [3, 5]] = 9.0
    logits = jax.device_put(z, NamedSharding(mesh, P("data", None, "model")))
    key, T = jax.random.key(5), 0.8
    ctx = parallel.context(mesh)
    argmax = functools.partial(parallel.vocab_argmax, ctx)
    pick = jax.jit(argmax).trace(logits).lower().compile()
    draw = jax.jit(lambda z, key: step.sample(z, key, T, False, ctx)).trace(logits, key).lower().compile()
    want = np.argmax(z, -1)
    assert want[0].tolist() == [n - 1, V - 1, V - n - 1] and want[1].tolist() == [0, n + 1, 0], want
    np.testing.assert_array_equal(np.asarray(pick(logits)), want)
    np.testing.assert_array_equal(np.asarray(draw(logits, key)), np.asarray(jax.random.categorical(key, z / T)))
    for exe in (pick, draw):
        assert re.findall(r"\s(all-gather|all-reduce|collective-permute|all-to-all)(?:-start)?\(", exe.as_text()) == [
            "all-reduce"]
    # indices past 2^24 would not be exact in f32; 2^24 entries still are
    assert jax.eval_shape(argmax, jax.ShapeDtypeStruct((4, 1 << 24), jnp.float32)).shape == (4,)
    raises(lambda: jax.eval_shape(argmax, jax.ShapeDtypeStruct((4, (1 << 24) + M), jnp.float32)),
           rf"vocab_argmax: a vocabulary of {(1 << 24) + M} entries; indices exchanged in f32 need V <= 2\^24")


def check_vocab_filter(mesh):
    """The sampling filters on logits split over "model" (`sampling.filter_logits`, and `step.sample`'s
    draws under them) equal one device's: ties within and across shards at the k-th value and at the
    nucleus' edge, -0.0 and +0.0, a row all equal; the only collectives are all-reduces (the cuts' sums
    and maxima: no gather of the logits)."""
    M, V = mesh.shape["model"], 256
    n = V // M
    z = np.round(np.random.default_rng(9).normal(size=(4, 3, V)) * 2).astype(np.float32)  # many ties
    z[0, 0, [n - 1, n, V - 1]] = 9.0
    z[1, 1] = 0.5
    z[2, 2, ::3] = -0.0
    split = jax.device_put(z, NamedSharding(mesh, P("data", None, "model")))
    key, T = jax.random.key(6), 0.8
    one, ctx = parallel.ONE_DEVICE, parallel.context(mesh)
    cut, cut_one = (jax.jit(functools.partial(sampling.filter_logits, c)) for c in (ctx, one))
    draw, draw_one = (jax.jit(lambda z, key, f, c=c: step.sample(z, key, T, False, c, f)) for c in (ctx, one))
    for k, p, m in ((5, 1.0, 0.0), (300, 0.6, 0.0), (40, 0.9, 0.05), (1, 1e-9, 1.0), (sampling.TOP_K_OFF, 1.0, 0.0)):
        filters = sampling.Filters(np.int32(k), np.float32(p), np.float32(m))
        np.testing.assert_array_equal(np.asarray(cut(split, filters)), np.asarray(cut_one(z, filters)))
        np.testing.assert_array_equal(np.asarray(draw(split, key, filters)), np.asarray(draw_one(z, key, filters)))
    cut = cut.trace(split, filters).lower().compile()
    ops = re.findall(r"\s(all-gather|all-reduce|collective-permute|all-to-all)(?:-start)?\(", cut.as_text())
    assert ops and set(ops) == {"all-reduce"}, ops


def check_moe_paths(mesh, split):
    """Each MoE path, its experts split over the mesh (`RunContext.local`) as `split` says, equals the
    one-device module: gathered (few pairs), dense and grouped (many), packed and dense experts. Split
    "tensor", on intermediate sizes the mesh does not divide (96 in 32-input groups, 65): padded."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(4, 24, CONFIG.hidden_size)), jnp.float32)
    M = mesh.shape["model"]
    for experts, size in (("mxfp4", 96), ("dense", 65)):
        # one layer is enough: each path's output is the layer's MoE on the rows, before and after the split
        cfg = CONFIG.replace(experts_format=experts, num_hidden_layers=1, layer_types=(),
                             **({"intermediate_size": size} if split == "tensor" else {}))
        model = gpt_oss.GptOss(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
        paths = (("gathered", x[:, :2]), ("dense", x), ("grouped", x))
        moe = model.layers[0].mlp  # one device; jitted: one compile a path, not one a primitive (eager)
        wants = [np.asarray(jax.jit(lambda r, p=path, m=moe: m(r, path=p))(rows)) for path, rows in paths]
        split_moe = parallel.shard(model, mesh, experts=split).layers[0].mlp
        local = shard_shape(split_moe.experts.gate_up_bias.get_value())
        units = parallel.expert_units(cfg, mesh, split)
        want_local = (cfg.num_local_experts // M, 2 * units) if split == "expert" else (cfg.num_local_experts,
                                                                                        2 * units // M)
        assert split_moe.expert_split == split and local == want_local, (split, local, want_local)
        ctx = parallel.context(mesh)
        for (path, rows), want in zip(paths, wants):

            @jax.jit
            def run(rows, path=path, moe=split_moe):
                return moe(rows, path=path, ctx=ctx)

            got = np.asarray(run(jax.device_put(rows, NamedSharding(mesh, P("data")))))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{split} {experts} {path}")


def check_whole_experts(mesh, prompts, want):
    """The target placed with experts="expert" (whole experts a device; the main loop places the
    default, parallel.EXPERTS = "tensor"): chain decode gives the one-device tokens."""
    assert parallel.EXPERTS == "tensor"
    t, d = pair()
    parallel.shard(t, mesh, experts="expert")
    parallel.shard(d, mesh)
    got = decode(t, d, prompts, NEW, **RUNS["chain"], **KW).tokens
    assert got == want["chain"], (mesh.shape, got, want["chain"])


def check_errors(prompts):
    """The tiny preset's 2 kv heads over 4 devices; a sharded target with a draft left on one device."""
    tiny = gpt_oss.GptOss(GptOssConfig.preset("tiny"), dtype=jnp.float32, rngs=nnx.Rngs(0))
    raises(lambda: parallel.shard(tiny, parallel.make_mesh(model=4)),
           r'mesh axis "model" of size 4 must divide num_key_value_heads=2$')
    t = parallel.shard(gpt_oss.GptOss(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0)), parallel.make_mesh(model=4))
    d = eagle3.Eagle3(DRAFT.replace(own_embed=True), dtype=jnp.float32, rngs=nnx.Rngs(1))
    raises(lambda: decode(t, d, prompts, NEW, **KW), r"not on the mesh .* parallel.shard")
    # q|k|v rows in blocks for another model size than the mesh's (placed by hand, not by shard)
    t.layers[1].self_attn.qkv_blocks = 2
    raises(lambda: generate(t, prompts, NEW, **KW), r'wqkv rows in 2 head-aligned blocks under a mesh whose "model" '
                                                    r"axis has 4 devices; place the model with parallel.shard")


def main():
    assert jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, n).tolist() for n in (5, 13, 20, 9)]
    t0 = time.perf_counter()
    t, d = pair()
    want = tokens(t, d, prompts, ("generate",) + MESHES[2, 2])
    odd = decode(t, d, prompts[:3], NEW, **RUNS["tree"], **KW)  # a batch the data axis does not divide
    print(f"one device: {time.perf_counter() - t0:.1f} s", flush=True)
    for (data, model), names in MESHES.items():
        t0 = time.perf_counter()
        mesh = parallel.make_mesh(model=model, data=data, devices=jax.devices()[:data * model])
        t, d = pair()
        parallel.shard(t, mesh)
        parallel.shard(d, mesh)
        check_params(t, d, data, model)
        n_local = check_local(t, d, prompts)
        got = tokens(t, d, prompts, names)
        for name in names:
            assert got[name] == want[name], (data, model, name, got[name], want[name])
        check_state(t, d, prompts, data, model)
        if data > 1:  # padded with an empty prompt that starts done: same tokens, same counted slot steps
            got = decode(t, d, prompts[:3], NEW, **RUNS["tree"], **KW)
            assert (got.tokens, got.metrics["slot_steps"]) == (odd.tokens, odd.metrics["slot_steps"]), got.metrics
            check_whole_experts(mesh, prompts, want)
            check_kernel_collectives(t, d, prompts)
        else:  # generate's tokens on this mesh, through the program that takes the Mailbox
            check_mailbox_plumbing(t, prompts, want["generate"])
        check_moe_paths(mesh, MOE_SPLITS[data, model])
        check_vocab_split(mesh)
        check_vocab_argmax(mesh)
        check_vocab_filter(mesh)
        check_fused_reduction(mesh)
        names += ("generate",) if data == 1 else ()
        print(f"mesh data={data} model={model}: tokens equal ({', '.join(names)}), sharded, {n_local} shard_maps: "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    check_errors(prompts)
    t0 = time.perf_counter()
    check_kernel_step()
    print(f"bf16 step through the GPU kernels (interpreted) on meshes: one device's logits: "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
