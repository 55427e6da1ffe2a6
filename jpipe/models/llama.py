"""A Llama-style decoder, cut into pipeline stages like the GPT.

Llama (Touvron et al. 2023; Llama 3, Grattafiori et al. 2024) differs from
GPT-2 (`jpipe.models.gpt`) in four places, all here:

- **RMSNorm** instead of LayerNorm: ``x / rms(x) * scale``, no mean taken
  away and no bias, computed in float32;
- **rotary positions** (RoPE, Su et al. 2021) instead of a learned position
  table: each query and key is rotated by an angle proportional to its
  position, pair by pair of its dimensions, so their dot product depends
  only on the distance between them; the embedding has no position part;
- **SwiGLU** MLP: ``down(silu(gate(x)) * up(x))``, three matrices;
- **grouped-query attention**: ``num_kv_heads`` key/value heads, each shared
  by ``num_heads / num_kv_heads`` query heads (``num_kv_heads = num_heads``
  is ordinary multi-head attention, 1 is multi-query).

No linear layer has a bias, and there is no dropout unless
``LlamaConfig.dropout`` asks for it (then GPT-2's places in each block, from
the batch's per-row keys, as `jpipe.models.gpt` draws them). The stages, the
batch and the parameter layout are the GPT's: the first stage embeds
``inputs["tokens"]``, every boundary carries ``x_BxLxD`` in
``LlamaConfig.dtype``, the last stage returns the mean token cross-entropy
against ``inputs["targets"]`` (a `jpipe.WeightedLoss` with
``inputs["weights"]``), parameters are float32 and ``{"embed", "blocks",
"head"}`` per stage, and initialization does not depend on the split
(`split_flax_model`).

Tensor parallelism (`make_stages(..., tensor_axis=...)`, `tensor_specs`),
Megatron-style as the GPT's: the query, key and value projections and the
gate and up matrices split by columns (whole heads: each device holds
``num_heads / T`` query heads and ``num_kv_heads / T`` key/value heads, the
same groups), the output and down projections by rows, one all-reduce
after attention and one after the MLP. T must divide ``num_kv_heads`` and
``d_ff``. Two options, off by default, split more over the same axis:
``LlamaConfig.vocab_split`` the embedding and the head over the vocabulary
(`jpipe.models.vocab`), ``LlamaConfig.sequence_parallel`` the activations
between the split matmuls over the sequence (`jpipe.models.sequence`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jpipe.models import sequence
from jpipe.models.attention import (
    IMPLEMENTATIONS,
    REMAT_POLICIES,
    attention_over_carry,
    block_remat,
    causal_attention,
    check_choice,
)
from jpipe.models.registry import BuildArgs, register_model
from jpipe.models.staged import (
    StagedModel,
    fold_row_keys,
    row_dropout,
    split_flax_model,
    split_layers,
)
from jpipe.models.vocab import head_loss, local_rows, vocab_embed

Params = Any

_DTYPES = ("float32", "bfloat16", "float16")
_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The sizes of a Llama-style decoder.

    Attributes:
      vocab_size: number of token ids.
      seq_len: the longest sequence L (rotary positions have no table, so
        this only bounds the batches).
      num_layers: decoder blocks, over all stages.
      num_heads: query heads; must divide `d_model`.
      d_model: model width D.
      d_ff: hidden width of each SwiGLU MLP.
      num_kv_heads: key/value heads; must divide `num_heads`; None for
        `num_heads` (multi-head attention).
      rope_theta: the rotary base (10,000 in Llama 2, 500,000 in Llama 3).
      norm_eps: RMSNorm's epsilon.
      dtype: compute and activation dtype, ``"float32"``, ``"bfloat16"`` or
        ``"float16"``; parameters, the norms and the loss are float32.
      scan_layers: run each stage's blocks in one ``nn.scan`` (the same
        weights and model).
      remat_logits: recompute the head's logits in the backward instead of
        keeping them (see `GPTConfig.remat_logits`).
      logit_chunks: compute the head's logits over this many slices of the
        sequence in turn, each recomputed in the backward (see
        `GPTConfig.logit_chunks`); 1, the default, at once.
      dropout: the rate of dropout on each block's attention and MLP outputs
        (drawn from the batch's per-row ``"keys"``, as the GPT's); 0, the
        default and Llama's own, is none.
      attention: how attention is computed: ``"xla"`` (the scores
        materialized, the default), ``"blockwise"`` (flash-style, never
        holding the L x L scores) or ``"cudnn"`` (the GPU's fused kernel);
        see `jpipe.models.attention`.
      attention_block: the tile of ``"blockwise"`` attention (the largest
        divisor of the sequence length not above it).
      remat: per-block rematerialization, ``"none"``, ``"full"``, ``"dots"``
        or ``"attention"`` (see `jpipe.models.attention`).
      vocab_split: with a tensor axis (`make_stages`'s ``tensor_axis``),
        split the embedding and the head over it by vocabulary rows, with a
        cross-entropy that never gathers the logits (`jpipe.models.vocab`);
        T must divide `vocab_size`. The head's weight is then stored
        ``[V, D]`` as the embedding is (``head/unembed/embedding``, with or
        without an axis), so that the two share a bucket of the packed
        parameters. Off (the default), both are whole on every device.
      sequence_parallel: with a tensor axis, keep the activations between
        the split matmuls (norms, residual adds, each block's input) split
        along the sequence over it (`jpipe.models.sequence`): an all-gather
        before the query/key/value and gate/up matmuls and a reduce-scatter
        after the output and down projections instead of the all-reduce. T
        must divide the sequence length (and, without `vocab_split`, the
        sequence length / T must divide by `logit_chunks`). Off by default;
        without a tensor axis it changes nothing.
    """

    vocab_size: int
    seq_len: int
    num_layers: int
    num_heads: int
    d_model: int
    d_ff: int
    num_kv_heads: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"
    scan_layers: bool = False
    remat_logits: bool = False
    logit_chunks: int = 1
    dropout: float = 0.0
    attention: str = "xla"
    attention_block: int = 512
    remat: str = "none"
    vocab_split: bool = False
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        rate = self.dropout
        if (
            not isinstance(rate, numbers.Real)
            or isinstance(rate, bool)
            or not math.isfinite(rate)
            or not 0 <= rate < 1
        ):
            raise ValueError(f"LlamaConfig.dropout must be a number in [0, 1), got {rate!r}")
        object.__setattr__(self, "dropout", float(rate))
        for name in (
            "vocab_size",
            "seq_len",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "d_model",
            "d_ff",
            "logit_chunks",
            "attention_block",
        ):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.d_model % self.num_heads:
            raise ValueError(
                f"LlamaConfig.d_model={self.d_model} must be divisible by "
                f"num_heads={self.num_heads}"
            )
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(
                f"LlamaConfig: the head width d_model / num_heads = "
                f"{self.d_model // self.num_heads} must be even (rotary positions turn pairs)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_kv_heads={self.num_kv_heads} must divide "
                f"num_heads={self.num_heads} (each key/value head serves a group of query heads)"
            )
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("scan_layers", "remat_logits", "vocab_split", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"LlamaConfig.{name} must be True or False, got {getattr(self, name)!r}"
                )
        if self.dtype not in _DTYPES:
            raise ValueError(f"LlamaConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        check_choice("LlamaConfig", "attention", self.attention, IMPLEMENTATIONS)
        check_choice("LlamaConfig", "remat", self.remat, REMAT_POLICIES)
        if self.seq_len % self.logit_chunks:
            raise ValueError(
                f"LlamaConfig.logit_chunks={self.logit_chunks} must divide the sequence length "
                f"seq_len={self.seq_len}"
            )


def _linear(features: int, name: str, dtype, std: float = _INIT_STD):
    return nn.Dense(
        features,
        use_bias=False,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(std),
        name=name,
    )


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * scale``, in float32, returned in `dtype`."""

    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * scale).astype(self.dtype)


def _block_carry(config: LlamaConfig, rows: int, tokens: int, tensor: int = 1) -> tuple:
    """One block's slice carry: its rotated keys and its values for the whole sequence,
    ``rows x tokens x kv_heads x head_dim`` (this device's of a `tensor`-way split)."""
    kv_heads, head_dim = config.num_kv_heads // tensor, config.d_model // config.num_heads
    kv = jax.ShapeDtypeStruct((rows, tokens, kv_heads, head_dim), jnp.dtype(config.dtype))
    return kv, kv


def rotary(x_BxLxHxK: jax.Array, theta: float, start=0) -> jax.Array:
    """Rotates each position's pairs of dimensions by its angles (RoPE).

    Pair ``i`` of a head (dimensions ``i`` and ``i + K/2``) at position ``t``
    turns by ``t * theta^(-2i/K)``; computed in float32. The positions are
    ``start, start + 1, ...`` (`start` may be traced: a slice of a sequence).
    """
    _, length, _, k = x_BxLxHxK.shape
    half = k // 2
    frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2 / k)
    positions = jnp.arange(length, dtype=jnp.float32) + jnp.asarray(start, jnp.float32)
    angles_LxH = positions[:, None] * frequencies
    cos = jnp.cos(angles_LxH)[None, :, None, :]
    sin = jnp.sin(angles_LxH)[None, :, None, :]
    x = x_BxLxHxK.astype(jnp.float32)
    first, second = x[..., :half], x[..., half:]
    turned = jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
    return turned.astype(x_BxLxHxK.dtype)


class _RowSplitLinear(nn.Module):
    """A bias-free linear layer whose input features may be split over a tensor axis.

    Each device multiplies its slice of the features by its rows of the
    kernel and the partial products are summed over the axis (with
    `scatter`, summed and scattered along the sequence: sequence
    parallelism); without an axis it is `_linear`'s layer, with the same
    parameters.
    """

    features: int
    dtype: Any
    std: float
    tensor_axis: str | None = None
    scatter: bool = False

    @nn.compact
    def __call__(self, x):
        kernel = self.param(
            "kernel", nn.initializers.normal(self.std), (x.shape[-1], self.features), jnp.float32
        )
        x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
        y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if self.tensor_axis is None:
            return y
        if self.scatter:
            return sequence.scatter_sum(y, self.tensor_axis)
        return lax.psum(y, self.tensor_axis)


class _Embed(nn.Module):
    """The token embedding (positions come in as rotations, in attention).

    With `tensor_axis`: its rows split over the axis (``vocab_split``), and
    its output this device's slice of the sequence (``sequence_parallel``).
    """

    config: LlamaConfig
    tensor_axis: str | None = None

    @nn.compact
    def __call__(self, inputs: dict, keys: jax.Array | None = None) -> jax.Array:
        del keys  # no dropout on the embedding
        c = self.config
        axis = self.tensor_axis
        split = axis is not None and c.vocab_split
        parallel = axis is not None and c.sequence_parallel
        rows = local_rows(c.vocab_size, axis, "vocab_size") if split else c.vocab_size
        token_VxD = self.param("token", nn.initializers.normal(_INIT_STD), (rows, c.d_model))
        tokens_BxL = inputs["tokens"]
        if split:
            if parallel:
                sequence.local_length(tokens_BxL.shape[1], axis)
            return vocab_embed(
                token_VxD, tokens_BxL, axis, c.dtype, sequence.SEQUENCE if parallel else None
            )
        if parallel:
            tokens_BxL = sequence.shard(tokens_BxL, axis)
        return jnp.take(token_VxD, tokens_BxL, axis=0).astype(c.dtype)


class _Block(nn.Module):
    """``x + attn(norm(x))`` then ``x + swiglu(norm(x))``, its heads split over `tensor_axis`.

    With ``sequence_parallel`` (and an axis) `x` is this device's slice of
    the sequence: the norms and the residual adds run on it, the normed
    slices are gathered before the split matmuls and the row-split products
    reduce-scattered back to slices (`jpipe.models.sequence`).
    """

    config: LlamaConfig
    tensor_axis: str | None = None

    @nn.compact
    def __call__(
        self, x_BxLxD: jax.Array, keys: jax.Array | None = None, carry=None, offset=None
    ) -> jax.Array:
        """The block's output; with `carry` (one slice of a sequence, Seq1F1B: the keys
        and values of the slices before, `attention_over_carry`, and `offset` the
        slice's first token), ``(output, carry)``."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        axis = self.tensor_axis
        parallel = axis is not None and c.sequence_parallel
        if carry is not None and parallel:
            raise ValueError("sequence slices do not take sequence_parallel yet")
        t = 1 if axis is None else lax.axis_size(axis)
        if c.num_kv_heads % t or c.d_ff % t:
            raise ValueError(
                f"a {t}-way tensor axis must divide num_kv_heads={c.num_kv_heads} and d_ff={c.d_ff}"
            )
        # Sequence parallelism: x is a slice; the split matmuls see the whole sequence.
        whole = (lambda y: sequence.gather(y, axis)) if parallel else (lambda y: y)
        drop = (
            (lambda y, site: sequence.dropout(y, _site(keys, site), c.dropout, axis))
            if parallel
            else (lambda y, site: row_dropout(y, _site(keys, site), c.dropout))
        )
        b, length, d = x_BxLxD.shape
        length *= t if parallel else 1
        k = c.d_model // c.num_heads
        heads, kv_heads = c.num_heads // t, c.num_kv_heads // t  # this device's
        residual_std = _INIT_STD / math.sqrt(2 * c.num_layers)

        y_BxLxD = whole(RMSNorm(c.norm_eps, dtype, name="norm_attn")(x_BxLxD))
        q = _linear(heads * k, "q", dtype)(y_BxLxD).reshape(b, length, heads, k)
        kk = _linear(kv_heads * k, "k", dtype)(y_BxLxD).reshape(b, length, kv_heads, k)
        v = _linear(kv_heads * k, "v", dtype)(y_BxLxD).reshape(b, length, kv_heads, k)
        start = 0 if carry is None else offset
        q, kk = rotary(q, c.rope_theta, start), rotary(kk, c.rope_theta, start)
        # Fewer key/value heads than query heads: grouped-query attention.
        if carry is None:
            attn_BxLxHxK = causal_attention(q, kk, v, c.attention, c.attention_block)
        else:
            attn_BxLxHxK, carry = attention_over_carry(
                q, kk, v, carry, offset, c.attention, c.attention_block
            )
        y_BxLxD = _RowSplitLinear(d, dtype, residual_std, axis, parallel, name="attn_out")(
            attn_BxLxHxK.reshape(b, length, heads * k)
        )
        x_BxLxD = x_BxLxD + drop(y_BxLxD, 0)

        y_BxLxD = whole(RMSNorm(c.norm_eps, dtype, name="norm_mlp")(x_BxLxD))
        gate_BxLxF = _linear(c.d_ff // t, "gate", dtype)(y_BxLxD)
        up_BxLxF = _linear(c.d_ff // t, "up", dtype)(y_BxLxD)
        y_BxLxD = _RowSplitLinear(d, dtype, residual_std, axis, parallel, name="down")(
            nn.silu(gate_BxLxF) * up_BxLxF
        )
        if carry is not None:
            return x_BxLxD + drop(y_BxLxD, 1), carry
        return x_BxLxD + drop(y_BxLxD, 1)


def _site(keys: jax.Array | None, site: int) -> jax.Array | None:
    """A block's row keys for one of its dropout sites."""
    return None if keys is None else fold_row_keys(keys, site)


class _Head(nn.Module):
    """Final RMSNorm, untied head and mean token cross-entropy.

    With `tensor_axis`: ``vocab_split`` splits the head's vocabulary rows and the
    cross-entropy over the axis; under ``sequence_parallel`` `x` is a slice
    of the sequence, normed as it is, then gathered for the vocabulary-split
    head, or, with the head whole, its tokens' losses computed on the slice
    and their sums added over the axis.
    """

    config: LlamaConfig
    tensor_axis: str | None = None

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, inputs: dict, keys=None) -> jax.Array:
        del keys
        c = self.config
        dtype = jnp.dtype(c.dtype)
        y_BxLxD = RMSNorm(c.norm_eps, dtype, name="norm_final")(x_BxLxD)
        return head_loss(self, c, y_BxLxD, inputs, self.tensor_axis, _linear)


