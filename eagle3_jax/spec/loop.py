"""Prefill and the `lax.while_loop` over `step`, shared by `generate` and `decode`, compiled once
per plan, run context and argument shapes (and shardings: on a mesh of several devices the caches
and the loop state are laid out over it, `layout`). Executables are kept in a bounded LRU cache
(`COMPILED_MAX` of them), so a notebook sweeping shapes does not grow without bound.

depth="auto" (plan.auto): the loop's body is one inner loop per option, in order, each running
`step.chosen_step` while the choice is its option (the option chosen first runs at least one step),
so that every option's step is the body of a loop of its own, as a fixed shape's step is: XLA then
updates the caches in place and hoists what does not change out of the loop, which it did not do
for the options' steps as the arms of a `lax.switch`."""

from __future__ import annotations

import collections
import functools
import time

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax import parallel
from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.spec import adaptive
from eagle3_jax.spec.metrics import Counters
from eagle3_jax.spec.sampling import Filters
from eagle3_jax.spec.state import DecodeState, Plan
from eagle3_jax.spec.step import chosen_step, release, sample, step

PER_ROW = ("lengths", "root", "h_root", "out", "n_out", "done", "trace")  # DecodeState's [B, ...] fields besides
# the caches
AUTO_PER_ROW = ("est", "seen", "expected", "held", "held_tokens", "held_feats")  # AutoState's [B, ...] fields
COMPILED_MAX = 16  # executables `compiled` keeps (least recently used dropped first)


def layout(state: DecodeState, mesh) -> DecodeState:
    """The state laid out over `mesh` (a jax.sharding.Mesh of parallel.py; None: unchanged): the
    target's caches with B over "data" and the kv heads over "model", the draft's with B over "data"
    (its weights are replicated), every per-row array over "data"; scalars left to XLA."""
    if mesh is None:
        return state
    rows = {f: parallel.constrain_rows(getattr(state, f), mesh) for f in PER_ROW}
    auto = state.auto
    if auto is not None:
        auto = auto.replace(**{f: parallel.constrain_rows(getattr(auto, f), mesh) for f in AUTO_PER_ROW})
    return state.replace(target_cache=parallel.constrain_cache(state.target_cache, mesh),
                         draft_cache=parallel.constrain_cache(state.draft_cache, mesh, heads=False), auto=auto, **rows)


def init_state(models, tokens, prompt_lengths, budget, eos_ids, temperature, key, filters: Filters | None,
               plan: Plan, ctx: parallel.RunContext, table: adaptive.Table | None = None) -> DecodeState:
    """Prefills the target (and the draft) with right-padded prompts tokens int32 [B, P] and draws
    the first token; the state before the first step, laid out over ctx's mesh (`layout`). Rows of
    prompt length 0 (padding that a mesh's data axis needs: spec/decode.py) start done. filters:
    the sampling filters (spec/sampling.py) or None (none compiled; always None when greedy).
    table: depth="auto"'s step times (plan.auto; None: `adaptive.Table.uniform`); plan.trace: an
    empty trace."""
    target, draft = models
    mesh = ctx.mesh
    B = tokens.shape[0]
    cache = gpt_oss.init_cache(target, B, plan.cache_len, max_step_tokens=plan.step_tokens)
    if mesh is not None:
        tokens, prompt_lengths = parallel.constrain_rows(tokens, mesh), parallel.constrain_rows(prompt_lengths, mesh)
        cache = parallel.constrain_cache(cache, mesh)
    with jax.named_scope("prefill"):
        target_cache, h_last, feats = gpt_oss.prefill(target, cache, tokens, prompt_lengths, chunk=plan.chunk,
                                                      feature_ids=plan.feature_ids, ctx=ctx)
        first = sample(gpt_oss.logits(target, h_last, ctx), jax.random.fold_in(key, 0), temperature, plan.greedy, ctx,
                       filters)
        draft_cache = h_root = None
        if plan.depth:
            # the draft reads (x_{t+1}, f_t): the prompt shifted left, the first token after the last position
            nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], 1)
            nxt = nxt.at[jnp.arange(B), prompt_lengths - 1].set(first)
            draft_cache = eagle3.init_cache(draft, B, plan.cache_len, max_step_tokens=plan.step_tokens)
            if mesh is not None:
                draft_cache = parallel.constrain_cache(draft_cache, mesh, heads=False)
            draft_cache, h_root = eagle3.prefill(draft, draft_cache, nxt, feats, prompt_lengths, chunk=plan.chunk,
                                                 ctx=ctx)
    n_out = jnp.ones((B,), jnp.int32)
    state = DecodeState(target_cache=target_cache, draft_cache=draft_cache, lengths=prompt_lengths, root=first,
                        h_root=h_root, out=jnp.zeros((B, plan.out_len), jnp.int32).at[:, 0].set(first), n_out=n_out,
                        done=jnp.isin(first, eos_ids) | (n_out >= budget) | (prompt_lengths == 0), budget=budget,
                        eos_ids=eos_ids, temperature=temperature, filters=filters, key=key,
                        steps=jnp.zeros((), jnp.int32), counters=Counters.zeros(plan.depth))
    if plan.trace:
        state = state.replace(trace=jnp.full((B, plan.out_len), -1, jnp.int32))
    if plan.auto:
        table = adaptive.Table.uniform(len(plan.auto)) if table is None else table
        state = state.replace(auto=adaptive.init(table, plan.auto, state.done, state.lengths, plan.out_len,
                                                 plan.trace, (feats.shape[-1], feats.dtype)))
    return layout(state, mesh)


