"""A GPT language model, cut into pipeline stages.

The pipeline compiler runs a model given as an ordered list of stage functions
``stage(params, x, inputs) -> y``, each with its own parameter pytree. This
module builds that list for a GPT (pre-norm, learned positions, untied head):

- the first stage embeds ``inputs["tokens"]`` (token plus position embedding)
  and ignores its ``x`` (the compiler passes ``None``), then runs its blocks;
- a middle stage runs its blocks on ``x``;
- the last stage runs its blocks, the final LayerNorm and the head, and returns
  the mean token cross-entropy against ``inputs["targets"]`` as a float32
  scalar.

Every boundary between stages carries ``x_BxLxD`` in ``GPTConfig.dtype``. With a
single stage, that stage does all of the above. ``inputs`` is the microbatch:
``{"tokens": int32[B, L], "targets": int32[B, L]}``.

A stage's parameters are a dict with ``"embed"`` (first stage only), ``"blocks"``
(a tuple, one entry per block, absent when the stage has none) and ``"head"``
(last stage only). Parameters are float32; ``GPTConfig.dtype`` is the compute
dtype.

Initialization does not depend on how the layers are split: the embedding,
block ``i`` and the head each draw from a key folded from the model key and
their own global index, so ``pipe=4`` and ``pipe=1`` start from identical
weights and `merge_stage_params` of either gives the same tree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

Params = Any  # a pytree of arrays
StageFn = Callable[[Params, Any, dict], jax.Array]

_DTYPES = ("float32", "bfloat16", "float16")
_INIT_STD = 0.02  # GPT-2's


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The sizes of a GPT.

    Attributes:
      vocab_size: number of token ids (256 for the byte-level corpus).
      seq_len: the longest sequence, i.e. the rows of the position table.
      num_layers: number of transformer blocks, over all stages.
      num_heads: attention heads per block; must divide `d_model`.
      d_model: model width D.
      d_ff: hidden width of each block's MLP.
      dtype: compute and activation dtype, ``"float32"``, ``"bfloat16"`` or
        ``"float16"``. Parameters and the loss are always float32.
    """

    vocab_size: int
    seq_len: int
    num_layers: int
    num_heads: int
    d_model: int
    d_ff: int
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "d_model", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.d_model % self.num_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by num_heads={self.num_heads}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"GPTConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")


class StagedModel(NamedTuple):
    """A model as the pipeline compiler takes it.

    Attributes:
      stages: one pure, jittable function ``stage(params, x, inputs) -> y`` per
        stage, in pipeline order.
      init: ``init(rng) -> list`` of per-stage parameter pytrees; `rng` is a
        JAX key or an int seed. Pure, so it can be jitted with output
        shardings.
      loss: ``loss(params_list, batch) -> float32 scalar``, the unpipelined
        reference: every stage in sequence on the whole batch.
      config: the model's sizes.
      layers_per_stage: blocks held by each stage.
    """

    stages: tuple[StageFn, ...]
    init: Callable[[Any], list]
    loss: Callable[[list, dict], jax.Array]
    config: GPTConfig
    layers_per_stage: tuple[int, ...]


