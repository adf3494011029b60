"""depth="auto": the draft shape chosen at every step, on device, from each slot's running acceptance
and a table of step times (the table's data: spec/cost_table.py; the options: `Plan.auto`).

Options, in order: chains of d = 0, 1, ..., D drafts (0: the target alone on the root, as `generate`
steps), then the configured tree if any. Option o verifies m_o positions
(a chain: d; a tree: min(depth, nodes - 1)); chains share one family of estimates, a tree has its own.
Estimates (`AutoState.est`, float32 [B, F, D]): est[b, f, i] estimates the chance that a step of
family f accepts at least i + 1 drafts in slot b, from that slot's steps of family f that verified
position i + 1. Each starts at PRIOR (1: a position not tried yet looks perfect, so the first steps
try it) weighing PRIOR_WEIGHT observations; the n-th observation x (1: accepted that far, else 0)
moves it by max(EMA_WEIGHT, 1 / (n + PRIOR_WEIGHT)) * (x - est): the weighted mean of the prior and
the observations until that weight falls to EMA_WEIGHT, then an exponential average of that weight.
Expected committed tokens: E[b, o] = 1 + sum over i < m_o of min(est[b, f_o, :i + 1]).
Cost: seconds a step of option o takes at the call's batch (`Table.cost`, batch interpolated on the
host) and at the rows' mean length (linear between the table's context points, constant beyond).
Choice (`choose`): the option with the most sum over active slots of E[b, o] / cost[o] among those
the table has, the shallower on ties. Exploration: each step adds EXPLORE_SHARE of its chosen
option's cost to a credit (at most the costliest option's); when the credit covers the predicted
loss of the next option in order (its cost less the time the best option takes for its tokens),
that one runs instead and the credit pays, so deeper positions keep being observed at a predicted
loss of at most about EXPLORE_SHARE of the time.
A draft-free step leaves the draft's inputs (its token, the target's feature) held, up to HOLD of
them, and the draft runs over all of them at once before the next step that drafts (step.release).
Exact: the choice reads only what earlier steps left (estimates, lengths, done, credit), never this
step's logits or draws, and every option is an exact step with the same keys (fold_in(key, step + 1)):
greedy output equals `generate`'s, and sampled tokens follow the target's law.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

EMA_WEIGHT = 1 / 8     # weight of a new observation once about 1 / EMA_WEIGHT have been seen
PRIOR = 1.0            # every estimate's value before its first observation
PRIOR_WEIGHT = 0.5     # the observations the prior counts for
EXPLORE_SHARE = 1 / 32  # share of the predicted time that exploring a deeper option may take
CONTEXT_POINTS = 8     # context points of a table on device (a table's own, padded: shapes stay fixed)
HOLD = 8               # draft-free steps whose draft inputs wait before the draft runs over them at once


@struct.dataclass
class Table:
    """Step times for one call: cost float32 [O, CONTEXT_POINTS] seconds a step of option o with the
    call's batch at context contexts[c] (tokens, increasing); available bool [O]: the table has o
    (the choice never takes the others). Arguments of the compiled program: no table recompiles."""
    cost: jax.Array
    contexts: jax.Array
    available: jax.Array

    @classmethod
    def uniform(cls, num_options: int) -> Table:
        """Every option available at one second a step at every context (a harness's table: the
        choice is then the option with the most expected tokens)."""
        return cls(cost=np.ones((num_options, CONTEXT_POINTS), np.float32),
                   contexts=np.arange(CONTEXT_POINTS, dtype=np.float32), available=np.ones(num_options, bool))


@struct.dataclass
class AutoState:
    """What depth="auto" carries through the loop (`DecodeState.auto`); O options, F families, D the
    deepest option's positions, B slots."""
    table: Table | None  # the call's step times (None in the loop's results)
    est: jax.Array       # float32 [B, F, D]: running chance of accepting at least i + 1 drafts
    seen: jax.Array      # float32 [B, F, D]: observations behind est, PRIOR_WEIGHT for the prior
    choice: jax.Array    # int32 []: the option of the next step (decided from the state after the last)
    expected: jax.Array  # float32 [B, O]: the expected tokens behind that choice
    cost: jax.Array      # float32 [O]: the seconds a step behind it
    credit: jax.Array    # float32 []: seconds of exploration earned and not spent, that choice's paid
    steps: jax.Array     # int32 [O]: steps that ran each option (the histogram of choices)
    slot_steps: jax.Array  # int32 [O]: active slot-steps of each option
    predicted: jax.Array   # float32 [O]: expected committed tokens, summed over those slot-steps
    realised: jax.Array    # int32 [O]: accepted drafts + bonus of those slot-steps (before eos / budget cuts)
    seconds: jax.Array     # float32 [O]: the table's seconds for the steps that ran each option
    chosen: jax.Array | None  # int32 [out_len] (Plan.trace): the option of step s, -1 past the last
    held: jax.Array        # int32 [B]: draft-free steps whose draft inputs wait (`hold`, step.release)
    held_tokens: jax.Array  # int32 [B, HOLD]: their committed tokens
    held_feats: jax.Array   # [B, HOLD, features]: the target's features at their roots


