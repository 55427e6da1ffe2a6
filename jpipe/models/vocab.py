"""The embedding and the head split over the vocabulary on a tensor axis.

At real sizes the vocabulary is the largest single dimension of a decoder
(Llama 3's 128,256 tokens: the embedding and the head are 0.5 G parameters
each at D 4,096, and one microbatch's float32 logits at 8,192 tokens are
4.2 GB). Megatron-LM splits both over the tensor-parallel group
(``VocabParallelEmbedding`` and the vocab-parallel cross-entropy, Shoeybi et
al. 2019): each of the T devices holds ``V / T`` rows of the embedding and
``V / T`` columns of the head, and nothing ever holds the whole logits.

- **Lookup** (`vocab_embed`): each device looks its tokens up in its own rows,
  zeroes those it does not hold, and the results are summed over the axis
  (``lax.psum``), or summed and scattered over the sequence
  (``lax.psum_scatter``) when the activations are sequence-parallel
  (`jpipe.models.sequence`). Exactly one device contributes each row, so the
  sum is exact in any dtype.
- **Cross-entropy** (`vocab_cross_entropy`): from each device's slice of the
  logits, the log-sum-exp over the whole vocabulary and the target's logit:
  the maximum over the slices (``lax.pmax``, under ``lax.stop_gradient``:
  the log-sum-exp does not depend on the shift, so its gradient through the
  maximum is zero and ``pmax``, which has no transpose, is never
  differentiated), the sum of the shifted exponentials (``lax.psum``), the
  target's logit from the one device whose slice holds it (zeroed elsewhere,
  ``lax.psum``). Its gradient is JAX's own through the two sums:
  ``softmax - onehot`` on each device's slice, nothing gathered.

The loss is optax's ``softmax_cross_entropy_with_integer_labels`` (the same
formula: ``log(sum(exp(z - max))) - (z_target - max)``), the vocabulary's sum
taken in T parts: equal up to float32 summation order.

**The head stored by rows.** With ``vocab_split`` the head's weight is kept
as ``[V, D]``, the embedding's shape and split (``head/unembed/embedding``,
split by rows over the axis), and the logits are ``y @ W.T`` (a contraction
XLA reads in place, no transpose copied). The first rank's embedding and the
last rank's head then fill one bucket of the packed parameters
(`jpipe.stage.pack`): stored ``[D, V]`` split by columns, each would need a bucket
of its own and every other rank a zero row of it, about 3 GB a device more
for Llama-3-8B on tensor 2 with AdamW (a row of parameters and two of
moments, 1.05 GB each).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from jpipe.models import sequence
from jpipe.models.staged import head_token_losses
from jpipe.stage.pieces import WeightedLoss


def local_rows(total: int, axis: str, what: str) -> int:
    """``total / T``, refusing a vocabulary the axis does not divide."""
    t = lax.axis_size(axis)
    if total % t:
        raise ValueError(
            f"vocab_split: a {t}-way tensor axis must divide {what}={total} "
            "(pad the vocabulary to a multiple of it)"
        )
    return total // t


def vocab_embed(
    table_VxD: jax.Array,
    tokens_BxL: jax.Array,
    axis: str,
    dtype=None,
    scatter_dimension: int | None = None,
) -> jax.Array:
    """The embeddings of `tokens_BxL` from this device's rows `table_VxD` of the table.

    Device ``i`` of `axis` holds rows ``[i V/T, (i+1) V/T)``. Each looks up
    the tokens it holds, zeroes the others, and the partial lookups are
    summed over `axis` (cast to `dtype` first: one term of each sum is
    nonzero, so it is exact). With `scatter_dimension` the sum is scattered
    along that dimension (``lax.psum_scatter``): each device gets its slice
    of the sequence, for sequence parallelism.
    """
    rows = table_VxD.shape[0]
    local_BxL = tokens_BxL - lax.axis_index(axis) * rows
    inside_BxL = (local_BxL >= 0) & (local_BxL < rows)
    picked = jnp.take(table_VxD, jnp.where(inside_BxL, local_BxL, 0), axis=0)
    picked = jnp.where(inside_BxL[..., None], picked, jnp.zeros((), picked.dtype))
    if dtype is not None:
        picked = picked.astype(dtype)
    if scatter_dimension is None:
        return lax.psum(picked, axis)
    return lax.psum_scatter(picked, axis, scatter_dimension=scatter_dimension, tiled=True)


def vocab_cross_entropy(logits_BxLxV: jax.Array, targets_BxL: jax.Array, axis: str) -> jax.Array:
    """Per-token cross-entropy from this device's slice of the logits over the vocabulary.

    Args:
      logits_BxLxV: this device's logits, columns ``[i V/T, (i+1) V/T)`` of
        the whole vocabulary (any float dtype; computed in float32).
      targets_BxL: the target token ids (global ids, the same on every device).
      axis: the tensor axis the vocabulary is split over.

    Returns:
      ``-log softmax(logits)[target]`` per token, float32, the same on every
      device of `axis`.
    """
    logits = logits_BxLxV.astype(jnp.float32)
    columns = logits.shape[-1]
    # The shift: any value gives the same loss and gradient; the global
    # maximum keeps exp() in range. Never differentiated.
    shift_BxL = lax.pmax(lax.stop_gradient(logits.max(axis=-1)), axis)
    shifted = logits - shift_BxL[..., None]
    sum_exp_BxL = lax.psum(jnp.exp(shifted).sum(axis=-1), axis)
    local_BxL = targets_BxL - lax.axis_index(axis) * columns
    inside_BxL = (local_BxL >= 0) & (local_BxL < columns)
    picked = jnp.take_along_axis(shifted, jnp.where(inside_BxL, local_BxL, 0)[..., None], axis=-1)
    target_BxL = lax.psum(jnp.where(inside_BxL, picked[..., 0], 0.0), axis)
    return jnp.log(sum_exp_BxL) - target_BxL


class UnembedRows(nn.Module):
    """The head's logits ``y @ W.T`` from a weight ``W`` stored ``[V, D]`` (by vocabulary rows).

    Flax's ``nn.Embed.attend`` computes the same for a tied head; this one is
    the untied head's own parameter, ``embedding``, float32, initialized as
    the bias-free dense heads are (normal, std 0.02), computed in `dtype`.
    """

    rows: int
    dtype: jnp.dtype
    std: float = 0.02

    @nn.compact
    def __call__(self, y_BxLxD: jax.Array) -> jax.Array:
        table_VxD = self.param(
            "embedding", nn.initializers.normal(self.std), (self.rows, y_BxLxD.shape[-1])
        )
        y_BxLxD = y_BxLxD.astype(self.dtype)
        return lax.dot_general(y_BxLxD, table_VxD.astype(self.dtype), (((2,), (1,)), ((), ())))


def head_as_kernel(params_list):
    """Stage parameters with a ``[V, D]`` head (``vocab_split``) given the dense head's layout.

    Each stage's ``["head"]["unembed"]`` of ``{"embedding": W}`` becomes
    ``{"kernel": W.T}``, the parameters of the same model with
    ``vocab_split=False`` (and of a plain dense head elsewhere); stages
    without it are returned as they are. Works on gradients alike.
    """

    def one(params):
        head = params.get("head") if isinstance(params, dict) else None
        if not head or "embedding" not in head.get("unembed", {}):
            return params
        unembed = {"kernel": head["unembed"]["embedding"].T}
        return {**params, "head": {**head, "unembed": unembed}}

    return [one(p) for p in params_list]


def head_loss(module: nn.Module, c, y_BxLxD, inputs: dict, axis: str | None, linear):
    """The untied head and the mean token cross-entropy of a normed `y_BxLxD`.

    Shared by the Llama and the GPT heads (`c` a `LlamaConfig` or a
    `GPTConfig`; `linear(features, name, dtype)` a bias-free dense layer),
    within `module`'s compact scope. With `axis`, ``c.vocab_split`` and
    ``c.sequence_parallel`` as their config fields say.
    """
    dtype = jnp.dtype(c.dtype)
    split = axis is not None and c.vocab_split
    parallel = axis is not None and c.sequence_parallel
    targets_BxL = inputs["targets"]
    weights_BxL = inputs.get("weights")
    if parallel and split:
        y_BxLxD = sequence.gather(y_BxLxD, axis)  # the head is split by columns
    elif parallel:  # the head whole: this device's tokens, their sums added
        targets_BxL = sequence.shard(targets_BxL, axis)
        if weights_BxL is not None:
            weights_BxL = sequence.shard(weights_BxL, axis)
    columns = local_rows(c.vocab_size, axis, "vocab_size") if split else c.vocab_size
    if c.vocab_split:  # stored [V, D] with or without the axis: the reference's layout too
        unembed = UnembedRows(columns, dtype, name="unembed")
    else:
        unembed = linear(columns, "unembed", dtype)

    def token_losses(unembed, y_BxLxD, targets_BxL):
        logits_BxLxV = unembed(y_BxLxD)
        if split:
            return vocab_cross_entropy(logits_BxLxV, targets_BxL, axis)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits_BxLxV.astype(jnp.float32), targets_BxL
        )

    losses_BxL = head_token_losses(
        token_losses, unembed, y_BxLxD, targets_BxL, c, module.is_initializing()
    )
    summed = (lambda v: lax.psum(v, axis)) if parallel and not split else (lambda v: v)
    if weights_BxL is not None:
        weights_BxL = weights_BxL.astype(jnp.float32)
        return WeightedLoss(summed((losses_BxL * weights_BxL).sum()), summed(weights_BxL.sum()))
    if parallel and not split:
        return summed(losses_BxL.sum()) / (losses_BxL.size * lax.axis_size(axis))
    return losses_BxL.mean()
