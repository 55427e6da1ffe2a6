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
``{"tokens": int32[B, L], "targets": int32[B, L]}``, and optionally
``"weights": float[B, L]`` (0 on padding): the last stage then returns a
`jpipe.WeightedLoss` (the weighted sum of token losses and the sum of the
weights), so the pipeline's loss is the weighted mean over the whole batch.

Dropout (``GPTConfig.dropout > 0``) is GPT-2's on the embeddings and on each
block's attention and MLP outputs before they join the residual stream (not
on the attention probabilities: the attention stays one fused
``dot_product_attention``). It draws from ``inputs["keys"]``, one key per row
(`jpipe.models.row_keys`, ``uint32[B, 2]``), with the layer's and the site's
numbers folded in, so each row's masks are the same whatever the split into
stages, microbatches and data shards. A batch without ``"keys"`` runs without
dropout (evaluation); with ``dropout=0`` the keys are ignored.

A stage's parameters are a dict with ``"embed"`` (first stage only), ``"blocks"``
(a tuple, one entry per block, absent when the stage has none) and ``"head"``
(last stage only). Parameters are float32; ``GPTConfig.dtype`` is the compute
dtype.

Initialization does not depend on how the layers are split: the embedding,
block ``i`` and the head each draw from a key folded from the model key and
their own global index, so ``pipe=4`` and ``pipe=1`` start from identical
weights and `merge_stage_params` of either gives the same tree. The cut itself
is `jpipe.models.split_flax_model`'s, as for any embed/blocks/head model.
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

