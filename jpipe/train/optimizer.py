"""Step 2 of a run: the optimizer, on the packed parameters.

optax AdamW with linear warm-up and cosine decay, weight decay masked off
norms and biases (per bucket row: a bucket holds arrays of one size, whatever
their shape), and `optax.clip_by_global_norm` over all the packed gradients.
The packed arrays are sharded over ``pipe``, so that norm is taken over every
stage's gradients together, not per stage; a bucket's padding rows (ranks
without such an array) have zero gradients, add nothing to the norm, and stay
zero under AdamW. The optimizer state is laid out like the parameters, so
each device holds only its own stages' state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import optax

import jpipe
from jpipe.models import gpt
from jpipe.train.config import OptimizerConfig


def learning_rate_schedule(c: OptimizerConfig, steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to the peak, then cosine decay to ``min_lr_ratio`` of it."""
    warmup = min(c.warmup_steps, steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=c.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1),
        end_value=c.learning_rate * c.min_lr_ratio,
    )


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
            rows[bucket][layout.stage_to_rank[s]] = bool(decay)
    return rows


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
    c: OptimizerConfig, steps: int, decay_rows: dict, clip: bool = True
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with `learning_rate_schedule`.

    The AdamW is `optax.adamw`'s chain (scale by Adam, add decayed weights,
    scale by the learning rate) with the decay masked per bucket row.

    Args:
      c: the optimizer's config.
      steps: the run's length, for the cosine decay.
      decay_rows: ``{bucket: bool[R]}`` from `packed_decay_rows`.
      clip: False leaves the clipping out (`per_rank_optimizers`: the
        global norm is then taken over every rank's gradients by the caller).
    """
    clip = (
        optax.clip_by_global_norm(c.grad_clip_norm)
        if c.grad_clip_norm and clip
        else optax.identity()
    )
    return optax.chain(
        clip,
        optax.scale_by_adam(b1=c.b1, b2=c.b2),
        decay_by_row(c.weight_decay, decay_rows),
        optax.scale_by_learning_rate(learning_rate_schedule(c, steps)),
    )


class RankOptimizers(NamedTuple):
    """One optimizer per rank (`per_rank_optimizers`) and the global-norm clip they share."""

    optimizers: list
    clip_norm: float

    def init(self, params: list) -> list:
        return [o.init(p) for o, p in zip(self.optimizers, params, strict=True)]


def per_rank_optimizers(c: OptimizerConfig, steps: int, pipeline: jpipe.Pipeline) -> RankOptimizers:
    """One optimizer per rank, for ranks with meshes of their own (`Pipeline.rank_meshes`).

    Each rank's parameters are a dict of its own buckets on its own devices,
    which one jitted update cannot span; each rank's AdamW is
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
