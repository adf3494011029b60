"""The decode loop's state: `Plan` (static shapes and switches) and `DecodeState` (what it carries)."""

from __future__ import annotations

import dataclasses

import jax
from flax import struct

from eagle3_jax.models.kv_cache import KVCache
from eagle3_jax.spec import adaptive
from eagle3_jax.spec.adaptive import AutoState
from eagle3_jax.spec.metrics import Counters
from eagle3_jax.spec.sampling import Filters


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static choices of one compiled loop (hashable: one executable per plan and argument shapes).

    depth 0 is the baseline (`generate`: no draft, one token a step); depth >= 1 drafts a chain
    (branching 1) or a tree of num_nodes nodes including the root. Whether sampling filters run is
    the state's choice (`DecodeState.filters` None or not: part of the arguments' structure).
    auto: decode(depth="auto"): the shapes each step chooses among, ((depth, branching, num_nodes),
    ...) in order (spec/adaptive.py), depth/branching/num_nodes then the largest (the configured
    shape); each option runs as `options[i]`, whose caches and slack are this plan's. () for one shape:
    the program is then the one it was before either switch existed (trace likewise)."""
    cache_len: int         # KV slots a row
    out_len: int           # output columns a row (>= max_new_tokens)
    chunk: int             # prefill chunk (tokens a row)
    greedy: bool           # argmax (temperature 0) or sampling
    depth: int = 0         # draft tokens along a path (num_spec_tokens)
    branching: int = 1     # children per expanded node (decode's `branching`)
    num_nodes: int = 1     # verified tokens a step, the root included
    feature_ids: tuple = ()  # target hidden-state indices the draft reads (draft.config.feature_layers)
    proposal: str = "deterministic"  # the draft's best children, or "sample": drawn from the draft (spec/tree.py)
    trace: bool = False    # DecodeState.trace: the tokens each slot commits at each step
    auto: tuple = ()       # depth="auto": the options ((depth, branching, num_nodes), ...) in order; (): fixed
    min_slack: int = 0     # cache slots kept free past the length at least (an option: its auto plan's slack)

    @property
    def width(self) -> int:
        """Most tokens one step commits: depth accepted drafts + the bonus."""
        return self.depth + 1

    @property
    def step_tokens(self) -> int:
        """Most tokens one cached call of a step writes: verify num_nodes (the baseline 1), the draft's
        tree levels (depth - 1) * branching and its extend depth + 1 (auto: the most of any option, and
        adaptive.HOLD, the draft's release); the caches' `max_step_tokens`."""
        shapes = self.auto or ((self.depth, self.branching, self.num_nodes),)
        most = max(max(n, (d - 1) * k, d + 1) if d else 1 for d, k, n in shapes)
        return max(most, adaptive.HOLD) if self.auto else most  # auto: the draft's release of held inputs

    @property
    def slack(self) -> int:
        """Cache slots a step needs past the committed length: verify writes num_nodes slots, the
        draft's extend depth + 1 (auto: the most of any option; at least min_slack)."""
        shapes = self.auto or ((self.depth, self.branching, self.num_nodes),)
        return max(self.min_slack, *(n + d + 1 if d else 1 for d, k, n in shapes))

    @property
    def options(self) -> tuple[Plan, ...]:
        """The plan of each option of `auto` (one shape each), with this plan's slack, in order."""
        return tuple(dataclasses.replace(self, depth=d, branching=k, num_nodes=n, auto=(), min_slack=self.slack)
                     for d, k, n in self.auto)


@struct.dataclass
class DecodeState:
    """Everything one iteration reads and writes, per slot b of the batch B."""
    target_cache: KVCache     # target K/V per layer [B, Hkv, S, D]; slots >= lengths are scratch
    draft_cache: KVCache | None  # the draft layer's K/V [B, Hkv, S, D]; None for the baseline
    lengths: jax.Array        # int32 [B]: positions in the caches (the prompt + committed tokens but the root)
    root: jax.Array           # int32 [B]: the last committed token, the next step's first input
    h_root: jax.Array | None  # [B, Hd] draft hidden state at position lengths - 1 (proposes depth 1); None: baseline
    out: jax.Array            # int32 [B, out_len]: generated ids, columns >= n_out zero
    n_out: jax.Array          # int32 [B]: generated ids so far (eos included)
    done: jax.Array           # bool [B]: eos, budget or cache reached; a done slot changes nothing
    budget: jax.Array         # int32 []: max_new_tokens
    eos_ids: jax.Array        # int32 [E]: stop ids, padded with -1
    temperature: jax.Array    # float32 []: sampling temperature (unused when greedy)
    filters: Filters | None   # top_k / top_p / min_p (spec/sampling.py); None: none (and always when greedy)
    key: jax.Array            # PRNG key; the first token draws with fold_in(key, 0), step i with fold_in(key, i + 1)
    steps: jax.Array          # int32 []: iterations run
    counters: Counters        # acceptance totals (spec/metrics.py)
    trace: jax.Array | None = None  # int32 [B, out_len] (Plan.trace): column s the tokens slot b committed
    #                                 at step s (accepted drafts + bonus, after the eos / budget cuts), -1
    #                                 where the slot was done or the step not run; None: not traced
    auto: AutoState | None = None   # depth="auto": each slot's running acceptance, the cost table, the
    #                                 choices made (spec/adaptive.py); None for a fixed shape