Params = Any  # a pytree of arrays

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
      scan_layers: run each stage's blocks in one ``nn.scan`` (its
        ``"blocks"`` are then stacked over its blocks); the same weights and
        the same model as the default, unrolled blocks.
      remat_logits: recompute the head's logits in the backward instead of
        keeping them for it (``nn.remat`` over the unembedding and the
        cross-entropy). With a real vocabulary the logits dwarf everything
        else a microbatch keeps (GPT-2 small at 4 x 1,024 tokens: 3.2 GiB of
        the head's residuals, against 6 MiB with this), for one more head
        matmul per microbatch. The same loss and gradients.
      logit_chunks: compute the head's logits and cross-entropy over this
        many slices of the sequence in turn (a scan), each recomputed in its
        backward, so that the head's working memory holds one slice's
        logits, not the whole microbatch's (GPT-2 small at 4 x 1,024 tokens:
        the float32 logits and their gradient are 0.77 GiB each). 1, the
        default, computes them at once; above 1 the logits are recomputed
        (as with `remat_logits`), and the sequence length must divide by it.
        The same loss; the gradients the same up to float32 summation order.
      dropout: the dropout rate, in [0, 1), applied where the batch carries
        per-row ``"keys"`` (see the module docstring); 0 leaves the model
        deterministic and as before.
      attention: how attention is computed: ``"xla"`` (the scores
        materialized, the default), ``"blockwise"`` (flash-style, never
        holding the L x L scores) or ``"cudnn"`` (the GPU's fused kernel);
        see `jpipe.models.attention`.
      attention_block: the tile of ``"blockwise"`` attention (the largest
        divisor of the sequence length not above it).
      remat: per-block rematerialization, ``"none"``, ``"full"``, ``"dots"``
        or ``"attention"`` (see `jpipe.models.attention`).
      vocab_split: with a tensor axis (`make_stages`'s ``tensor_axis``),
        split the token embedding and the head over it by vocabulary rows,
        with a cross-entropy that never gathers the logits
        (`jpipe.models.vocab`); T must divide `vocab_size`. The head's
        weight is then stored ``[V, D]`` as the embedding is
        (``head/unembed/embedding``, with or without an axis). The position
        table stays whole. Off by default.
      sequence_parallel: with a tensor axis, keep the activations between
        the split matmuls (LayerNorms, residual adds, dropouts, each block's
        input) split along the sequence over it (`jpipe.models.sequence`):
        an all-gather before the qkv and MLP-in matmuls and a reduce-scatter
        after the attention and MLP output projections instead of the
        all-reduce. T must divide the sequence length (and, without
        `vocab_split`, the sequence length / T must divide by
        `logit_chunks`). Off by default; without a tensor axis it changes
        nothing.
    """

    vocab_size: int
    seq_len: int
    num_layers: int
    num_heads: int
    d_model: int
    d_ff: int
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
        for name in (
            "vocab_size",
            "seq_len",
            "num_layers",
            "num_heads",
            "d_model",
            "d_ff",
            "logit_chunks",
            "attention_block",
        ):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.d_model % self.num_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by num_heads={self.num_heads}"
            )
        for name in ("scan_layers", "remat_logits", "vocab_split", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}"
                )
        rate = self.dropout
        if (
            not isinstance(rate, numbers.Real)
            or isinstance(rate, bool)
            or not math.isfinite(rate)
            or not 0 <= rate < 1
        ):
            raise ValueError(f"GPTConfig.dropout must be a number in [0, 1), got {rate!r}")
        object.__setattr__(self, "dropout", float(rate))
        if self.dtype not in _DTYPES:
            raise ValueError(f"GPTConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        check_choice("GPTConfig", "attention", self.attention, IMPLEMENTATIONS)
        check_choice("GPTConfig", "remat", self.remat, REMAT_POLICIES)
        if self.seq_len % self.logit_chunks:
            raise ValueError(
                f"GPTConfig.logit_chunks={self.logit_chunks} must divide the sequence length "
                f"seq_len={self.seq_len}"
            )


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
    """Token plus learned position embedding.

    With `tensor_axis`: the token rows split over the axis (``vocab_split``),
    and the output this device's slice of the sequence (``sequence_parallel``).
    """

    config: GPTConfig
    tensor_axis: str | None = None

    @nn.compact
    def __call__(self, inputs: dict, keys: jax.Array | None = None) -> jax.Array:
        c = self.config
        axis = self.tensor_axis
        split = axis is not None and c.vocab_split
        parallel = axis is not None and c.sequence_parallel
        tokens_BxL = inputs["tokens"]
        rows = local_rows(c.vocab_size, axis, "vocab_size") if split else c.vocab_size
        token_VxD = self.param("token", nn.initializers.normal(_INIT_STD), (rows, c.d_model))
        position_LxD = self.param(
            "position", nn.initializers.normal(_INIT_STD), (c.seq_len, c.d_model)
        )
        length = tokens_BxL.shape[1]
        if "positions" in inputs:  # a slice of its sequence (Seq1F1B): its own positions
            if parallel:
                raise ValueError("sequence slices do not take sequence_parallel yet")
            position_LxD = jnp.take(position_LxD, inputs["positions"][0], axis=0)
        else:
            position_LxD = position_LxD[:length]
        if parallel:  # this device's positions
            position_LxD = sequence.shard(position_LxD[None], axis)[0]
        if split:  # float32 sums (one nonzero term each), as the whole lookup
            scatter = sequence.SEQUENCE if parallel else None
            x_BxLxD = vocab_embed(token_VxD, tokens_BxL, axis, None, scatter) + position_LxD
        else:
            if parallel:
                tokens_BxL = sequence.shard(tokens_BxL, axis)
            x_BxLxD = jnp.take(token_VxD, tokens_BxL, axis=0) + position_LxD
        if parallel:
            return sequence.dropout(x_BxLxD.astype(c.dtype), keys, c.dropout, axis)
        return row_dropout(x_BxLxD.astype(c.dtype), keys, c.dropout)


class _RowSplitDense(nn.Module):
    """`nn.Dense` whose input features may be split over a tensor axis.

    Each device multiplies its slice of the features by its rows of the
    kernel; the partial products are summed over the axis before the bias
    (which is not split) is added. Without an axis it computes what
    `_dense`'s layer does, with the same parameters.
    """

    features: int
    dtype: Any
    std: float
    tensor_axis: str | None = None
    scatter: bool = False  # sum and scatter along the sequence (sequence parallelism)

    @nn.compact
    def __call__(self, x):
        kernel = self.param(
            "kernel", nn.initializers.normal(self.std), (x.shape[-1], self.features), jnp.float32
        )
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if self.tensor_axis is not None and self.scatter:
            y = sequence.scatter_sum(y, self.tensor_axis)
        elif self.tensor_axis is not None:
            y = lax.psum(y, self.tensor_axis)
        return y + bias


class _Block(nn.Module):
    """Pre-norm block: ``x + drop(attn(ln(x)))`` then ``x + drop(mlp(ln(x)))``.

    With `tensor_axis`, it runs Megatron-style on its device's slice of the
    weights (`tensor_specs`): its heads of attention and its slice of the
    MLP's hidden width, with one all-reduce over the axis after each. With
    ``sequence_parallel`` `x` is this device's slice of the sequence, gathered
    before each split matmul and reduce-scattered after it
    (`jpipe.models.sequence`).
    """

    config: GPTConfig
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
        if c.num_heads % t or c.d_ff % t:
            raise ValueError(
                f"a {t}-way tensor axis must divide num_heads={c.num_heads} and d_ff={c.d_ff}"
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
        h, k = c.num_heads // t, c.d_model // c.num_heads  # this device's heads

        # GPT-2 scales the init of the projections into the residual stream so
        # that its variance does not grow with depth.
        residual_std = _INIT_STD / math.sqrt(2 * c.num_layers)
        y_BxLxD = whole(nn.LayerNorm(dtype=dtype, name="ln_attn")(x_BxLxD))
        # Heads major, then (q, k, v): split by columns over the tensor axis,
        # each device holds whole heads.
        qkv_BxLxHx3xK = _dense(3 * h * k, "qkv", dtype)(y_BxLxD).reshape(b, length, h, 3, k)
        q, kk, v = (qkv_BxLxHx3xK[:, :, :, i] for i in range(3))
        if carry is None:
            attn_BxLxHxK = causal_attention(q, kk, v, c.attention, c.attention_block)
        else:
            attn_BxLxHxK, carry = attention_over_carry(
                q, kk, v, carry, offset, c.attention, c.attention_block
            )
        y_BxLxD = _RowSplitDense(d, dtype, residual_std, axis, parallel, name="attn_out")(
            attn_BxLxHxK.reshape(b, length, h * k)
        )
        x_BxLxD = x_BxLxD + drop(y_BxLxD, 0)

        y_BxLxD = whole(nn.LayerNorm(dtype=dtype, name="ln_mlp")(x_BxLxD))
        y_BxLxF = nn.gelu(_dense(c.d_ff // t, "mlp_in", dtype)(y_BxLxD))
        y_BxLxD = _RowSplitDense(d, dtype, residual_std, axis, parallel, name="mlp_out")(y_BxLxF)
        if carry is not None:
            return x_BxLxD + drop(y_BxLxD, 1), carry
        return x_BxLxD + drop(y_BxLxD, 1)


def _block_carry(config: GPTConfig, rows: int, tokens: int, tensor: int = 1) -> tuple:
    """One block's slice carry: its keys and values for the whole sequence, ``rows x
    tokens x heads x head_dim`` (this device's heads of a `tensor`-way split)."""
    heads, head_dim = config.num_heads // tensor, config.d_model // config.num_heads
    kv = jax.ShapeDtypeStruct((rows, tokens, heads, head_dim), jnp.dtype(config.dtype))
    return kv, kv


def _site(keys: jax.Array | None, site: int) -> jax.Array | None:
    """A block's row keys for one of its dropout sites."""
    return None if keys is None else fold_row_keys(keys, site)


class _Head(nn.Module):
    """Final LayerNorm, untied head and mean token cross-entropy.

    With ``"weights"`` in the inputs (per-token weights, e.g. 0 on padding)
    a `jpipe.WeightedLoss`. With `tensor_axis`: ``vocab_split`` and
    ``sequence_parallel`` as in `jpipe.models.vocab.head_loss`.
    """

    config: GPTConfig
    tensor_axis: str | None = None

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, inputs: dict, keys=None) -> jax.Array:
        del keys  # GPT-2 has no dropout after the last block
        c = self.config
        dtype = jnp.dtype(c.dtype)
        y_BxLxD = nn.LayerNorm(dtype=dtype, name="ln_final")(x_BxLxD)
        return head_loss(self, c, y_BxLxD, inputs, self.tensor_axis, _unembed)


def _unembed(features: int, name: str, dtype):
    return _dense(features, name, dtype, use_bias=False)


def make_stages(
    config: GPTConfig, layers_per_stage: str | Sequence[int], tensor_axis: str | None = None
) -> StagedModel:
    """Builds the stage functions, initializer and reference loss of a GPT.

    Args:
      config: the model's sizes.
      layers_per_stage: blocks per stage, e.g. ``(3, 4, 4, 3)`` or
        ``"3,4,4,3"``; the number of entries is the number of stages. Use
        `split_layers` to get a balanced split.
      tensor_axis: a mesh axis to split each block over, Megatron-style: the
        stages then run on each device's slice of the weights and sum over
        the axis themselves, so they run only inside the pipeline (pack the
        parameters with `tensor_specs`). `init` and `loss` stay those of the
        whole model, the reference the pipeline is checked against.
        `GPTConfig.vocab_split` and `GPTConfig.sequence_parallel` split
        more over the same axis (off by default).

    Returns:
      A `StagedModel`.

    Raises:
      ValueError: `layers_per_stage` does not fit ``config.num_layers`` (see
        `split_layers`).
    """
    whole = _split(config, layers_per_stage, None)
    if tensor_axis is None:
        return whole
    stages = _split(config, layers_per_stage, tensor_axis).stages
    if config.sequence_parallel:
        stages = sequence.at_stage_boundaries(stages, tensor_axis)
    return whole._replace(stages=stages)


def _split(config: GPTConfig, layers_per_stage, tensor_axis: str | None) -> StagedModel:
    return split_flax_model(
        _Embed(config, tensor_axis),
        block_remat(_Block, config.remat, scanned=config.scan_layers)(config, tensor_axis),
        _Head(config, tensor_axis),
        num_layers=config.num_layers,
        layers_per_stage=layers_per_stage,
        scan_layers=config.scan_layers,
        keys="keys" if config.dropout else None,
        block_carry=functools.partial(_block_carry, config),
        # Length 1: the parameter shapes do not depend on L.
        example_inputs={  # numpy: making them compiles nothing (refusals come first)
            "tokens": np.zeros((1, 1), np.int32),
            "targets": np.zeros((1, 1), np.int32),
        },
    )


# How `tensor_specs` splits each array of a block, Megatron-style: the first
# matmul of attention and of the MLP by columns (whole heads, slices of the
# hidden width), the second by rows, so each needs one all-reduce after it.
_BLOCK_SPLITS = {
    ("qkv", "kernel"): (None, "T"),
    ("qkv", "bias"): ("T",),
    ("attn_out", "kernel"): ("T", None),
    ("mlp_in", "kernel"): (None, "T"),
    ("mlp_in", "bias"): ("T",),
    ("mlp_out", "kernel"): ("T", None),
}


# With ``vocab_split``: the token embedding and the head, both stored [V, D], by vocabulary rows.
VOCAB_SPLITS = {
    ("embed", "token"): ("T", None),
    ("head", "unembed", "embedding"): ("T", None),  # stored [V, D] (jpipe.models.vocab)
}


def tensor_specs(config: GPTConfig, params_list: Sequence[Params], axis: str = "tensor") -> list:
    """How `make_stages(..., tensor_axis=axis)` splits each parameter, for `Pipeline.pack`.

    Attention is split by heads (the qkv projection by columns, its output
    projection by rows) and the MLP by its hidden width (in by columns, out
    by rows). LayerNorms, the position table and the biases added after a
    row split are whole on every device of the axis, which computes them
    alike; so are the token embedding and the head unless
    ``config.vocab_split`` (then both by vocabulary rows).

    Args:
      config: the model's sizes.
      params_list: one parameter tree per stage (arrays or shape structs).
      axis: the mesh axis to split over.

    Returns:
      One tree per stage like its parameters, a `PartitionSpec` per array.
    """

    def spec(path, leaf):
        names = tuple(getattr(k, "key", None) for k in path)
        if names[0] == "blocks":
            split = _BLOCK_SPLITS.get(names[-2:])
            stacked = (None,) * int(config.scan_layers)  # the leading axis over blocks
        else:
            split = VOCAB_SPLITS.get(names) if config.vocab_split else None
            stacked = ()
        if split is None:
            return P()
        return P(*stacked, *(axis if e == "T" else None for e in split))

    return [jax.tree_util.tree_map_with_path(spec, p) for p in params_list]


@register_model("gpt", GPTConfig)
def build(args: BuildArgs) -> StagedModel:
    """The trainer's ``config.model.name="gpt"``: `make_stages` with `tensor_specs`."""
    c = args.config
    layers = split_layers(c.num_layers, args.num_stages, args.layers_per_stage or None)
    model = make_stages(c, layers, tensor_axis=args.tensor_axis)
    if args.tensor_axis is None:
        return model
    return model._replace(specs=lambda params: tensor_specs(c, params, args.tensor_axis))


def weight_decay_mask(params: Params) -> Params:
    """True for the leaves weight decay applies to, False for the others.

    Matrices and embeddings (two or more dimensions) decay; LayerNorm scales
    and biases (one dimension) do not. Works on arrays and on
    `jax.ShapeDtypeStruct`s, for one stage's tree or a list of them. Stacked
    blocks (``scan_layers``) are judged per block, without the stacking axis.
    """
    if type(params) in (list, tuple):
        return type(params)(weight_decay_mask(p) for p in params)
    if isinstance(params, dict) and isinstance(params.get("blocks"), dict):
        return {
            k: jax.tree.map(lambda leaf, n=int(k == "blocks"): len(leaf.shape) - n >= 2, v)
            for k, v in params.items()
        }
    return jax.tree.map(lambda leaf: len(leaf.shape) >= 2, params)


def num_params(params: Params) -> int:
    """The number of scalars in a parameter tree (arrays or shape structs)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def example_batch(config: GPTConfig, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A random ``{"tokens", "targets"}`` batch of shape ``[batch_size, seq_len]``."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, (batch_size, config.seq_len + 1), dtype=np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
