"""Sequence parallelism over a tensor axis (Korthikanti et al. 2022).

Megatron's tensor parallelism splits a block's matrices over the T devices
of the ``tensor`` axis but leaves every device the whole ``B x L x D``
activations between the split matmuls: the norms, the residual adds, the
dropouts, and (under rematerialization) each block's input kept for the
backward are computed and held T times. Sequence parallelism splits those
along the sequence instead: between the split regions each device holds
``L / T`` positions of every row, and the all-reduce that closes a split
region becomes its two halves:

- before the column-split matmuls (query/key/value, the MLP's first
  matrices): an **all-gather** of the normed shard along the sequence
  (``lax.all_gather(..., tiled=True)``), so attention sees every position
  (rotary angles are then those of the global positions, as unsplit);
- after the row-split matmuls (attention's output, the MLP's last): a
  **reduce-scatter** (``lax.psum_scatter``) of the partial products along the
  sequence instead of the ``lax.psum``.

The two are each other's transpose, so JAX's gradients are Megatron's
backward: a reduce-scatter of the gathered input's gradient, an all-gather
of the scattered output's. The communication is that of the all-reduce they
replace (an all-reduce is a reduce-scatter then an all-gather).

The stage boundary: jpipe's lowering wants a stage's input and output the
same on every device of ``tensor`` (`jpipe.stage.manual`), so `at_stage_boundaries`
gathers the last block's shard back (``lax.all_gather(..., to="invarying")``)
and the next stage cuts its shard out of what it receives (no communication);
the values kept between a stage's blocks are shards, what crosses stages is
whole. The first stage's embedding leaves a shard (its own slice of the
tokens, or the vocabulary-split lookup's sum scattered along the sequence,
`jpipe.models.vocab`), and the head starts from one (its norm on the shard).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
from jax import lax

from jpipe.models.staged import _masked

SEQUENCE = 1  # the sequence dimension of the ``B x L x ...`` activations


def local_length(length: int, axis: str) -> int:
    """``L / T``, refusing a sequence the axis does not divide."""
    t = lax.axis_size(axis)
    if length % t:
        raise ValueError(
            f"sequence_parallel: a {t}-way tensor axis must divide the sequence length {length}"
        )
    return length // t


def shard(x_BxLx___: jax.Array, axis: str) -> jax.Array:
    """This device's slice ``[i L/T, (i+1) L/T)`` of the sequence (no communication).

    `x` is the same on every device of `axis`; the gradient of the slice is
    the slices' gradients gathered (the transpose of an all-gather to the
    same-everywhere value), rather than JAX's own transpose of the cast and
    the slice, an all-reduce of the zero-padded slices (twice the traffic;
    and JAX 0.10 refuses it, mixing the varying and invariant indices of
    the ``dynamic_update_slice`` it builds).
    """
    local_length(x_BxLx___.shape[SEQUENCE], axis)
    if not jax.dtypes.issubdtype(x_BxLx___.dtype, jax.numpy.inexact):
        return _cut(x_BxLx___, axis)  # token ids, targets, weights' masks: no gradient
    return _shard(x_BxLx___, axis)


def _cut(x_BxLx___: jax.Array, axis: str) -> jax.Array:
    n = x_BxLx___.shape[SEQUENCE] // lax.axis_size(axis)
    return lax.dynamic_slice_in_dim(x_BxLx___, lax.axis_index(axis) * n, n, axis=SEQUENCE)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _shard(x_BxLx___, axis):
    return _cut(x_BxLx___, axis)


def _shard_fwd(x_BxLx___, axis):
    return _cut(x_BxLx___, axis), None


def _shard_bwd(axis, _, d_BxNx___):
    return (lax.all_gather(d_BxNx___, axis, axis=SEQUENCE, tiled=True, to="invarying"),)


_shard.defvjp(_shard_fwd, _shard_bwd)


def gather(x_BxNx___: jax.Array, axis: str) -> jax.Array:
    """The whole sequence from every device's slice (all-gather; its transpose reduce-scatters)."""
    return lax.all_gather(x_BxNx___, axis, axis=SEQUENCE, tiled=True)


def scatter_sum(x_BxLx___: jax.Array, axis: str) -> jax.Array:
    """The sum over `axis` of the partial values, this device's slice of it (reduce-scatter)."""
    local_length(x_BxLx___.shape[SEQUENCE], axis)
    return lax.psum_scatter(x_BxLx___, axis, scatter_dimension=SEQUENCE, tiled=True)


def dropout(x_BxNx___: jax.Array, keys_BxK: jax.Array | None, rate: float, axis: str):
    """`jpipe.models.row_dropout` of the whole sequence, on this device's slice of it.

    Each row's mask is drawn for the whole ``L x ...`` from its key, as
    unsplit, and cut to the slice: the same numbers wherever the sequence is.
    """
    if keys_BxK is None or rate == 0:
        return x_BxNx___
    n = x_BxNx___.shape[SEQUENCE]
    whole = (n * lax.axis_size(axis), *x_BxNx___.shape[SEQUENCE + 1 :])
    typed = jax.random.wrap_key_data(keys_BxK)
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, whole))(typed)
    keep = lax.dynamic_slice_in_dim(keep, lax.axis_index(axis) * n, n, axis=SEQUENCE)
    return _masked(1.0 / (1.0 - rate), x_BxNx___, keep)


def at_stage_boundaries(stages: Sequence[Callable], axis: str) -> tuple[Callable, ...]:
    """Stages whose blocks run on sequence shards, with whole values between stages.

    Each stage but the first cuts its shard out of the activation it
    receives; each but the last gathers its output back to the whole
    sequence, the same on every device of `axis` (``to="invarying"``, whose
    transpose is the cut). The first stage's embedding and the last stage's
    head work on shards themselves.
    """
    count = len(stages)
    wrapped = []
    for s, fn in enumerate(stages):

        def stage(params, x, inputs, fn=fn, first=s == 0, last=s == count - 1):
            if not first:
                x = jax.tree.map(lambda a: shard(a, axis), x)
            y = fn(params, x, inputs)
            if not last:
                y = jax.tree.map(
                    lambda a: lax.all_gather(a, axis, axis=SEQUENCE, tiled=True, to="invarying"),
                    y,
                )
            return y

        stage.__name__ = getattr(fn, "__name__", f"stage_{s}")
        wrapped.append(stage)
    return tuple(wrapped)