def make_stages(
    config: LlamaConfig, layers_per_stage: str | Sequence[int], tensor_axis: str | None = None
) -> StagedModel:
    """The stage functions, initializer and reference loss of a Llama-style decoder.

    Args:
      config: the model's sizes.
      layers_per_stage: blocks per stage, e.g. ``(3, 4, 4, 3)`` or ``"3,4,4,3"``.
      tensor_axis: a mesh axis to split each block over (see the module
        docstring); `init` and `loss` stay the whole model's, the
        reference, and `StagedModel.specs` says how to pack.

    Returns:
      A `StagedModel`.
    """

    def split(axis):
        return split_flax_model(
            _Embed(config, axis),
            block_remat(_Block, config.remat, scanned=config.scan_layers)(config, axis),
            _Head(config, axis),
            num_layers=config.num_layers,
            layers_per_stage=layers_per_stage,
            scan_layers=config.scan_layers,
            keys="keys" if config.dropout else None,
            block_carry=functools.partial(_block_carry, config),
            example_inputs={  # numpy: making them compiles nothing
                "tokens": np.zeros((1, 1), np.int32),
                "targets": np.zeros((1, 1), np.int32),
            },
        )

    whole = split(None)
    if tensor_axis is None:
        return whole
    stages = split(tensor_axis).stages
    if config.sequence_parallel:
        stages = sequence.at_stage_boundaries(stages, tensor_axis)
    return whole._replace(
        stages=stages,
        specs=lambda params: tensor_specs(config, params, tensor_axis),
    )