def split_layers(
    num_layers: int,
    num_stages: int,
    layers_per_stage: str | Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Decides how many blocks each stage holds.

    Balanced (`layers_per_stage` is None or ``""``): every stage gets
    ``num_layers // num_stages`` blocks and the remainder goes one each to the
    middle stages first (1, 2, ..., S-2), then to the first stage: the first and
    last stages already carry the embedding and the head. For example 6 layers
    on 4 stages gives ``(1, 2, 2, 1)`` and 7 gives ``(2, 2, 2, 1)``.

    The first and last stages may hold zero blocks (they still embed, or compute
    the head and loss); a middle stage may not, since it would do nothing.

    Args:
      num_layers: blocks in the model.
      num_stages: stages in the pipeline.
      layers_per_stage: None or ``""`` for balanced, or the count for each stage
        as a sequence of ints or a comma-separated string such as ``"3,4,4,3"``.

    Returns:
      The number of blocks of each stage, summing to `num_layers`.

    Raises:
      ValueError: the counts cannot be parsed, their number is not
        `num_stages`, they do not sum to `num_layers`, one is negative, or a
        middle stage would have no block.
    """
    if not isinstance(num_stages, numbers.Integral) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if not isinstance(num_layers, numbers.Integral) or num_layers < 0:
        raise ValueError(f"num_layers must be a non-negative int, got {num_layers!r}")

    balanced = layers_per_stage is None or (
        isinstance(layers_per_stage, str) and not layers_per_stage.strip()
    )
    if balanced:
        base, extra = divmod(num_layers, num_stages)
        counts = [base] * num_stages
        for stage in (list(range(1, num_stages - 1)) + [0, num_stages - 1])[:extra]:
            counts[stage] += 1
        source = f"balanced split of {num_layers} layers over {num_stages} stages"
    else:
        counts = _parse_counts(layers_per_stage)
        source = f"layers_per_stage={_show(layers_per_stage)}"
        if len(counts) != num_stages:
            raise ValueError(
                f"{source} gives {len(counts)} stages but the pipeline has "
                f"{num_stages}: give one count per stage"
            )
        if any(c < 0 for c in counts):
            raise ValueError(f"{source} has a negative count")
        if sum(counts) != num_layers:
            raise ValueError(
                f"{source} sums to {sum(counts)} but the model has num_layers={num_layers}"
            )

    empty = [s for s in range(1, num_stages - 1) if counts[s] == 0]
    if empty:
        if balanced:
            hint = f"need num_layers >= num_stages - 2 = {num_stages - 2}"
        else:
            hint = "give every middle stage at least one layer"
        raise ValueError(
            f"{source} gives {tuple(counts)}: middle stage(s) {empty} would have no "
            f"layer; only the first and last stages may have 0 ({hint})"
        )
    return tuple(counts)


def _parse_counts(layers_per_stage: str | Sequence[int]) -> list[int]:
    """Reads ``"3,4,4,3"`` or ``[3, 4, 4, 3]`` into a list of ints."""
    if not isinstance(layers_per_stage, str) and not hasattr(layers_per_stage, "__iter__"):
        raise ValueError(
            f"layers_per_stage must be a string such as '3,4,4,3' or a sequence of ints, "
            f"got {layers_per_stage!r}; split_layers(num_layers, num_stages) gives a "
            f"balanced split"
        )
    items = layers_per_stage.split(",") if isinstance(layers_per_stage, str) else layers_per_stage
    counts = []
    for item in items:
        try:
            if isinstance(item, bool):
                raise TypeError
            counts.append(int(item.strip()) if isinstance(item, str) else operator.index(item))
        except (TypeError, ValueError):
            raise ValueError(
                f"layers_per_stage={_show(layers_per_stage)} must be comma-separated "
                f"integers such as '3,4,4,3', got the entry {item!r}"
            ) from None
    return counts


def _show(layers_per_stage) -> str:
    if isinstance(layers_per_stage, str):
        return repr(layers_per_stage)
    return repr(tuple(layers_per_stage))


# ---------------------------------------------------------------------------
# Flax modules. Each is applied on its own so a stage holds only its own part.


def _dense(features: int, name: str, dtype, std: float = _INIT_STD, use_bias: bool = True):
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(std),
        name=name,
    )


class _Embed(nn.Module):
    """Token plus learned position embedding."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        c = self.config
        token_VxD = self.param(
            "token", nn.initializers.normal(_INIT_STD), (c.vocab_size, c.d_model)
        )
        position_LxD = self.param(
            "position", nn.initializers.normal(_INIT_STD), (c.seq_len, c.d_model)
        )
        length = tokens_BxL.shape[1]
        x_BxLxD = jnp.take(token_VxD, tokens_BxL, axis=0) + position_LxD[:length]
        return x_BxLxD.astype(c.dtype)


class _Block(nn.Module):
    """Pre-norm block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        b, length, d = x_BxLxD.shape
        h, k = c.num_heads, c.d_model // c.num_heads
        # GPT-2 scales the init of the projections into the residual stream so
        # that its variance does not grow with depth.
        residual_std = _INIT_STD / math.sqrt(2 * c.num_layers)

        y_BxLxD = nn.LayerNorm(dtype=dtype, name="ln_attn")(x_BxLxD)
        qkv_BxLx3xHxK = _dense(3 * d, "qkv", dtype)(y_BxLxD).reshape(b, length, 3, h, k)
        q, kk, v = (qkv_BxLx3xHxK[:, :, i] for i in range(3))
        attn_BxLxHxK = jax.nn.dot_product_attention(q, kk, v, is_causal=True)
        x_BxLxD = x_BxLxD + _dense(d, "attn_out", dtype, residual_std)(
            attn_BxLxHxK.reshape(b, length, d)
        )

        y_BxLxD = nn.LayerNorm(dtype=dtype, name="ln_mlp")(x_BxLxD)
        y_BxLxF = nn.gelu(_dense(c.d_ff, "mlp_in", dtype)(y_BxLxD))
        return x_BxLxD + _dense(d, "mlp_out", dtype, residual_std)(y_BxLxF)


class _Head(nn.Module):
    """Final LayerNorm, untied head and mean token cross-entropy."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, targets_BxL: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        y_BxLxD = nn.LayerNorm(dtype=dtype, name="ln_final")(x_BxLxD)
        logits_BxLxV = _dense(c.vocab_size, "unembed", dtype, use_bias=False)(y_BxLxD)
        losses_BxL = optax.softmax_cross_entropy_with_integer_labels(
            logits_BxLxV.astype(jnp.float32), targets_BxL
        )
        return losses_BxL.mean()


# ---------------------------------------------------------------------------
# Stages.


def _stage(params: Params, x, inputs: dict, *, config: GPTConfig, first: bool, last: bool):
    """One pipeline stage; `first` and `last` say which ends it carries."""
    if first:
        x = _Embed(config).apply({"params": params["embed"]}, inputs["tokens"])
    block = _Block(config)
    for block_params in params.get("blocks", ()):
        x = block.apply({"params": block_params}, x)
    if last:
        return _Head(config).apply({"params": params["head"]}, x, inputs["targets"])
    return x


def _sequential_loss(params_list: list, batch: dict, *, stages: tuple[StageFn, ...]) -> jax.Array:
    """Every stage in order on the whole batch: the unpipelined reference."""
    if len(params_list) != len(stages):
        raise ValueError(f"got {len(params_list)} stage parameter trees for {len(stages)} stages")
    x = None
    for stage, params in zip(stages, params_list, strict=True):
        x = stage(params, x, batch)
    return x


def _as_key(rng) -> jax.Array:
    """A JAX key from a key (typed or raw) or an integer seed (traced or not)."""
    if isinstance(rng, numbers.Integral):
        return jax.random.key(int(rng))
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.ndim == 0:
        return jax.random.key(rng)
    return rng


@functools.partial(jax.jit, static_argnames="config")
def _init_full(rng, config: GPTConfig) -> dict:
    """The whole model's parameters: ``{"embed", "blocks", "head"}``."""
    # Jitted (config is static and hashable) so that calling init eagerly costs
    # one compile, not one per operation; an outer jit simply inlines it.
    rng = _as_key(rng)
    embed_key, blocks_key, head_key = (jax.random.fold_in(rng, i) for i in range(3))
    # Length-1 dummies: the parameter shapes do not depend on L.
    tokens_1x1 = jnp.zeros((1, 1), jnp.int32)
    x_1x1xD = jnp.zeros((1, 1, config.d_model), config.dtype)
    block = _Block(config)
    return {
        "embed": _Embed(config).init(embed_key, tokens_1x1)["params"],
        "blocks": tuple(
            block.init(jax.random.fold_in(blocks_key, i), x_1x1xD)["params"]
            for i in range(config.num_layers)
        ),
        "head": _Head(config).init(head_key, x_1x1xD, tokens_1x1)["params"],
    }


def split_stage_params(full: dict, layers_per_stage: Sequence[int]) -> list[dict]:
    """Cuts the whole model's parameters into per-stage trees.

    Args:
      full: ``{"embed": ..., "blocks": (block_0, ...), "head": ...}``, as
        returned by `merge_stage_params`.
      layers_per_stage: blocks per stage, summing to the number of blocks.

    Returns:
      One parameter tree per stage, in the layout the stage functions take.
    """
    counts = split_layers(len(full["blocks"]), len(layers_per_stage), layers_per_stage)
    params_list, start = [], 0
    for s, count in enumerate(counts):
        params = {}
        if s == 0:
            params["embed"] = full["embed"]
        if count:
            params["blocks"] = tuple(full["blocks"][start : start + count])
        if s == len(counts) - 1:
            params["head"] = full["head"]
        params_list.append(params)
        start += count
    return params_list


def merge_stage_params(params_list: Sequence[dict]) -> dict:
    """Joins per-stage trees into ``{"embed", "blocks", "head"}``.

    The result does not depend on the split, so it compares (or converts)
    parameters between runs with different `layers_per_stage` or ``mesh.pipe``.
    """
    blocks = []
    for params in params_list:
        blocks.extend(params.get("blocks", ()))
    return {
        "embed": params_list[0]["embed"],
        "blocks": tuple(blocks),
        "head": params_list[-1]["head"],
    }


def make_stages(config: GPTConfig, layers_per_stage: str | Sequence[int]) -> StagedModel:
    """Builds the stage functions, initializer and reference loss of a GPT.

    Args:
      config: the model's sizes.
      layers_per_stage: blocks per stage, e.g. ``(3, 4, 4, 3)`` or
        ``"3,4,4,3"``; the number of entries is the number of stages. Use
        `split_layers` to get a balanced split.

    Returns:
      A `StagedModel`.

    Raises:
      ValueError: `layers_per_stage` does not fit ``config.num_layers`` (see
        `split_layers`).
    """
    counts = _parse_counts(layers_per_stage)
    counts = split_layers(config.num_layers, len(counts), counts)
    num_stages = len(counts)
    stages = tuple(
        functools.partial(_stage, config=config, first=s == 0, last=s == num_stages - 1)
        for s in range(num_stages)
    )

    def init(rng) -> list[dict]:
        return split_stage_params(_init_full(_as_key(rng), config), counts)

    return StagedModel(
        stages=stages,
        init=init,
        loss=functools.partial(_sequential_loss, stages=stages),
        config=config,
        layers_per_stage=counts,
    )


def weight_decay_mask(params: Params) -> Params:
    """True for the leaves weight decay applies to, False for the others.

    Matrices and embeddings (two or more dimensions) decay; LayerNorm scales
    and biases (one dimension) do not. Works on arrays and on
    `jax.ShapeDtypeStruct`s, for one stage's tree or a list of them.
    """
    return jax.tree.map(lambda leaf: len(leaf.shape) >= 2, params)


def num_params(params: Params) -> int:
    """The number of scalars in a parameter tree (arrays or shape structs)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def small_test_model(num_stages: int) -> StagedModel:
    """A very small GPT, one block per stage, that compiles fast.

    For checking schedules and the compiler against `StagedModel.loss`:
    vocabulary 32, L = 8, D = 16, 2 heads, MLP width 32, float32.
    """
    config = GPTConfig(
        vocab_size=32, seq_len=8, num_layers=num_stages, num_heads=2, d_model=16, d_ff=32
    )
    return make_stages(config, (1,) * num_stages)


def example_batch(config: GPTConfig, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A random ``{"tokens", "targets"}`` batch of shape ``[batch_size, seq_len]``."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (batch_size, config.seq_len + 1), dtype=np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
