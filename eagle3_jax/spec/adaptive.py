"""depth="auto": the draft shape chosen at every step, on device, from each slot's running acceptance
and a table of step times (the table's data: spec/cost_table.py; the options: `Plan.auto`).

Options, in order: chains of d = 0, 1, ..., D drafts (0: the target alone on the root, as `generate`
steps, the draft kept up to date), then the configured tree if any. Option o verifies m_o positions
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
option's cost to a credit (at most the costliest option's); when the credit covers the cost of the
next option in order, that one runs instead and the credit pays for it, so deeper positions keep
being observed at about EXPLORE_SHARE of the predicted time.
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
    choice: jax.Array    # int32 []: the option of the next step (`decide`, from the state after the last)
    expected: jax.Array  # float32 [B, O]: the expected tokens behind that choice
    cost: jax.Array      # float32 [O]: the seconds a step behind it
    credit: jax.Array    # float32 []: seconds of exploration earned and not spent, that choice's paid
    steps: jax.Array     # int32 [O]: steps that ran each option (the histogram of choices)
    slot_steps: jax.Array  # int32 [O]: active slot-steps of each option
    predicted: jax.Array   # float32 [O]: expected committed tokens, summed over those slot-steps
    realised: jax.Array    # int32 [O]: accepted drafts + bonus of those slot-steps (before eos / budget cuts)
    seconds: jax.Array     # float32 [O]: the table's seconds for the steps that ran each option
    chosen: jax.Array | None  # int32 [out_len] (Plan.trace): the option of step s, -1 past the last


def shape_arrays(options) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(family int32 [O]: 0 for chains, 1, 2, ... for each tree in order; positions int32 [O]: m_o;
    F families; D positions) of options ((depth, branching, num_nodes), ...)."""
    fam, pos, trees = [], [], 0
    for d, k, n in options:
        trees += k > 1
        fam.append(trees if k > 1 else 0)
        pos.append(min(d, n - 1) if k > 1 else d)
    return np.array(fam, np.int32), np.array(pos, np.int32), trees + 1, max(max(pos), 1)


def init(table: Table, options, done, lengths, out_len: int, trace: bool) -> AutoState:
    """The state before the first step (done bool [B], lengths int32 [B] after the prefill): every
    estimate PRIOR of weight PRIOR_WEIGHT, the first step's option decided."""
    _, _, F, D = shape_arrays(options)
    O, B = len(options), lengths.shape[0]
    zi, zf = jnp.zeros((O,), jnp.int32), jnp.zeros((O,), jnp.float32)
    auto = AutoState(table=jax.tree.map(jnp.asarray, table), est=jnp.full((B, F, D), PRIOR, jnp.float32),
                     seen=jnp.full((B, F, D), PRIOR_WEIGHT, jnp.float32), choice=jnp.zeros((), jnp.int32),
                     expected=jnp.zeros((B, O), jnp.float32), cost=zf, credit=jnp.zeros((), jnp.float32), steps=zi,
                     slot_steps=zi, predicted=zf, realised=zi, seconds=zf,
                     chosen=jnp.full((out_len,), -1, jnp.int32) if trace else None)
    return decide(auto, ~done, lengths, options)


def expected_tokens(est, options):
    """est float32 [B, F, D] -> E float32 [B, O]: expected tokens a step of each option commits in
    each slot, 1 + the sum over its positions of each position's estimate capped by those before it."""
    fam, pos, _, D = shape_arrays(options)
    capped = jax.lax.cummin(est, axis=2)[:, fam]  # [B, O, D]
    return 1 + jnp.sum(jnp.where(np.arange(D)[None, None] < pos[None, :, None], capped, 0.0), -1)


def cost_now(table: Table, lengths):
    """Seconds a step of each option, float32 [O], at the mean of lengths int32 [B] over the rows with
    any (a mesh's padding rows have none)."""
    ctx = jnp.sum(lengths.astype(jnp.float32)) / jnp.maximum(jnp.sum(lengths > 0), 1)
    return jax.vmap(lambda c: jnp.interp(ctx, table.contexts, c))(table.cost)


def choose(expected, active, cost, available, credit, share: float = EXPLORE_SHARE):
    """The pure choice of one step: expected float32 [B, O] (`expected_tokens`), active bool [B], cost
    float32 [O] seconds, available bool [O], credit float32 [] -> (option int32 [], the credit after).
    The best option maximises (sum of active slots' expected tokens) / cost among the available ones
    (the first on ties); the next available one in order runs instead when the credit covers its
    cost (which it then pays); else the credit grows by share * the best one's cost, to at most the
    costliest available option's."""
    tokens = jnp.sum(jnp.where(active[:, None], expected, 0.0), 0)
    rate = jnp.where(available, tokens / jnp.where(available, cost, 1.0), -jnp.inf)
    best = jnp.argmax(rate).astype(jnp.int32)
    idx = jnp.arange(cost.shape[0], dtype=jnp.int32)
    nxt = jnp.min(jnp.where(available & (idx > best), idx, cost.shape[0]))
    explore = (nxt < cost.shape[0]) & (credit >= cost[jnp.minimum(nxt, cost.shape[0] - 1)])
    choice = jnp.where(explore, nxt, best).astype(jnp.int32)
    cap = jnp.max(jnp.where(available, cost, 0.0))
    credit = jnp.where(explore, credit - cost[choice], jnp.minimum(credit + share * cost[best], cap))
    return choice, credit


def decide(auto: AutoState, active, lengths, options) -> AutoState:
    """The next step's option from the state after the last (active bool [B]: the slots not done,
    lengths int32 [B]): `choose` on the expected tokens and the table's seconds at those lengths;
    sets choice, expected, cost and the credit after it."""
    expected = expected_tokens(auto.est, options)
    cost = cost_now(auto.table, lengths)
    choice, credit = choose(expected, active, cost, auto.table.available, auto.credit)
    return auto.replace(choice=choice, expected=expected, cost=cost, credit=credit)


def observe(auto: AutoState, options, active, accepted, step) -> AutoState:
    """The state after a step of the decided option (auto.choice) in which the slots active bool [B]
    accepted accepted int32 [B] drafts: the estimates of its family's first m_o positions move towards
    what each active slot saw and the counts of the choice grow; step: the step's index (the trace's
    column). The next option is then `decide`d from the state after the step."""
    fam, pos, F, D = shape_arrays(options)
    choice = auto.choice
    f, m = jnp.asarray(fam)[choice], jnp.asarray(pos)[choice]
    i = jnp.arange(D)
    upd = active[:, None, None] & (jnp.arange(F)[None, :, None] == f) & (i[None, None] < m)
    x = (accepted[:, None, None] > i[None, None]).astype(jnp.float32)
    w = jnp.maximum(EMA_WEIGHT, 1.0 / (auto.seen + 1))
    on = (jnp.arange(len(options)) == choice)
    n = jnp.sum(active.astype(jnp.int32))
    chosen = auto.chosen if auto.chosen is None else auto.chosen.at[step].set(choice, mode="drop")
    return auto.replace(
        est=jnp.where(upd, auto.est + w * (x - auto.est), auto.est), seen=auto.seen + upd,
        steps=auto.steps + on, slot_steps=auto.slot_steps + on * n,
        predicted=auto.predicted + on * jnp.sum(jnp.where(active, auto.expected[:, choice], 0.0)),
        realised=auto.realised + on * jnp.sum(jnp.where(active, accepted + 1, 0)),
        seconds=auto.seconds + on * auto.cost[choice], chosen=chosen)


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