# Megatron-style splits of a block's matrices: columns of the first matrix
# of attention and of the MLP, rows of the second.
_BLOCK_SPLITS = {
    ("q", "kernel"): (None, "T"),
    ("k", "kernel"): (None, "T"),
    ("v", "kernel"): (None, "T"),
    ("attn_out", "kernel"): ("T", None),
    ("gate", "kernel"): (None, "T"),
    ("up", "kernel"): (None, "T"),
    ("down", "kernel"): ("T", None),
}


# With ``vocab_split``: the embedding and the head, both stored [V, D], by vocabulary rows.
VOCAB_SPLITS = {
    ("embed", "token"): ("T", None),
    ("head", "unembed", "embedding"): ("T", None),  # stored [V, D] (jpipe.models.vocab)
}


def tensor_specs(config: LlamaConfig, params_list: Sequence[Params], axis: str = "tensor") -> list:
    """How `make_stages(..., tensor_axis=axis)` splits each parameter, for `Pipeline.pack`.

    The norms are whole on every device of the axis, and so are the
    embedding and the head unless ``config.vocab_split``.
    """

    def spec(path, leaf):
        names = tuple(getattr(k, "key", None) for k in path)
        if names[0] == "blocks":
            split = _BLOCK_SPLITS.get(names[-2:])
            stacked = (None,) * int(config.scan_layers)
        else:
            split = VOCAB_SPLITS.get(names) if config.vocab_split else None
            stacked = ()
        if split is None:
            return P()
        return P(*stacked, *(axis if e == "T" else None for e in split))

    return [jax.tree_util.tree_map_with_path(spec, p) for p in params_list]


@register_model("llama", LlamaConfig)
def build(args: BuildArgs) -> StagedModel:
    """The trainer's ``config.model.name="llama"``."""
    c = args.config
    layers = split_layers(c.num_layers, args.num_stages, args.layers_per_stage or None)
    return make_stages(c, layers, tensor_axis=args.tensor_axis)
