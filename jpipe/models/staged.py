"""Models cut into pipeline stages: one type, one way to split layers.

The compiler (`jpipe.Pipeline`) runs a model given as an ordered tuple of stage
functions ``stage(params, x, inputs) -> y``, one parameter pytree per stage.
A `StagedModel` is that tuple with its initializer and its unpipelined
reference loss (`jpipe.run_stages`: every stage in order).

Most models a pipeline serves have the same shape: something that embeds the
inputs, a stack of identical blocks, and a head that ends in the loss. Given
those three Flax modules, `split_flax_model` builds the stages by layer counts
(`split_layers`: balanced, or uneven such as ``"3,4,4,3"``), with an
initializer that gives every split the same weights (the embedding, block `i`
and the head each draw from a key folded from the model key and their own
global index, so ``pipe=4`` and ``pipe=1`` start from identical weights).

Conventions: ``embed.apply(vars, inputs) -> x``, ``block.apply(vars, x) -> x``,
``head.apply(vars, x, inputs) -> loss`` (a float scalar, the microbatch's mean),
where `inputs` is one microbatch's slice of the batch. A stage's parameters
are a dict with ``"embed"`` (first stage only), ``"blocks"`` (a tuple, one
entry per block, absent when the stage has none) and ``"head"`` (last stage
only); the first or last stage may hold no block.

Scanned layers (``scan_layers=True``): a stage runs its blocks in one
``nn.scan``, the way large JAX models are written (one traced block, whatever
the depth), and its ``"blocks"`` is then one tree whose leaves are the
stage's blocks stacked on a leading axis. The weights are the same as
unrolled (block `i` still draws from its own key), and `merge_stage_params`
unstacks them, so both give the same merged tree. The compiler splits a
scanned stage's backward into I and W as exactly as an unrolled one
(`docs/design.md`).

Random numbers (dropout). A stage is a pure function of ``(params, x,
inputs)``, so its randomness comes in with the batch: a leaf of raw key data,
one key per row (`row_keys`: ``uint32[N, 2]`` for the default threefry keys,
a pure function of the seed, the step and the row's index in the global
batch). Cutting the batch into microbatches and over the ``data`` axis slices
it like any other leaf, so every row draws the same numbers however the batch
is split, pipelined or not. With ``split_flax_model(..., keys="keys")`` the
three modules get a keyword argument ``keys``: the row keys with the module's
own identity folded in (0 for the embedding, ``1 + i`` for block `i`, counted
over the whole model, and ``1 + num_layers`` for the head), or None when the
microbatch has no such leaf (evaluation: no dropout). `row_dropout` draws a
per-row mask from them.
"""

from __future__ import annotations

import functools
import numbers
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jpipe.lower.pipeline import run_stages

StageFn = Callable[[Any, Any, Any], Any]


class StagedModel(NamedTuple):
    """A model as the pipeline compiler takes it.

    Attributes:
      stages: one pure, jittable function ``stage(params, x, inputs) -> y`` per
        stage, in pipeline order.
      init: ``init(rng, stages=None) -> list`` of per-stage parameter pytrees
        (with `stages`, only those stages' parameters are computed, the others
        come back as `jax.ShapeDtypeStruct`s: each process of a multi-process
        run makes only its own stages); `rng` is a
        JAX key or an int seed.
      loss: ``loss(params_list, batch) -> float scalar``, the unpipelined
        reference: every stage in sequence on the whole batch.
      layers_per_stage: blocks held by each stage.
      scan_layers: whether each stage runs its blocks in one ``nn.scan``, its
        ``"blocks"`` then being one tree of arrays stacked over its blocks.
      specs: how the stages split their parameters over mesh axes such as
        ``tensor`` (for `Pipeline.pack` and `Pipeline.init`): a function of
        the parameter list (arrays or shape structs) returning one tree of
        `PartitionSpec` per stage, or None when nothing is split.
      keys: the name of the batch leaf of per-row keys the stages draw random
        numbers from (`row_keys`; the trainer adds it as ``"keys"``), or None
        for a deterministic model.
      carries: for a sliced schedule (Seq1F1B), ``carries(rows, tokens,
        tensor=1) -> list``: per stage, the shapes of what it carries from one
        slice of a sequence to the next (each block's keys and values for
        `rows` rows of `tokens`-token sequences, as one device of a
        `tensor`-way axis holds them; None for a stage without blocks), for
        `jpipe.Pipeline`'s ``carries``. The stages then take the carry as
        their fourth argument and return ``(y, carry)``, and the batch needs
        a ``positions`` leaf. None: the model does not run sliced.
    """

    stages: tuple[StageFn, ...]
    init: Callable[[Any], list]
    loss: Callable[[list, Any], jax.Array]
    layers_per_stage: tuple[int, ...]
    scan_layers: bool = False
    specs: Callable[[list], list] | None = None
    keys: str | None = None
    carries: Callable[..., list] | None = None


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


