"""Causal attention without the L x L scores, and per-block rematerialization.

At real sizes the materialized attention scores are most of what a pipeline
stage keeps for its backward: Llama-3-8B at 4,096 tokens holds
``heads x L x L`` float32 scores and probabilities per layer per microbatch,
about 1.3 GB of the 1.7 GB a layer keeps at tensor 2 (Korthikanti et al.
2022, the ``5·a·s²·b/t`` term). Two model options remove them:

**The attention's implementation** (`causal_attention`, ``attention=`` in
`GPTConfig` and `LlamaConfig`):

- ``"xla"``: ``jax.nn.dot_product_attention`` as XLA lowers it, the scores
  materialized (the default, and what every earlier figure used);
- ``"blockwise"``: flash-style attention in plain JAX (Dao et al. 2022;
  Rabe and Staats 2021), with its own backward. The queries run in blocks
  of ``block`` rows; each walks the key blocks up to the diagonal, keeping a
  running maximum, a running sum and an unnormalised output (the online
  softmax), so the working memory is one ``block x block`` tile per head and
  the backward keeps only ``q, k, v``, the output and one log-sum-exp per
  query. The backward recomputes each tile's probabilities from the
  log-sum-exp, in two walks: one over the key blocks of each query block
  for the queries' gradient, one over the query blocks of each key block
  for the keys' and values' (FlashAttention-2's order). Key blocks above the
  diagonal are never visited, so causal attention does half the work of the
  masked dense product. Runs anywhere JAX runs; on CPU it is the one that
  fits.
- ``"cudnn"``: ``jax.nn.dot_product_attention(..., implementation="cudnn")``,
  the platform's fused kernel, on NVIDIA GPUs only (elsewhere JAX refuses it
  when the step is traced).

Grouped-query attention (fewer key/value heads than query heads) is native
to all three: each key/value head serves ``H / G`` query heads.

**Per-block rematerialization** (`block_remat`, ``remat=`` in the configs):
which of a block's values its backward keeps, as MaxText's ``remat_policy``
and torchtitan's activation checkpointing name them:

- ``"none"``: everything the backward reads is kept (the default);
- ``"full"``: nothing but the block's input; the backward runs the block's
  forward again;
- ``"dots"``: the outputs of the matrix products with no batch dimension
  (the projections and the MLP's matrices) are kept, the rest (norms,
  activations, attention's inner products) recomputed;
- ``"attention"``: only the attention's output is kept (named
  ``attention_out``); everything else is recomputed, the attention's own
  values included (the scores under ``"xla"``, the whole blockwise forward
  under ``"blockwise"``, whose residuals are not named). It spares the
  recomputation of what follows the attention, not of the attention itself:
  on Llama-3-8B it holds nearly what ``"full"`` holds (`docs/scale.md`).

All are the same function: the loss and gradients are those of the
unrematerialized block (up to float32 summation order for ``"blockwise"``,
which sums the softmax in another order).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

IMPLEMENTATIONS = ("xla", "blockwise", "cudnn")
REMAT_POLICIES = ("none", "full", "dots", "attention")
ATTENTION_NAME = "attention_out"  # the name `"attention"` remat keeps


def check_choice(owner: str, field: str, value, choices) -> None:
    """Refuses a config value that is not one of `choices`, in one line."""
    if value not in choices:
        raise ValueError(f"{owner}.{field} must be one of {choices}, got {value!r}")


def causal_attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    implementation: str = "xla",
    block: int = 512,
) -> jax.Array:
    """Causal softmax attention, ``softmax(q k^T / sqrt(K)) v`` over earlier positions.

    Args:
      q_BxLxHxK: queries, H heads of width K.
      k_BxLxGxK, v_BxLxGxK: keys and values, G heads; G divides H.
      implementation: ``"xla"``, ``"blockwise"`` or ``"cudnn"`` (module docstring).
      block: the tile size of ``"blockwise"``; the largest divisor of L not
        above it is used.

    Returns:
      The attention output, ``B x L x H x K``, in the queries' dtype.
    """
    check_choice("attention", "implementation", implementation, IMPLEMENTATIONS)
    first = jnp.zeros((), jnp.int32)
    out = (
        _blockwise(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, _tile(q_BxLxHxK.shape[1], block), first)
        if implementation == "blockwise"
        else jax.nn.dot_product_attention(
            q_BxLxHxK,
            k_BxLxGxK,
            v_BxLxGxK,
            is_causal=True,
            implementation="cudnn" if implementation == "cudnn" else None,
        )
    )
    return checkpoint_name(out, ATTENTION_NAME)


def attention_over_carry(
    q_BxTxHxK: jax.Array,
    k_BxTxGxK: jax.Array,
    v_BxTxGxK: jax.Array,
    carry: tuple[jax.Array, jax.Array],
    offset,
    implementation: str = "xla",
    block: int = 512,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Causal attention of one slice of a sequence (Seq1F1B's unit) over the keys and
    values of the slices before it, which `carry` holds.

    The carry is the whole sequence's key and value buffers, ``B x L x G x K`` each
    (zeros where no slice has written yet). The slice of T tokens starting at token
    `offset` writes its keys and values there and attends to every position up to
    its own: the carry grows from slice to slice, and what it returns goes to the
    next slice. Its gradient flows back the same way: the cotangent of the carry a
    slice returns holds what later slices' queries asked of its keys and values, and
    the one it hands the slice before it holds the rest. Chained over a sequence's
    slices it is `causal_attention` of the whole sequence (tests/test_slices.py),
    at T x L scores a slice (the masked positions past the slice are computed and
    dropped; a kernel that stops at the diagonal is the GPU's business).

    Args:
      q_BxTxHxK, k_BxTxGxK, v_BxTxGxK: the slice's queries, keys and values.
      carry: ``(keys, values)`` of the whole sequence, ``B x L x G x K``.
      offset: the slice's first token (an int, or a traced int scalar).
      implementation: ``"xla"`` (the masked dense product, ``T x L`` scores),
        ``"blockwise"`` (the flash-style walk of `causal_attention`, its
        queries starting at the slice's tile: ``block x block`` tiles up to
        the diagonal, nothing past it; `offset` must be a multiple of the
        tile, the largest divisor of T not above `block`, as even slices'
        offsets are) or ``"cudnn"`` (the masked product in cuDNN).
      block: the tile size of ``"blockwise"``.

    Returns:
      ``(out, carry)``: the slice's output ``B x T x H x K`` and the carry with the
      slice's keys and values written in.
    """
    keys, values = carry
    # Every index derived from `offset`, so that under `jax.shard_map` all of them vary
    # over the same axes as it (a literal 0 beside a varying offset fails the
    # transpose's check of varying axes).
    offset = jnp.asarray(offset, jnp.int32)
    at = (offset * 0, offset, offset * 0, offset * 0)
    keys = lax.dynamic_update_slice(keys, k_BxTxGxK.astype(keys.dtype), at)
    values = lax.dynamic_update_slice(values, v_BxTxGxK.astype(values.dtype), at)
    check_choice("attention", "implementation", implementation, IMPLEMENTATIONS)
    t, length = q_BxTxHxK.shape[1], keys.shape[1]
    if implementation == "blockwise":
        tile = _tile(t, block)
        out = _blockwise(q_BxTxHxK, keys, values, tile, jnp.asarray(offset, jnp.int32) // tile)
    else:
        seen = jnp.arange(length)[None, :] <= offset + jnp.arange(t)[:, None]  # T x L
        out = jax.nn.dot_product_attention(
            q_BxTxHxK,
            keys,
            values,
            mask=seen[None, None],
            implementation="cudnn" if implementation == "cudnn" else None,
        )
    return checkpoint_name(out, ATTENTION_NAME), (keys, values)


def block_remat(module_cls, policy: str, *, scanned: bool = False):
    """`module_cls` rematerialized by `policy` (module docstring); itself for ``"none"``.

    `scanned`: the block runs inside ``nn.scan``, where CSE cannot merge the
    recomputation with the forward, so JAX's guard against it is left off
    (as Flax advises).
    """
    check_choice("remat", "policy", policy, REMAT_POLICIES)
    if policy == "none":
        return module_cls
    policies = jax.checkpoint_policies
    chosen = {
        "full": policies.nothing_saveable,
        "dots": policies.dots_with_no_batch_dims_saveable,
        "attention": policies.save_only_these_names(ATTENTION_NAME),
    }[policy]
    import flax.linen as nn  # noqa: PLC0415 (only the models use linen)

    return nn.remat(module_cls, policy=chosen, prevent_cse=not scanned)


def _tile(length: int, block: int) -> int:
    """The largest divisor of `length` that is at most `block` (at least 1)."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"attention_block must be a positive int, got {block!r}")
    return max(d for d in range(1, min(length, block) + 1) if length % d == 0)


def _varying_like(template: jax.Array, value: jax.Array) -> jax.Array:
    """`value`, made varying over the manual mesh axes `template` varies over.

    A loop's carry made inside a ``shard_map`` body must vary over the same
    axes as what the loop adds into it; arithmetic with the template does
    that on every JAX version, without naming the axes.
    """
    return value + jnp.zeros((), value.dtype) * template.reshape(-1)[0].astype(value.dtype)


def _blocks(x_BxLx___, tile: int) -> jax.Array:
    """``B x L x ...`` as ``L/tile x B x tile x ...`` (block index first)."""
    b, length = x_BxLx___.shape[:2]
    x = x_BxLx___.reshape(b, length // tile, tile, *x_BxLx___.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _unblocks(x_NxBxTx___) -> jax.Array:
    """The inverse of `_blocks`."""
    n, b, t = x_NxBxTx___.shape[:3]
    return jnp.moveaxis(x_NxBxTx___, 0, 1).reshape(b, n * t, *x_NxBxTx___.shape[3:])


def _grouped(q_BxLxHxK, groups: int):
    """Queries as ``B x L x G x R x K``: R query heads per key/value head."""
    b, length, h, k = q_BxLxHxK.shape
    return q_BxLxHxK.reshape(b, length, groups, h // groups, k)


def _scores(q_BxTxGxRxK, k_BxSxGxK, i, j, scale):
    """One tile's scaled scores ``B x G x R x T x S`` in float32, causal on the diagonal."""
    s = jnp.einsum("btgrk,bsgk->bgrts", q_BxTxGxRxK, k_BxSxGxK, preferred_element_type=jnp.float32)
    t = q_BxTxGxRxK.shape[1]
    below = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    keep = jnp.logical_or(j < i, below)  # only the diagonal tile is masked
    return jnp.where(keep, s * scale, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blockwise(q, k, v, tile, first):
    return _blockwise_forward(q, k, v, tile, first)[0]


def _blockwise_forward(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, tile, first):
    """Output and per-query log-sum-exp, one query tile at a time (online softmax).

    The queries are tiles ``first, first + 1, ...`` of the keys' positions
    (`first` an int32 scalar, maybe traced: 0 for a whole sequence, a slice's
    first tile for `attention_over_carry`); each walks the key tiles up to its
    own.
    """
    groups = k_BxSxGxK.shape[2]
    width = q_BxLxHxK.shape[-1]
    scale = 1.0 / math.sqrt(width)
    qs = _blocks(_grouped(q_BxLxHxK, groups), tile)  # N x B x T x G x R x K
    ks, vs = _blocks(k_BxSxGxK, tile), _blocks(v_BxSxGxK, tile)  # N' x B x T x G x K

    def query_tile(args):
        i, q_i = args  # i: the tile's place among the key tiles
        b, t, g, r, _ = q_i.shape
        zero = _varying_like(q_i, jnp.zeros((b, g, r, t), jnp.float32))
        start = (
            zero - jnp.inf,
            zero,
            _varying_like(q_i, jnp.zeros((b, g, r, t, width), jnp.float32)),
        )

        def key_tile(j, carry):
            running_max, total, out = carry
            s = _scores(q_i, ks[j], i, j, scale)
            new_max = jnp.maximum(running_max, s.max(-1))
            p = jnp.exp(s - new_max[..., None])
            fade = jnp.exp(running_max - new_max)
            total = total * fade + p.sum(-1)
            pv = jnp.einsum("bgrts,bsgk->bgrtk", p, vs[j].astype(jnp.float32))
            return new_max, total, out * fade[..., None] + pv

        running_max, total, out = lax.fori_loop(0, i + 1, key_tile, start)
        out = out / total[..., None]
        lse = running_max + jnp.log(total)  # B x G x R x T
        return jnp.einsum("bgrtk->btgrk", out), lse

    out_N, lse_N = lax.map(query_tile, (first + jnp.arange(qs.shape[0]), qs))
    out = _unblocks(out_N).reshape(q_BxLxHxK.shape).astype(q_BxLxHxK.dtype)
    return out, (q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, out, lse_N, first)


def _blockwise_fwd(q, k, v, tile, first):
    return _blockwise_forward(q, k, v, tile, first)


def _blockwise_bwd(tile, residuals, d_out):
    """The gradients of q, k and v, each tile's probabilities rebuilt from the log-sum-exp."""
    q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, out, lse_NxBxGxRxT, first = residuals
    groups = k_BxLxGxK.shape[2]
    scale = 1.0 / math.sqrt(q_BxLxHxK.shape[-1])
    qs = _blocks(_grouped(q_BxLxHxK, groups), tile)
    dos = _blocks(_grouped(d_out, groups), tile)
    # D_i = rowsum(dO * O): the softmax's backward through the normalisation.
    delta = (d_out.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)  # B x L x H
    deltas = _blocks(delta.reshape(*delta.shape[:2], groups, -1), tile)  # N x B x T x G x R
    deltas = jnp.einsum("nbtgr->nbgrt", deltas)
    ks, vs = _blocks(k_BxLxGxK, tile), _blocks(v_BxLxGxK, tile)
    n = qs.shape[0]  # query tiles: the key tiles first .. first + n - 1

    def probabilities_and_ds(i, j):
        """P and dS of tile (i, j), i counted among the queries: ``B x G x R x T x S``."""
        s = _scores(qs[i], ks[j], first + i, j, scale)
        p = jnp.exp(s - lse_NxBxGxRxT[i][..., None])
        dp = jnp.einsum("btgrk,bsgk->bgrts", dos[i], vs[j], preferred_element_type=jnp.float32)
        return p, p * (dp - deltas[i][..., None])

    def query_grad(i):
        def step(j, dq):
            _, ds = probabilities_and_ds(i, j)
            return dq + jnp.einsum("bgrts,bsgk->btgrk", ds, ks[j].astype(jnp.float32)) * scale

        start = _varying_like(qs[i], jnp.zeros(qs.shape[1:], jnp.float32))
        return lax.fori_loop(0, first + i + 1, step, start)

    def key_value_grad(j):
        def step(i, carry):
            dk, dv = carry
            p, ds = probabilities_and_ds(i, j)
            dv = dv + jnp.einsum("bgrts,btgrk->bsgk", p, dos[i].astype(jnp.float32))
            dk = dk + jnp.einsum("bgrts,btgrk->bsgk", ds, qs[i].astype(jnp.float32)) * scale
            return dk, dv

        zero = _varying_like(ks[j], jnp.zeros(ks.shape[1:], jnp.float32))
        # the query tiles at or past key tile j (none for a key tile past them all)
        return lax.fori_loop(jnp.maximum(j - first, 0), n, step, (zero, zero))

    dq = _unblocks(lax.map(query_grad, jnp.arange(n))).reshape(q_BxLxHxK.shape)
    dk_N, dv_N = lax.map(key_value_grad, jnp.arange(ks.shape[0]))
    return (
        dq.astype(q_BxLxHxK.dtype),
        _unblocks(dk_N).astype(k_BxLxGxK.dtype),
        _unblocks(dv_N).astype(v_BxLxGxK.dtype),
        None,
    )


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
