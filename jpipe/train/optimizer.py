"""Step 2 of a run: the optimizer, on the packed parameters.

``config.optimizer.name`` picks the update rule and
``config.optimizer.lr_schedule`` the learning rate over the run
(`OPTIMIZERS`, `LR_SCHEDULES`). Every rule is an optax chain on the packed
buckets:

- ``adamw`` (the default): Adam, then decoupled weight decay, then the
  learning rate (`optax.adamw`'s chain);
- ``adam``: Adam, with ``weight_decay`` added to the gradient first (L2,
  as ``torch.optim.Adam``'s ``weight_decay``; 0 for plain Adam);
- ``sgd``: SGD with ``momentum`` (`optax.trace`; 0 for plain SGD), weight
  decay added to the gradient first (as ``torch.optim.SGD``'s);
- ``lion``: Lion's sign update (``b1``, ``b2``), then decoupled weight
  decay (`optax.lion`'s chain).

Weight decay is masked off norms and biases per bucket row (a bucket holds
arrays of one size, whatever their shape), and `optax.clip_by_global_norm`
runs first, over all the packed gradients. The packed arrays are sharded
over ``pipe``, so that norm is taken over every stage's gradients together,
not per stage, and a replicated stage's copies (whose gradients are equal)
count once (`counted_norm`); a bucket's padding rows (ranks without such an array) have
zero gradients, add nothing to the norm, and stay zero under every rule
here (each maps a zero gradient on a zero row to a zero update). The
optimizer state is laid out like the parameters, so each device holds only
its own stages' state.

Adafactor is not offered: it factors each array's second moment over its
last two axes, which for a packed bucket ``[R, n]`` would be the ranks and
the flattened parameters, statistics shared across stages that mean nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import optax

import jpipe
from jpipe.models import gpt
from jpipe.train.config import LR_SCHEDULES, OPTIMIZERS, OptimizerConfig


def learning_rate_schedule(c: OptimizerConfig, steps: int) -> optax.Schedule:
    """The learning rate at each step, as ``c.lr_schedule`` names it.

    Every schedule starts with a linear warm-up from 0 to ``learning_rate``
    over ``warmup_steps`` (none when 0), then:

    - ``warmup_cosine``: cosine decay to ``min_lr_ratio`` of the peak at the
      last step;
    - ``warmup_linear``: linear decay to ``min_lr_ratio`` of the peak at the
      last step;
    - ``constant``: the peak to the end (``min_lr_ratio`` does not apply).
    """
    warmup = min(c.warmup_steps, steps)
    peak, end = c.learning_rate, c.learning_rate * c.min_lr_ratio
    if c.lr_schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=warmup,
            decay_steps=max(steps, warmup + 1),
            end_value=end,
        )
    if c.lr_schedule == "warmup_linear":
        after = optax.linear_schedule(peak, end, max(steps - warmup, 1))
    elif c.lr_schedule == "constant":
        after = optax.constant_schedule(peak)
    else:
        raise ValueError(
            f"config.optimizer.lr_schedule={c.lr_schedule!r}: must be one of "
            f"{', '.join(LR_SCHEDULES)}"
        )
    if not warmup:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def packed_decay_rows(pipeline: jpipe.Pipeline, mask_fn=gpt.weight_decay_mask) -> dict:
    """Where weight decay applies in the packed parameters: ``{bucket: bool[R]}``.

    A bucket's row `r` is one array of rank `r` (or padding), and arrays of the
    same size share a bucket whatever their shape, so a bucket can hold a
    matrix on one rank and a bias on another: the rule is per row, not per
    bucket. Padding rows get False (they are zero either way).

    Args:
      pipeline: a pipeline whose parameters have been packed.
      mask_fn: the model's rule, a pytree of bools from one stage's parameter
        shapes (`jpipe.models.weight_decay_mask`: matrices and embeddings decay,
        norms and biases do not).
    """
    layout = pipeline.layout
    rows = {name: np.zeros(layout.num_ranks, bool) for name in layout.buckets}
    for s in range(len(layout.leaves)):
        decays = jax.tree.leaves(mask_fn(layout.stage_avals(s)))
        for (bucket, _, _), decay in zip(layout.leaves[s], decays, strict=True):
            rows[bucket][list(layout.stage_ranks[s])] = bool(decay)  # each copy alike
    return rows


def counted_norm(grads, counted_rows: dict | None = None):
    """The global norm of packed `grads`, counting only the rows `counted_rows` marks
    (`jpipe.stage.pack.ParamLayout.counted_rows`: a replicated stage's copies once).

    `optax.tree.norm` where every row counts (None, or all True).
    """
    if counted_rows is None or all(rows.all() for rows in counted_rows.values()):
        return optax.tree.norm(grads)
    squares = []
    for name, g in grads.items():
        keep = counted_rows[name].reshape((-1,) + (1,) * (g.ndim - 1))
        squares.append(jax.numpy.sum(jax.numpy.where(keep, jax.numpy.square(g), 0)))
    return jax.numpy.sqrt(sum(squares))


def clip_by_counted_norm(max_norm: float, counted_rows: dict) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` with the norm of `counted_norm`."""

    def update_fn(updates, state, params=None):
        del params
        return clip_by_norm(updates, counted_norm(updates, counted_rows), max_norm), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def decay_by_row(weight_decay: float, rows: dict) -> optax.GradientTransformation:
    """`optax.add_decayed_weights`, with the mask given per bucket row.

    Adds ``weight_decay * params`` to the updates of the rows where `rows` is
    True; other rows pass through unchanged.
    """

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("decay_by_row needs the parameters: pass them to update()")
        out = {}
        for name, u in updates.items():
            mask = rows[name]
            if weight_decay == 0 or not mask.any():
                out[name] = u
            else:
                rate = (weight_decay * mask).astype(np.dtype(u.dtype))
                out[name] = u + rate.reshape((-1,) + (1,) * (u.ndim - 1)) * params[name]
        return out, state

    return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(
    c: OptimizerConfig,
    steps: int,
    decay_rows: dict,
    clip: bool = True,
    counted_rows: dict | None = None,
) -> optax.GradientTransformation:
    """Global-norm clipping, then ``c.name``'s rule with `learning_rate_schedule`.

    Each rule is optax's own chain (see the module docstring) with the
    weight decay masked per bucket row; ``adamw`` is `optax.adamw`'s chain
    (scale by Adam, add decayed weights, scale by the learning rate).

    Args:
      c: the optimizer's config.
      steps: the run's length, for the schedule's decay.
      decay_rows: ``{bucket: bool[R]}`` from `packed_decay_rows`.
      clip: False leaves the clipping out (`per_rank_optimizers`: the
        global norm is then taken over every rank's gradients by the caller).
      counted_rows: the rows the clipping's norm counts
        (`ParamLayout.counted_rows`; None: all).

    Raises:
      ValueError: an unknown ``c.name`` or ``c.lr_schedule``, naming the choices.
    """
    if not (c.grad_clip_norm and clip):
        clip = optax.identity()
    elif counted_rows is None or all(rows.all() for rows in counted_rows.values()):
        clip = optax.clip_by_global_norm(c.grad_clip_norm)
    else:  # a replicated stage's copies counted once
        clip = clip_by_counted_norm(c.grad_clip_norm, counted_rows)
    decay = decay_by_row(c.weight_decay, decay_rows)
    if c.name == "adamw":
        rule = [optax.scale_by_adam(b1=c.b1, b2=c.b2), decay]
    elif c.name == "adam":
        rule = [decay, optax.scale_by_adam(b1=c.b1, b2=c.b2)]
    elif c.name == "sgd":
        rule = [decay, optax.trace(decay=c.momentum) if c.momentum else optax.identity()]
    elif c.name == "lion":
        rule = [optax.scale_by_lion(b1=c.b1, b2=c.b2), decay]
    else:
        raise ValueError(
            f"config.optimizer.name={c.name!r}: must be one of {', '.join(OPTIMIZERS)}"
        )
    return optax.chain(clip, *rule, optax.scale_by_learning_rate(learning_rate_schedule(c, steps)))


class RankOptimizers(NamedTuple):
    """One optimizer per rank (`per_rank_optimizers`) and the global-norm clip they share."""

    optimizers: list
    clip_norm: float

    def init(self, params: list) -> list:
        return [o.init(p) for o, p in zip(self.optimizers, params, strict=True)]


def per_rank_optimizers(c: OptimizerConfig, steps: int, pipeline: jpipe.Pipeline) -> RankOptimizers:
    """One optimizer per rank, for ranks with meshes of their own (`Pipeline.rank_meshes`).

    Each rank's parameters are a dict of its own buckets on its own devices,
    which one jitted update cannot span; each rank's optimizer is
    `make_optimizer`'s without the clipping (its decay rows the rank's row
    of `packed_decay_rows`): `clip_by_norm` clips with the norm over every
    rank's gradients, as `optax.clip_by_global_norm` over the packed ones.
    """
    rows = packed_decay_rows(pipeline)
    layout = pipeline.layout
    return RankOptimizers(
        [
            make_optimizer(c, steps, {b: rows[b][r : r + 1] for b in layout.rank_buckets(r)}, False)
            for r in range(layout.num_ranks)
        ],
        c.grad_clip_norm,
    )


def clip_by_norm(grads, norm, max_norm: float):
    """`optax.clip_by_global_norm`'s scaling of `grads` with a norm already taken."""
    if not max_norm:
        return grads
    trigger = norm < max_norm
    return jax.tree.map(
        lambda g: jax.numpy.where(trigger, g, (g / norm.astype(g.dtype)) * max_norm), grads
    )