def stage_counts(
    num_layers: int, layers_per_stage: str | Sequence[int] | None, num_stages: int | None
) -> tuple[int, ...]:
    """`split_layers` where the counts, if given, fix the number of stages.

    Args:
      num_layers: blocks in the model.
      layers_per_stage: the counts (``"3,4,4,3"`` or a sequence), or None or
        ``""`` for a balanced split over `num_stages`.
      num_stages: the number of stages; needed only for a balanced split, and
        checked against the counts when both are given.
    """
    if layers_per_stage is None or (
        isinstance(layers_per_stage, str) and not layers_per_stage.strip()
    ):
        if num_stages is None:
            raise ValueError("give layers_per_stage, or num_stages for a balanced split")
        return split_layers(num_layers, num_stages)
    parsed = _parse_counts(layers_per_stage)
    return split_layers(num_layers, num_stages or len(parsed), parsed)


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


def as_key(rng) -> jax.Array:
    """A JAX key from a key (typed or raw) or an integer seed (traced or not)."""
    if isinstance(rng, numbers.Integral):
        return jax.random.key(int(rng))
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.ndim == 0:
        return jax.random.key(rng)
    return rng


_ROW_KEYS_STREAM = 0x726F77  # folded into the seed first: apart from `init`'s keys


def row_keys(seed, step, rows) -> jax.Array:
    """One key per row of a step's global batch, as raw key data.

    A pure function of ``(seed, step, row)``: a resumed run, a run with another
    number of processes, microbatches or data shards gives each row the same
    key. The seed's stream is apart from the one `StagedModel.init` draws the
    weights from.

    Args:
      seed: an int (or traced int) seed, or a JAX key.
      step: the training step (an int, or traced inside a jitted step).
      rows: the number of rows N of the global batch (rows ``0..N-1``), or an
        array of global row indices.

    Returns:
      ``jax.random.key_data`` of the keys: ``uint32[N, 2]`` for threefry keys.
    """
    base = jax.random.fold_in(as_key(seed), _ROW_KEYS_STREAM)
    step_key = jax.random.fold_in(base, step)
    index = jnp.arange(rows) if isinstance(rows, numbers.Integral) else jnp.asarray(rows)
    return jax.random.key_data(jax.vmap(lambda r: jax.random.fold_in(step_key, r))(index))


def fold_row_keys(keys_NxK: jax.Array, data) -> jax.Array:
    """Every row's key with `data` (an int: a layer's or a site's number) folded in."""
    typed = jax.random.wrap_key_data(keys_NxK)
    folded = jax.vmap(jax.random.fold_in, in_axes=(0, None))(typed, data)
    return jax.random.key_data(folded)


