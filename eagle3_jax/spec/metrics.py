"""Acceptance counters the decode loop carries on device, and their summary on the host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Counters:
    """Running totals over active slot-steps (a slot's step while it is unfinished)."""
    slot_steps: jax.Array  # int32 []: active slot-steps
    committed: jax.Array   # int32 []: tokens committed (accepted drafts + bonus, after eos / budget cuts)
    accepted: jax.Array    # int32 []: accepted draft tokens (before the cuts)
    hist: jax.Array        # int32 [depth + 1]: slot-steps by number of accepted drafts

    @classmethod
    def zeros(cls, depth: int) -> Counters:
        z = jnp.zeros((), jnp.int32)
        return cls(slot_steps=z, committed=z, accepted=z, hist=jnp.zeros((depth + 1,), jnp.int32))

    def add(self, active, accepted, committed) -> Counters:
        """One step: active bool [B], accepted drafts int32 [B], committed tokens int32 [B] (0 where
        inactive)."""
        on = active.astype(jnp.int32)
        return Counters(slot_steps=self.slot_steps + on.sum(), committed=self.committed + committed.sum(),
                        accepted=self.accepted + (accepted * on).sum(), hist=self.hist.at[accepted].add(on))


def throughput(steps: int, generated: int, seconds: float, compile_seconds: float) -> dict:
    """The metrics `generate` and `decode` share."""
    return dict(steps=steps, generated_tokens=generated, seconds=seconds, compile_seconds=compile_seconds,
                tokens_per_second=generated / seconds if seconds > 0 else float("inf"))


def acceptance(c: Counters, num_spec_tokens: int, num_draft_tokens: int) -> dict:
    """Host summary of the counters: mean_accept_length (tau: tokens committed per slot-step, the bonus
    counted), accept_rate (accepted drafts per slot-step over the most a step can accept,
    min(num_spec_tokens, num_draft_tokens - 1)), accept_rate_per_position (share of slot-steps that
    accepted at least i + 1 drafts), accept_length_histogram, frac_steps_ge2, slot_steps."""
    c = jax.tree.map(np.asarray, c)
    slot_steps = max(int(c.slot_steps), 1)
    hist = c.hist.astype(int)
    at_least = np.cumsum(hist[::-1])[::-1]  # at_least[i] = slot-steps that accepted >= i drafts
    return dict(slot_steps=int(c.slot_steps), mean_accept_length=int(c.committed) / slot_steps,
                accept_rate=int(c.accepted) / (slot_steps * min(num_spec_tokens, num_draft_tokens - 1)),
                accept_rate_per_position=(at_least[1:] / slot_steps).tolist(),
                accept_length_histogram=hist.tolist(),
                frac_steps_ge2=float(at_least[1] / slot_steps) if len(hist) > 1 else 0.0)
