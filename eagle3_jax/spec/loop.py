"""Prefill and the `lax.while_loop` over `step`, shared by `generate` and `decode`, compiled once
per plan and argument shapes."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.models import eagle3, gpt_oss
from eagle3_jax.spec.metrics import Counters
from eagle3_jax.spec.state import DecodeState, Plan
from eagle3_jax.spec.step import sample, step


def init_state(models, tokens, prompt_lengths, budget, eos_ids, temperature, key, plan: Plan) -> DecodeState:
    """Prefills the target (and the draft) with right-padded prompts tokens int32 [B, P] and draws
    the first token; the state before the first step."""
    target, draft = models
    B = tokens.shape[0]
    with jax.named_scope("prefill"):
        target_cache, h_last, feats = gpt_oss.prefill(target, gpt_oss.init_cache(target, B, plan.cache_len, max_step_tokens=plan.step_tokens), tokens,
                                                      prompt_lengths, chunk=plan.chunk, feature_ids=plan.feature_ids)
        first = sample(gpt_oss.logits(target, h_last), jax.random.fold_in(key, 0), temperature, plan.greedy)
        draft_cache = h_root = None
        if plan.depth:
            # the draft reads (x_{t+1}, f_t): the prompt shifted left, the first token after the last position
            nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], 1)
            nxt = nxt.at[jnp.arange(B), prompt_lengths - 1].set(first)
            draft_cache, h_root = eagle3.prefill(draft, eagle3.init_cache(draft, B, plan.cache_len, max_step_tokens=plan.step_tokens), nxt, feats,
                                                 prompt_lengths, chunk=plan.chunk)
    n_out = jnp.ones((B,), jnp.int32)
    return DecodeState(target_cache=target_cache, draft_cache=draft_cache, lengths=prompt_lengths, root=first,
                       h_root=h_root, out=jnp.zeros((B, plan.out_len), jnp.int32).at[:, 0].set(first), n_out=n_out,
                       done=jnp.isin(first, eos_ids) | (n_out >= budget), budget=budget, eos_ids=eos_ids,
                       temperature=temperature, key=key, steps=jnp.zeros((), jnp.int32),
                       counters=Counters.zeros(plan.depth))


def run(models, tokens, prompt_lengths, budget, eos_ids, temperature, key, plan: Plan) -> DecodeState:
    """Prefill, then `step` until every slot is done: the whole generation, traceable under jit."""
    state = init_state(models, tokens, prompt_lengths, budget, eos_ids, temperature, key, plan)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: step(models, s, plan), state)


def _program(graphdef, params, *args, plan: Plan):
    final = run(nnx.merge(graphdef, params), *args, plan)
    return final.out, final.n_out, final.steps, final.counters


_COMPILED: dict = {}


def compiled(plan: Plan, graphdef, *args):
    """The executable of `run` for (target, draft) = nnx.merge(graphdef, args[0]) and these argument
    shapes and dtypes, compiled on first use: (executable taking *args, seconds spent compiling now,
    0.0 on reuse). It returns (out [B, out_len], n_out [B], steps, Counters)."""
    spec = jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), args)
    key = (graphdef, plan, str(jax.tree.structure(args)), str(spec))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    t0 = time.perf_counter()
    exe = jax.jit(_program, static_argnums=0, static_argnames="plan").lower(graphdef, *args, plan=plan).compile()
    _COMPILED[key] = exe
    return exe, time.perf_counter() - t0