def row_dropout(x_NxX: jax.Array, keys_NxK: jax.Array | None, rate: float) -> jax.Array:
    """Dropout whose mask for row `n` is drawn from row `n`'s key alone.

    Zeroes each element with probability `rate` and scales the rest by
    ``1 / (1 - rate)``. With ``keys_NxK=None`` or ``rate=0`` it returns `x`
    unchanged (evaluation).
    """
    if keys_NxK is None or rate == 0:
        return x_NxX
    typed = jax.random.wrap_key_data(keys_NxK)
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x_NxX.shape[1:]))(typed)
    return _masked(1.0 / (1.0 - rate), x_NxX, keep)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _masked(scale: float, x, keep):
    """``x * scale`` where `keep`, else 0.

    Its own backward so that the backward keeps only the boolean mask, a byte
    per element: `jnp.where`'s kept a float array of zeros besides.
    """
    return jnp.where(keep, x * jnp.asarray(scale, x.dtype), jnp.zeros((), x.dtype))


def _masked_fwd(scale, x, keep):
    return _masked(scale, x, keep), keep


def _masked_bwd(scale, keep, g):
    return _masked(scale, g, keep), None


_masked.defvjp(_masked_fwd, _masked_bwd)


def split_stage_params(
    full: dict, layers_per_stage: Sequence[int], scan_layers: bool = False
) -> list[dict]:
    """Cuts the whole model's parameters into per-stage trees.

    Args:
      full: ``{"embed": ..., "blocks": (block_0, ...), "head": ...}``, as
        returned by `merge_stage_params`.
      layers_per_stage: blocks per stage, summing to the number of blocks.
      scan_layers: stack each stage's blocks into one tree (for stages that
        run them in ``nn.scan``) instead of keeping a tuple.

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
            blocks = tuple(full["blocks"][start : start + count])
            params["blocks"] = _stack(blocks) if scan_layers else blocks
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
        stage_blocks = params.get("blocks", ())
        if isinstance(stage_blocks, Mapping):  # stacked: a stage with scan_layers
            count = len(jax.tree.leaves(stage_blocks)[0])
            stage_blocks = [jax.tree.map(lambda a, i=i: a[i], stage_blocks) for i in range(count)]
        blocks.extend(stage_blocks)
    return {
        "embed": params_list[0]["embed"],
        "blocks": tuple(blocks),
        "head": params_list[-1]["head"],
    }


def _stack(blocks: Sequence) -> dict:
    return jax.tree.map(lambda *leaves: jax.numpy.stack(leaves), *blocks)


class _Layer(nn.Module):
    """One block as a scan body: ``(x, keys or None) -> (block(x), None)``."""

    block: nn.Module

    @nn.compact
    def __call__(self, x, keys):
        if keys is None:
            return self.block(x), None
        return self.block(x, keys=keys), None


def _scanned(block: nn.Module, count: int) -> nn.Module:
    """`count` blocks in one ``nn.scan``; its parameters are ``{"block": stacked}``."""
    scan = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=count)
    return scan(block=block.clone())


def _stage(
    params,
    x,
    inputs,
    carry=None,
    *,
    embed,
    block,
    head,
    first: bool,
    last: bool,
    scanned=None,
    keys: str | None = None,
    first_block: int = 0,
    num_layers: int = 0,
):
    """One stage: the embedding if first, its blocks, the head if last.

    With `keys` (the name of the inputs' row-key leaf), each module gets
    ``keys=`` the row keys with its global identity folded in.

    With `carry` (one slice of a sequence: a tuple of each block's carry,
    `StagedModel.carries`), each block gets its own and the slice's first
    token (``inputs["positions"]``), and the stage returns ``(y, carry)``.
    """
    row = inputs.get(keys) if keys is not None else None

    def keys_of(identity: int) -> dict:
        """The ``keys=`` argument of the module with this identity (none without `keys`)."""
        if keys is None:
            return {}
        return {"keys": None if row is None else fold_row_keys(row, identity)}

    if first:
        x = embed.apply({"params": params["embed"]}, inputs, **keys_of(0))
    carried = []  # each block's carry for the next slice
    if carry is not None:
        if scanned is not None:
            raise ValueError("sequence slices do not take scan_layers yet: set it False")
        offset = inputs["positions"][0, 0]
        for i, block_params in enumerate(params.get("blocks", ())):
            x, c = block.apply(
                {"params": block_params},
                x,
                carry=carry[i],
                offset=offset,
                **keys_of(first_block + i + 1),
            )
            carried.append(c)
    elif scanned is not None and "blocks" in params:
        count = len(jax.tree.leaves(params["blocks"])[0])
        ids = jnp.arange(first_block, first_block + count) + 1
        layer_keys = None if row is None else jax.vmap(lambda i: fold_row_keys(row, i))(ids)
        x, _ = scanned.apply({"params": {"block": params["blocks"]}}, x, layer_keys)
    else:
        for i, block_params in enumerate(params.get("blocks", ())):
            x = block.apply({"params": block_params}, x, **keys_of(first_block + i + 1))
    if last:
        x = head.apply({"params": params["head"]}, x, inputs, **keys_of(num_layers + 1))
    return x if carry is None else (x, tuple(carried))


def split_flax_model(
    embed: nn.Module,
    block: nn.Module,
    head: nn.Module,
    *,
    num_layers: int,
    layers_per_stage: str | Sequence[int] | None,
    example_inputs: Any,
    num_stages: int | None = None,
    scan_layers: bool = False,
    keys: str | None = None,
    block_carry: Callable | None = None,
) -> StagedModel:
    """Cuts ``head(block^num_layers(embed(inputs)), inputs)`` into stages.

    Args:
      embed, block, head: the three Flax modules (see the module docstring).
      num_layers: how many times `block` is applied (each with its own weights).
      layers_per_stage: blocks per stage, e.g. ``"3,4,4,3"`` or ``(3, 4, 4, 3)``;
        None or ``""`` for a balanced split over `num_stages`.
      example_inputs: one microbatch's inputs, to initialise with (arrays or
        anything `init` accepts; only shapes matter).
      num_stages: the number of stages, needed only for a balanced split.
      scan_layers: run each stage's blocks in one ``nn.scan`` over its
        blocks' parameters stacked on a leading axis (see the module docstring).
      keys: for models that draw random numbers (dropout): the name of the
        inputs' leaf of per-row keys (`row_keys`); the three modules then take
        a ``keys`` keyword argument (see the module docstring). None: they
        take none, and the model is deterministic.
      block_carry: for sequence slices: ``block_carry(rows, tokens, tensor)``,
        the shapes of one block's carry (`StagedModel.carries`); the block
        then takes ``carry=`` and ``offset=`` and returns ``(y, carry)``.

    Returns:
      A `StagedModel`.

    Raises:
      ValueError: the counts do not fit `num_layers` (see `split_layers`).
    """
    counts = stage_counts(num_layers, layers_per_stage, num_stages)
    S = len(counts)
    stages = []
    for s in range(S):
        stage = functools.partial(
            _stage,
            embed=embed,
            block=block,
            head=head,
            first=s == 0,
            last=s == S - 1,
            scanned=_scanned(block, counts[s]) if scan_layers and counts[s] else None,
            keys=keys,
            first_block=sum(counts[:s]),
            num_layers=num_layers,
        )
        stage.__name__ = f"stage_{s}"  # for error messages and profiles
        stages.append(stage)
    stages = tuple(stages)

    @jax.jit
    def init_full(key) -> dict:
        # Jitted so that an eager call costs one compile, not one per operation.
        embed_key, blocks_key, head_key = (jax.random.fold_in(key, i) for i in range(3))
        embed_params = embed.init(embed_key, example_inputs)["params"]
        x = jax.eval_shape(lambda p: embed.apply({"params": p}, example_inputs), embed_params)
        x = jax.numpy.zeros(x.shape, x.dtype)
        return {
            "embed": embed_params,
            "blocks": tuple(
                block.init(jax.random.fold_in(blocks_key, i), x)["params"]
                for i in range(num_layers)
            ),
            "head": head.init(head_key, x, example_inputs)["params"],
        }

    @functools.partial(jax.jit, static_argnums=1)
    def init_parts(key, wanted: tuple) -> dict:
        # Only the parts `wanted` names, with the keys `init_full` gives them,
        # so the values are the same and nothing else is computed.
        keep_embed, block_ids, keep_head = wanted
        embed_key, blocks_key, head_key = (jax.random.fold_in(key, i) for i in range(3))
        embed_shapes = jax.eval_shape(lambda k: embed.init(k, example_inputs)["params"], key)
        x = jax.eval_shape(lambda p: embed.apply({"params": p}, example_inputs), embed_shapes)
        x = jax.numpy.zeros(x.shape, x.dtype)
        return {
            "embed": embed.init(embed_key, example_inputs)["params"] if keep_embed else None,
            "blocks": {
                i: block.init(jax.random.fold_in(blocks_key, i), x)["params"] for i in block_ids
            },
            "head": head.init(head_key, x, example_inputs)["params"] if keep_head else None,
        }

    starts = [sum(counts[:s]) for s in range(S)]

    def init(rng, stages=None) -> list:
        key = as_key(rng)
        if stages is None:
            return split_stage_params(init_full(key), counts, scan_layers)
        keep = set(stages)
        shapes = jax.eval_shape(
            lambda k: split_stage_params(init_full(k), counts, scan_layers), key
        )
        block_ids = tuple(i for s in sorted(keep) for i in range(starts[s], starts[s] + counts[s]))
        parts = init_parts(key, (0 in keep, block_ids, S - 1 in keep))
        params_list = []
        for s in range(S):
            if s not in keep:
                params_list.append(shapes[s])
                continue
            params = {}
            if s == 0:
                params["embed"] = parts["embed"]
            if counts[s]:
                blocks = tuple(parts["blocks"][i] for i in range(starts[s], starts[s] + counts[s]))
                params["blocks"] = _stack(blocks) if scan_layers else blocks
            if s == S - 1:
                params["head"] = parts["head"]
            params_list.append(params)
        return params_list

    def carries(rows: int, tokens: int, tensor: int = 1) -> list:
        one = block_carry(rows, tokens, tensor)
        return [tuple(one for _ in range(n)) if n else None for n in counts]

    return StagedModel(
        stages,
        init,
        functools.partial(run_stages, stages),
        counts,
        bool(scan_layers),
        keys=keys,
        carries=carries if block_carry is not None else None,
    )


def head_token_losses(token_losses, unembed, y_BxLxD, targets_BxL, config, initializing: bool):
    """A head's per-token losses as its config's ``remat_logits`` and ``logit_chunks`` say.

    `token_losses(unembed, y, targets)` computes the logits and their
    per-token cross-entropy; `unembed` is the head's module; `config` a
    `GPTConfig` or `LlamaConfig`. With ``logit_chunks`` above 1 it runs over
    that many slices of the sequence in turn (a scan whose body recomputes
    its logits in the backward), so that no piece holds more than one
    slice's logits or their gradient; otherwise at once, rematerialized if
    ``remat_logits``. Flax's init (`initializing`) runs it at once, since it
    may see any sequence length.
    """
    slices = config.logit_chunks
    if slices > 1 and not initializing:
        return _losses_in_slices(token_losses, slices, unembed, y_BxLxD, targets_BxL, config)
    if config.remat_logits:
        token_losses = nn.remat(token_losses)
    return token_losses(unembed, y_BxLxD, targets_BxL)


def _losses_in_slices(token_losses, slices: int, unembed, y_BxLxD, targets_BxL, config):
    B, L, D = y_BxLxD.shape
    if L % slices:
        raise ValueError(
            f"{type(config).__name__}.logit_chunks={slices} must divide the sequence length, "
            f"got {L} tokens"
        )

    def one_slice(unembed, carry, slice_):
        y_BxCxD, targets_BxC = slice_
        return carry, token_losses(unembed, y_BxCxD, targets_BxC)

    scan = nn.scan(nn.remat(one_slice), variable_broadcast="params", split_rngs={"params": False})
    xs = (
        y_BxLxD.reshape(B, slices, L // slices, D).swapaxes(0, 1),
        targets_BxL.reshape(B, slices, L // slices).swapaxes(0, 1),
    )
    _, losses_NxBxC = scan(unembed, None, xs)
    return losses_NxBxC.swapaxes(0, 1).reshape(B, L)
