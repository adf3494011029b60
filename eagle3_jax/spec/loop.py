"""Prefill and the `lax.while_loop` over `step`, shared by `generate` and `decode`, compiled once
per plan and argument shapes (and shardings: with the models' parameters on a mesh of several
devices, the caches and the loop state are laid out over it, `layout`, and the program is traced
`on_mesh`, so that the kernels run on local shards)."""

from __future__ import annotations

import contextlib
import time

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax import parallel
from eagle3_jax.models import eagle3, gpt_oss, shards
from eagle3_jax.pallas import select
from eagle3_jax.spec.metrics import Counters
from eagle3_jax.spec.state import DecodeState, Plan
from eagle3_jax.spec.step import sample, step

PER_ROW = ("lengths", "root", "h_root", "out", "n_out", "done")  # DecodeState's [B, ...] fields besides the caches


def layout(state: DecodeState, mesh) -> DecodeState:
    """The state laid out over `mesh` (a jax.sharding.Mesh of parallel.py; None: unchanged): the
    target's caches with B over "data" and the kv heads over "model", the draft's with B over "data"
    (its weights are replicated), every per-row array over "data"; scalars left to XLA."""
    if mesh is None:
        return state
    rows = {f: parallel.constrain_rows(getattr(state, f), mesh) for f in PER_ROW}
    return state.replace(target_cache=parallel.constrain_cache(state.target_cache, mesh),
                         draft_cache=parallel.constrain_cache(state.draft_cache, mesh, heads=False), **rows)


def init_state(models, tokens, prompt_lengths, budget, eos_ids, temperature, key, plan: Plan, mesh=None) -> DecodeState:
    """Prefills the target (and the draft) with right-padded prompts tokens int32 [B, P] and draws
    the first token; the state before the first step, laid out over `mesh` (`layout`). Rows of
    prompt length 0 (padding that a mesh's data axis needs: spec/decode.py) start done."""
    target, draft = models
    B = tokens.shape[0]
    cache = gpt_oss.init_cache(target, B, plan.cache_len, max_step_tokens=plan.step_tokens)
    if mesh is not None:
        tokens, prompt_lengths = parallel.constrain_rows(tokens, mesh), parallel.constrain_rows(prompt_lengths, mesh)
        cache = parallel.constrain_cache(cache, mesh)
    with jax.named_scope("prefill"):
        target_cache, h_last, feats = gpt_oss.prefill(target, cache, tokens,
                                                      prompt_lengths, chunk=plan.chunk, feature_ids=plan.feature_ids)
        first = sample(gpt_oss.logits(target, h_last), jax.random.fold_in(key, 0), temperature, plan.greedy)
        draft_cache = h_root = None
        if plan.depth:
            # the draft reads (x_{t+1}, f_t): the prompt shifted left, the first token after the last position
            nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], 1)
            nxt = nxt.at[jnp.arange(B), prompt_lengths - 1].set(first)
            draft_cache = eagle3.init_cache(draft, B, plan.cache_len, max_step_tokens=plan.step_tokens)
            if mesh is not None:
                draft_cache = parallel.constrain_cache(draft_cache, mesh, heads=False)
            draft_cache, h_root = eagle3.prefill(draft, draft_cache, nxt, feats, prompt_lengths, chunk=plan.chunk)
    n_out = jnp.ones((B,), jnp.int32)
    state = DecodeState(target_cache=target_cache, draft_cache=draft_cache, lengths=prompt_lengths, root=first,
                        h_root=h_root, out=jnp.zeros((B, plan.out_len), jnp.int32).at[:, 0].set(first), n_out=n_out,
                        done=jnp.isin(first, eos_ids) | (n_out >= budget) | (prompt_lengths == 0), budget=budget,
                        eos_ids=eos_ids, temperature=temperature, key=key, steps=jnp.zeros((), jnp.int32),
                        counters=Counters.zeros(plan.depth))
    return layout(state, mesh)


def run(models, tokens, prompt_lengths, budget, eos_ids, temperature, key, plan: Plan, mesh=None) -> DecodeState:
    """Prefill, then `step` until every slot is done: the whole generation, traceable under jit.
    mesh: the models' parameters' mesh (several devices), or None; the state keeps `layout`."""
    state = init_state(models, tokens, prompt_lengths, budget, eos_ids, temperature, key, plan, mesh)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: layout(step(models, s, plan), mesh), state)


def loop_mesh(params):
    """The mesh the loop lays its state out over: that of the parameters' NamedShardings
    (`parallel.mesh_of`) where it has more than one device, else None (one device: nothing changes)."""
    mesh = parallel.mesh_of(params)
    return None if mesh is None or mesh.size == 1 else mesh


def on_mesh(mesh):
    """The context `run` is traced in: the mesh's abstract mesh, under which the models run their
    kernels on local shards (models/shards.py); nothing for mesh None."""
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def _program(graphdef, params, mailbox, *args, plan: Plan, mesh=None):
    with on_mesh(mesh), shards.mailbox_context(mailbox):
        final = run(nnx.merge(graphdef, params), *args, plan, mesh)
    results = final.out, final.n_out, final.steps, final.counters
    # whole on every device: each process reads them (several processes: jax.distributed)
    return results if mesh is None else parallel.constrain_replicated(results, mesh)


_COMPILED: dict = {}


def compiled(plan: Plan, graphdef, *args, hidden: int | None = None):
    """The executable of `run` for (target, draft) = nnx.merge(graphdef, args[0]) and these argument
    shapes, dtypes and shardings (the state laid out over `loop_mesh(args[0])`), compiled on first
    use: (executable taking *args, seconds spent compiling now, 0.0 on reuse). It returns
    (out [B, out_len], n_out [B], steps, Counters). hidden: the target's hidden size, for the
    mesh's all-reduce Mailbox (`parallel.mailbox`), which the executable passes in itself (None:
    no Mailbox, XLA's all-reduce). XLA options: `select.compiler_options` (on a GPU, every loop one
    CUDA graph)."""
    mesh = loop_mesh(args[0])
    mailbox = None if hidden is None else parallel.mailbox(mesh, hidden)
    spec = jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a), getattr(a, "sharding", None)), args)
    key = (graphdef, plan, mesh, mailbox is None, str(jax.tree.structure(args)), str(spec))
    if key not in _COMPILED:
        t0 = time.perf_counter()

        exe = jax.jit(_program, static_argnums=0, static_argnames=("plan", "mesh")).lower(
            graphdef, args[0], mailbox, *args[1:], plan=plan, mesh=mesh).compile(
            compiler_options=select.compiler_options())
        _COMPILED[key] = (lambda *a: exe(a[0], mailbox, *a[1:])), time.perf_counter() - t0
        return _COMPILED[key]
    return _COMPILED[key][0], 0.0