def run(models, tokens, prompt_lengths, budget, eos_ids, temperature, key, filters: Filters | None, plan: Plan,
        ctx: parallel.RunContext, table: adaptive.Table | None = None) -> DecodeState:
    """Prefill, then `step` until every slot is done: the whole generation, traceable under jit.
    ctx: the run context (its mesh: the models' parameters'); the state keeps `layout`. table: as
    `init_state`'s."""
    state = init_state(models, tokens, prompt_lengths, budget, eos_ids, temperature, key, filters, plan, ctx, table)
    running = lambda state: ~jnp.all(state.done)  # noqa: E731
    if not plan.auto:
        return jax.lax.while_loop(running, lambda state: layout(step(models, state, plan, ctx), ctx.mesh), state)

    def chosen(i):  # the steps for which the choice is option i, in a loop of their own
        def cond(state):
            go = running(state) & (state.auto.choice == i)
            return go & (jnp.max(state.auto.held) < adaptive.HOLD) if plan.auto[i][0] == 0 else go
        return lambda state: jax.lax.while_loop(
            cond, lambda state: layout(chosen_step(models, state, i, plan, ctx), ctx.mesh), state)

    def body(state):  # at least the loop of the option chosen first runs a step
        for i, (depth, _, _) in enumerate(plan.auto):
            state = chosen(i)(state)
            if depth == 0:  # the draft over the inputs its steps held, before any step drafts
                state = layout(release(models[1], state, ctx), ctx.mesh)
        return state

    return jax.lax.while_loop(running, body, state)


def program(graphdef, ctx: parallel.RunContext, params, *args, plan: Plan):
    """The whole generation as one function of (ctx, params, *args) for jit: -> (out [B, out_len],
    n_out [B], steps, Counters), whole on every device (several processes each read them); with
    plan.trace or plan.auto a fifth result, {"trace": int32 [B, out_len], "auto": the AutoState
    without its table}. args: `run`'s arguments from tokens to filters, then the table (plan.auto)."""
    if plan.auto:
        *args, table = args
    else:
        table = None
    final = run(nnx.merge(graphdef, params), *args, plan, ctx, table)
    results = final.out, final.n_out, final.steps, final.counters
    extras = {}
    if final.trace is not None:
        extras["trace"] = final.trace
    if final.auto is not None:
        extras["auto"] = final.auto.replace(table=None)
    results += (extras,) if extras else ()
    return results if ctx.mesh is None else parallel.constrain_replicated(results, ctx.mesh)


COMPILED: collections.OrderedDict = collections.OrderedDict()


def compiled(plan: Plan, graphdef, ctx: parallel.RunContext, *args):
    """The executable of `program` for (target, draft) = nnx.merge(graphdef, args[0]), this run
    context and these argument shapes, dtypes and shardings, compiled with ctx.compiler_options on
    first use: (executable taking (ctx, *args), seconds spent compiling now, 0.0 on reuse). At most
    COMPILED_MAX are kept, the least recently used dropped first."""
    spec = jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a), getattr(a, "sharding", None)), (ctx, args))
    # the matmul precision in context changes the program (jax.default_matmul_precision, e.g. a float32 check)
    key = (graphdef, plan, ctx.mesh, ctx.kernels, ctx.compiler_options, str(jax.tree.structure((ctx, args))),
           str(spec), str(jax.config.jax_default_matmul_precision))
    if key in COMPILED:
        COMPILED.move_to_end(key)
        return COMPILED[key], 0.0
    t0 = time.perf_counter()
    # a function object of its own: JAX's tracing and lowering caches, keyed weakly on it, drop this
    # program's entries once the executable leaves COMPILED (keyed on `program`, they would stay)
    fn = functools.partial(program)
    exe = jax.jit(fn, static_argnums=0, static_argnames="plan").lower(
        graphdef, ctx, *args, plan=plan).compile(compiler_options=ctx.options)
    COMPILED[key] = exe
    while len(COMPILED) > COMPILED_MAX:
        COMPILED.popitem(last=False)
    return exe, time.perf_counter() - t0
