"""The training loop the target and draft trainers share: AdamW with linear warmup and cosine
decay, one jitted step over an NNX model, orbax checkpoints with resume.

`fit` reads batches from `batch_fn(step)`, which must depend on the step alone (a seeded draw), so
a run resumed from a checkpoint at step s sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from eagle3_jax.checks import int_arg
from eagle3_jax.convert import folders


def adamw(lr: float, steps: int, warmup: int, *, weight_decay: float = 0.1, clip: float = 1.0,
          final_fraction: float = 0.1) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (b2 0.95) on a warmup + cosine schedule (peak lr, ending at
    final_fraction * lr; warmup 0: from the peak). Weight decay applies to matrices only (not norms,
    biases, sinks)."""
    steps, warmup = int_arg("steps", steps, 1), int_arg("warmup", warmup, 0)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * final_fraction)
    decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay))


def _checkpointer(ckpt_dir):
    import orbax.checkpoint as ocp

    path = os.path.abspath(ckpt_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"ckpt_dir {path}: is a file, expected a folder of training checkpoints")
    kind = folders.checkpoint_kind(path) if os.path.isdir(path) else None
    if kind is not None:
        raise ValueError(f"ckpt_dir {path}: holds {folders.describe(path)}, not training checkpoints (numbered step "
                         "folders); use another ckpt_dir")
    return ocp, ocp.CheckpointManager(os.path.abspath(ckpt_dir), options=ocp.CheckpointManagerOptions(max_to_keep=2))


def fit(model: nnx.Module, loss_fn: Callable, batch_fn: Callable[[int], dict], *, steps: int,
        tx: optax.GradientTransformation, extra: tuple = (), ckpt_dir: str | None = None, save_every: int = 500,
        log_every: int = 50, log: Callable[[dict], None] | None = None,
        eval_fn: Callable[[nnx.Module], dict] | None = None, progress: bool = True) -> list[dict]:
    """Trains the `nnx.Param`s of `model` in place for `steps` optimizer steps.

    loss_fn(model, batch, *extra) -> (scalar loss, dict of scalar metrics); `extra` holds frozen
    modules (e.g. the target a draft learns from), passed as jit arguments rather than baked in as
    constants. With `ckpt_dir`, model and optimizer state are saved every `save_every` steps and at
    the end, and a call finding a checkpoint there resumes from its step. Each step's checkpoint is
    written whole or not at all (orbax's CheckpointManager: a temporary folder, renamed once
    committed; a killed run resumes from the last committed step). A ckpt_dir holding another kind
    of checkpoint (an HF or `save_checkpoint` folder: `folders.checkpoint_kind`) raises ValueError
    before anything is written. Returns the logged records
    (step, loss, metrics, seconds since the start, and `eval_fn(model)`'s figures prefixed "eval_"),
    one every `log_every` steps and at the end.

    progress: a tqdm bar over the steps on stderr (tqdm.auto: a widget in notebooks), its postfix
    the loss and tokens per second (of the batches' "tokens"), refreshed about once a second (each
    refresh waits for the step in flight), and the last logged eval figures. log: called with each
    logged record; None prints them when progress is off (the bar shows them otherwise).

    A checkpoint saved at exactly `steps` (a finished run, called again) is restored and nothing is
    trained: the model holds the finished run's weights and the result is [] (no step ran, so
    nothing is logged). A checkpoint past `steps` raises ValueError (naming the directory, its step
    and `steps`) before the model is touched: restoring it would hand back a model trained longer
    than asked, and training cannot go backwards.
    """
    log_every, save_every = int_arg("log_every", log_every, 1), int_arg("save_every", save_every, 1)
    steps = int_arg("steps", steps, 0)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, batch, *extra):
        (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, *extra)
        opt.update(model, grads)
        return loss, metrics

    start, mgr = 0, None
    if ckpt_dir is not None:
        ocp, mgr = _checkpointer(ckpt_dir)
        if mgr.latest_step() is not None:
            start = int(mgr.latest_step())
            if start > steps:
                mgr.close()
                raise ValueError(f"ckpt_dir {os.path.abspath(ckpt_dir)}: holds a checkpoint at step {start}, past the "
                                 f"requested steps={steps} (resume with steps >= {start}, or use a fresh ckpt_dir)")
            state = nnx.state((model, opt))
            abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(state))
            restored = mgr.restore(start, args=ocp.args.StandardRestore(abstract))
            nnx.replace_by_pure_dict(state, restored)
            nnx.update((model, opt), state)
            (log or print)({"resumed_from_step": start})
    if log is None and not progress:
        log = print
    bar = _Progress(start, steps) if progress and start < steps else None
    history, t0 = [], time.perf_counter()
    try:
        for step in range(start, steps):
            batch = batch_fn(step)
            loss, metrics = train_step(model, opt, jax.tree.map(jnp.asarray, batch), *extra)
            done = step + 1
            if done % log_every == 0 or done == steps:
                rec = {"step": done, "loss": float(loss), **{k: float(v) for k, v in metrics.items()},
                       "seconds": time.perf_counter() - t0}
                if eval_fn is not None:
                    rec.update({"eval_" + k: float(v) for k, v in eval_fn(model).items()})
                if log is not None:
                    log(rec)
                history.append(rec)
                if bar is not None:
                    bar.evals = {k: v for k, v in rec.items() if k.startswith("eval_")}
            if bar is not None:
                bar.step(done, loss, batch)
            if mgr is not None and (done % save_every == 0 or done == steps):
                mgr.save(done, args=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state((model, opt)))))
    finally:
        if bar is not None:
            bar.close()
    if mgr is not None:
        mgr.wait_until_finished()
        mgr.close()
    return history


class _Progress:
    """fit's bar: one tick a step; about once a second (and at the last step) the loss is read (a
    wait for the step in flight) and the postfix shows it and the tokens per second since the last
    refresh."""

    REFRESH_SECONDS = 1.0

    def __init__(self, start: int, steps: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=steps, initial=start, desc="training", unit="step", dynamic_ncols=True)
        self.steps, self.evals = steps, {}
        self.t, self.tokens = time.perf_counter(), 0

    def step(self, done: int, loss, batch) -> None:
        self.bar.update(1)
        tokens = batch.get("tokens") if isinstance(batch, dict) else None
        self.tokens += int(np.size(tokens)) if tokens is not None else 0
        now = time.perf_counter()
        if now - self.t < self.REFRESH_SECONDS and done != self.steps:
            return
        text = f"loss {float(loss):.4f}"  # waits for this step: the rate below is the device's
        now = time.perf_counter()
        if self.tokens:
            text += f", {self.tokens / (now - self.t):,.0f} tokens/s"
        text += "".join(f", {k} {v:.4f}" for k, v in self.evals.items())
        self.bar.set_postfix_str(text)
        self.t, self.tokens = now, 0

    def close(self) -> None:
        self.bar.close()
