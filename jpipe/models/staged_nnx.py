"""Flax NNX models cut into pipeline stages: `split_nnx_model`.

An NNX module is an object that holds its own weights, while a pipeline
stage is a pure function of its parameters. `nnx.split` separates the two:
a static graph definition (the module's structure, code and hyperparameters)
and a `nnx.State` of arrays. Each stage here keeps the graph definitions of
its modules and takes their parameters as plain nested dicts (the State's
pure-dict form, ``nnx.to_pure_dict``); to run, it rebuilds each module with
`nnx.merge` from its graph definition and those arrays, inside the traced
stage, so the module is a pure function again and the compiler can split
its backward into I and W like any other stage.

The model has the embed/blocks/head shape of `split_flax_model`, with the
same conventions and the same parameter layout (``"embed"``, ``"blocks"``, a
tuple of one dict per block, ``"head"``), so `merge_stage_params`, the
trainer's weight decay rule and checkpoints treat both alike:
``embed(inputs) -> x``, ``block(x) -> x``, ``head(x, inputs) -> loss``. The
three are given as constructors ``make(rngs) -> nnx.Module``; the embedding,
block `i` and the head are made from `nnx.Rngs` seeded with keys folded from
the model key and their own global index, so every split starts from the
same weights.

Only `nnx.Param` state is supported: a module holding other state (batch
statistics, RNG streams for dropout) is refused when the model is built,
since a stage may not carry state from one microbatch to the next. Dropout
takes per-row keys from the batch instead, as in `split_flax_model`: with
``keys="keys"`` each module is called with ``keys=`` the row keys with its
identity folded in (`row_dropout`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jpipe.lower.pipeline import run_stages
from jpipe.models.staged import (
    StagedModel,
    as_key,
    fold_row_keys,
    split_stage_params,
    stage_counts,
)

Maker = Callable[[nnx.Rngs], nnx.Module]


class _Part:
    """One module kind: its graph definition and how to rebuild it from a pure dict."""

    def __init__(self, make: Maker, what: str):
        abstract = nnx.eval_shape(lambda: make(nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
        others = sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=_is_var)})
        if others:
            raise ValueError(
                f"split_nnx_model: the {what} holds state other than nnx.Param "
                f"({', '.join(others)}); a pipeline stage is a pure function of its "
                "parameters, so give it modules without batch statistics or RNG streams "
                "(for dropout, take per-row keys from the batch: keys='keys')"
            )
        self.make = make
        self.graphdef = graphdef
        self.treedef = jax.tree.structure(params)

    def init(self, key) -> dict:
        """Fresh parameters from `key`, as a pure dict."""
        module = self.make(nnx.Rngs(key))
        return nnx.to_pure_dict(nnx.state(module, nnx.Param))

    def module(self, pure: dict) -> nnx.Module:
        """The module with the parameters `pure` (traced arrays are fine)."""
        state = jax.tree.unflatten(self.treedef, jax.tree.leaves(pure))
        return nnx.merge(self.graphdef, state)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _stage(
    params,
    x,
    inputs,
    *,
    embed: _Part,
    block: _Part,
    head: _Part,
    first: bool,
    last: bool,
    keys: str | None,
    first_block: int,
    num_layers: int,
):
    """One stage: the embedding if first, its blocks, the head if last."""
    row = inputs.get(keys) if keys is not None else None

    def keys_of(identity: int) -> dict:
        if keys is None:
            return {}
        return {"keys": None if row is None else fold_row_keys(row, identity)}

    if first:
        x = embed.module(params["embed"])(inputs, **keys_of(0))
    for i, block_params in enumerate(params.get("blocks", ())):
        x = block.module(block_params)(x, **keys_of(first_block + i + 1))
    if last:
        return head.module(params["head"])(x, inputs, **keys_of(num_layers + 1))
    return x


def split_nnx_model(
    embed: Maker,
    block: Maker,
    head: Maker,
    *,
    num_layers: int,
    layers_per_stage: str | Sequence[int] | None = None,
    num_stages: int | None = None,
    keys: str | None = None,
) -> StagedModel:
    """Cuts ``head(block^num_layers(embed(inputs)), inputs)``, three NNX modules, into stages.

    Args:
      embed, block, head: constructors ``make(rngs: nnx.Rngs) -> nnx.Module``
        (e.g. ``lambda rngs: Block(64, rngs=rngs)``); `block` is called once
        per block, each with its own weights. Their ``__call__`` follow the
        module docstring's conventions.
      num_layers: how many blocks.
      layers_per_stage: blocks per stage, e.g. ``"3,4,4,3"``; None or ``""``
        for a balanced split over `num_stages`.
      num_stages: the number of stages, needed for a balanced split.
      keys: the name of the inputs' leaf of per-row keys for modules that
        draw random numbers (their ``__call__`` then take ``keys=``); None
        for a deterministic model.

    Returns:
      A `StagedModel` whose parameters are, per stage, ``{"embed"?,
      "blocks"?, "head"?}`` of pure dicts.

    Raises:
      ValueError: the counts do not fit `num_layers` (see `split_layers`), or
        a module holds state other than `nnx.Param`.
    """
    counts = stage_counts(num_layers, layers_per_stage, num_stages)
    S = len(counts)
    parts = {
        "embed": _Part(embed, "embedding"),
        "block": _Part(block, "block"),
        "head": _Part(head, "head"),
    }
    stages = []
    for s in range(S):
        stage = functools.partial(
            _stage,
            **parts,
            first=s == 0,
            last=s == S - 1,
            keys=keys,
            first_block=sum(counts[:s]),
            num_layers=num_layers,
        )
        stage.__name__ = f"stage_{s}"
        stages.append(stage)
    stages = tuple(stages)

    def init_full(key, wanted=None) -> dict:
        # The keys of split_flax_model's init: 0 embedding, 1 blocks (block i
        # folds in i), 2 head. With `wanted`, only those parts are made.
        embed_key, blocks_key, head_key = (jax.random.fold_in(key, i) for i in range(3))
        keep_embed, block_ids, keep_head = wanted or (True, range(num_layers), True)
        return {
            "embed": parts["embed"].init(embed_key) if keep_embed else None,
            "blocks": {
                i: parts["block"].init(jax.random.fold_in(blocks_key, i)) for i in block_ids
            },
            "head": parts["head"].init(head_key) if keep_head else None,
        }

    def as_model_tree(made: dict) -> dict:
        return {**made, "blocks": tuple(made["blocks"][i] for i in range(num_layers))}

    full = jax.jit(lambda key: as_model_tree(init_full(key)))
    some = jax.jit(init_full, static_argnums=1)
    starts = [sum(counts[:s]) for s in range(S)]

    def init(rng, stages=None) -> list:
        key = as_key(rng)
        if stages is None:
            return split_stage_params(full(key), counts)
        keep = set(stages)
        shapes = jax.eval_shape(lambda k: split_stage_params(full(k), counts), key)
        block_ids = tuple(i for s in sorted(keep) for i in range(starts[s], starts[s] + counts[s]))
        made = some(key, (0 in keep, block_ids, S - 1 in keep))
        params_list = []
        for s in range(S):
            if s not in keep:
                params_list.append(shapes[s])
                continue
            params: dict[str, Any] = {}
            if s == 0:
                params["embed"] = made["embed"]
            if counts[s]:
                params["blocks"] = tuple(
                    made["blocks"][i] for i in range(starts[s], starts[s] + counts[s])
                )
            if s == S - 1:
                params["head"] = made["head"]
            params_list.append(params)
        return params_list

    return StagedModel(
        stages, init, functools.partial(run_stages, stages), counts, False, keys=keys
    )