def shape_arrays(options) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(family int32 [O]: 0 for chains, 1, 2, ... for each tree in order; positions int32 [O]: m_o;
    F families; D positions) of options ((depth, branching, num_nodes), ...)."""
    fam, pos, trees = [], [], 0
    for d, k, n in options:
        trees += k > 1
        fam.append(trees if k > 1 else 0)
        pos.append(min(d, n - 1) if k > 1 else d)
    return np.array(fam, np.int32), np.array(pos, np.int32), trees + 1, max(max(pos), 1)


def init(table: Table, options, done, lengths, out_len: int, trace: bool, features: tuple) -> AutoState:
    """The state before the first step (done bool [B], lengths int32 [B] after the prefill): every
    estimate PRIOR of weight PRIOR_WEIGHT, the first step's option decided. features: (width, dtype)
    of the target's features the draft reads (the held inputs')."""
    _, _, F, D = shape_arrays(options)
    O, B = len(options), lengths.shape[0]
    zi, zf = jnp.zeros((O,), jnp.int32), jnp.zeros((O,), jnp.float32)
    auto = AutoState(table=jax.tree.map(jnp.asarray, table), est=jnp.full((B, F, D), PRIOR, jnp.float32),
                     seen=jnp.full((B, F, D), PRIOR_WEIGHT, jnp.float32), choice=jnp.zeros((), jnp.int32),
                     expected=jnp.zeros((B, O), jnp.float32), cost=zf, credit=jnp.zeros((), jnp.float32), steps=zi,
                     slot_steps=zi, predicted=zf, realised=zi, seconds=zf,
                     chosen=jnp.full((out_len,), -1, jnp.int32) if trace else None,
                     held=jnp.zeros((B,), jnp.int32), held_tokens=jnp.zeros((B, HOLD), jnp.int32),
                     held_feats=jnp.zeros((B, HOLD, features[0]), features[1]))
    return update(auto, options, None, None, ~done, lengths, None)


def expected_tokens(est, options):
    """est float32 [B, F, D] -> E float32 [B, O]: expected tokens a step of each option commits in
    each slot, 1 + the sum over its positions of each position's estimate capped by those before it.
    Written out over the (few, static) options and positions: elementwise work, no gather or reduce."""
    fam, pos, F, D = shape_arrays(options)
    capped = {}
    for f in range(F):
        run = est[:, f, 0]
        capped[f, 0] = run
        for i in range(1, D):
            run = jnp.minimum(run, est[:, f, i])
            capped[f, i] = run
    cols = []
    for f, m in zip(fam, pos):
        e = jnp.ones_like(est[:, 0, 0])
        for i in range(m):
            e = e + capped[f, i]
        cols.append(e)
    return jnp.stack(cols, -1)


def interpolate(table: Table, context):
    """Seconds a step of each option, float32 [O], at `context` (a float32 scalar, tokens): linear
    between the table's context points, their end values beyond (closed form, written out over the
    points: no search)."""
    c, v = table.contexts, table.cost
    out = v[:, 0]
    for k in range(c.shape[0] - 1):
        t = jnp.clip((context - c[k]) / (c[k + 1] - c[k]), 0.0, 1.0)
        out = out + t * (v[:, k + 1] - v[:, k])
    return out


def _first(flags):
    """The first index where flags bool [O] holds (O where none), unrolled over O (small)."""
    out = jnp.int32(flags.shape[0])
    for o in range(flags.shape[0] - 1, -1, -1):
        out = jnp.where(flags[o], jnp.int32(o), out)
    return out


def _most(x):
    """The largest entry of x [O], unrolled over O (small): no reduction kernel."""
    out = x[0]
    for o in range(1, x.shape[0]):
        out = jnp.maximum(out, x[o])
    return out


def _at(x, index):
    """x[index] for x [..., O] and a traced scalar index, unrolled over O (small): no gather."""
    out = jnp.zeros_like(x[..., 0])
    for o in range(x.shape[-1]):
        out = jnp.where(index == o, x[..., o], out)
    return out


def choose(expected, active, cost, available, credit, share: float = EXPLORE_SHARE, tokens=None):
    """The pure choice of one step: expected float32 [B, O] (`expected_tokens`), active bool [B], cost
    float32 [O] seconds, available bool [O], credit float32 [] -> (option int32 [], the credit after).
    The best option maximises (sum of active slots' expected tokens) / cost among the available ones
    (the first on ties). The next available one in order runs instead when the credit covers its
    predicted loss (its seconds less those the best option takes for its expected tokens), which
    the credit then pays; else the credit grows by share * the best one's cost, to at most the
    costliest available option's. tokens: those sums, float32 [O], where already summed."""
    if tokens is None:
        tokens = jnp.sum(jnp.where(active[:, None], expected, 0.0), 0)
    O = cost.shape[0]
    rate = jnp.where(available, tokens / jnp.where(available, cost, 1.0), -jnp.inf)
    best = _first(rate >= _most(rate))
    nxt = _first(available & (jnp.arange(O) > best))
    best_rate = _at(rate, best)
    pay = jnp.maximum(_at(cost, nxt) - jnp.where(best_rate > 0, _at(tokens, nxt) / best_rate, 0.0), 0.0)
    explore = (nxt < O) & (credit >= pay)
    choice = jnp.where(explore, nxt, best).astype(jnp.int32)
    cap = _most(jnp.where(available, cost, 0.0))
    credit = jnp.where(explore, credit - pay, jnp.minimum(credit + share * _at(cost, best), cap))
    return choice, credit


def update(auto: AutoState, options, active, accepted, active_after, lengths_after, step) -> AutoState:
    """The state after a step of the decided option (auto.choice) in which the slots active bool [B]
    accepted accepted int32 [B] drafts (None, None: no step, as before the first): its family's first
    m_o estimates move towards what each active slot saw, the counts of the choice grow (step: the
    step's index, the trace's column); then the next step's option is decided from the estimates,
    active_after bool [B] and lengths_after int32 [B] (the cost at the mean length of the rows that
    have any). Written for few kernels: elementwise work, one reduction over the slots, the rest on
    [O]-sized values written out over the options."""
    fam, pos, F, D = shape_arrays(options)
    O, B = len(options), active_after.shape[0]
    est, seen, ran_cost, choice = auto.est, auto.seen, auto.cost, auto.choice
    onehot = jnp.arange(O) == choice
    rows = []
    if accepted is not None:
        i = jnp.arange(D)
        f, m = _at(jnp.asarray(fam), choice), _at(jnp.asarray(pos), choice)
        upd = active[:, None, None] & (jnp.arange(F)[None, :, None] == f) & (i[None, None] < m)
        x = (accepted[:, None, None] > i[None, None]).astype(jnp.float32)
        w = jnp.maximum(EMA_WEIGHT, 1.0 / (seen + 1))
        est, seen = jnp.where(upd, est + w * (x - est), est), seen + upd
        on = active.astype(jnp.float32)
        rows = [on, on * _at(auto.expected, choice), on * (accepted + 1)]
    expected = expected_tokens(est, options)
    rows += [jnp.where(active_after[:, None], expected, 0.0), lengths_after.astype(jnp.float32)[:, None],
             (lengths_after > 0).astype(jnp.float32)[:, None]]
    sums = jnp.sum(jnp.concatenate([r.reshape(B, -1) for r in rows], 1), 0)  # one reduction over the slots
    n0 = 0 if accepted is None else 3
    tokens, total, count = sums[n0:n0 + O], sums[n0 + O], sums[n0 + O + 1]
    cost = interpolate(auto.table, total / jnp.maximum(count, 1.0))
    nxt, credit = choose(None, None, cost, auto.table.available, auto.credit, tokens=tokens)
    auto = auto.replace(est=est, seen=seen, choice=nxt, expected=expected, cost=cost, credit=credit)
    if accepted is None:
        return auto
    n, predicted, realised = sums[0], sums[1], sums[2]
    chosen = auto.chosen if auto.chosen is None else auto.chosen.at[step].set(choice, mode="drop")
    return auto.replace(steps=auto.steps + onehot, slot_steps=auto.slot_steps + onehot * n.astype(jnp.int32),
                        predicted=auto.predicted + onehot * predicted,
                        realised=auto.realised + onehot * realised.astype(jnp.int32),
                        seconds=auto.seconds + onehot * ran_cost, chosen=chosen)


def hold(auto: AutoState, active, token, feature) -> AutoState:
    """After a draft-free step: each active slot's committed token int32 [B] and the target's feature
    at its root [B, features] wait in the slot's next held place, for the draft to run over them at
    once (step.release) before the next step that drafts."""
    at = jax.nn.one_hot(auto.held, HOLD, dtype=bool) & active[:, None]  # [B, HOLD]
    return auto.replace(held=auto.held + active, held_tokens=jnp.where(at, token[:, None], auto.held_tokens),
                        held_feats=jnp.where(at[:, :, None], feature[:, None].astype(auto.held_feats.dtype),
                                             auto.held_feats))


def summary(auto, options, names, counters_hist) -> dict:
    """Host metrics of a finished run: auto (the loop's AutoState, as numpy or jax arrays), options
    and their names, counters_hist the slot-steps by accepted drafts (`metrics.Counters.hist`).
    accept_rate: accepted drafts over the drafts the chosen options could accept; per position i:
    slot-steps that accepted at least i + 1 over those whose option verified position i + 1;
    auto: per option its steps, slot-steps, mean predicted and realised committed tokens a slot-step,
    and the table's seconds summed over the steps run (predicted_seconds)."""
    _, pos, _, _ = shape_arrays(options)
    slot_steps = np.asarray(auto.slot_steps).astype(int)
    hist = np.asarray(counters_hist).astype(int)
    at_least = np.cumsum(hist[::-1])[::-1]
    reach = np.array([slot_steps[pos > i].sum() for i in range(len(hist) - 1)])
    drafted = int((slot_steps * pos).sum())
    per = lambda a: [float(x) / int(s) if s else None for x, s in zip(np.asarray(a), slot_steps)]  # noqa: E731
    return dict(
        accept_rate=float((at_least[1:]).sum() / drafted) if drafted else 0.0,
        accept_rate_per_position=[float(a / r) if r else None for a, r in zip(at_least[1:], reach)],
        depth_histogram=dict(zip(names, np.asarray(auto.steps).astype(int).tolist())),
        auto=dict(options=list(names), steps=np.asarray(auto.steps).astype(int).tolist(),
                  slot_steps=slot_steps.tolist(), predicted_tokens=per(auto.predicted),
                  realised_tokens=per(auto.realised), predicted_seconds=float(np.asarray(auto.seconds).sum())))
