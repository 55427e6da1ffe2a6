"""Cutting a Flax model into pipeline stages by layer counts.

Most models a pipeline serves have the same shape: something that embeds the
inputs, a stack of identical blocks, and a head that ends in the loss. Given
those three Flax modules, `split_flax_model` builds the stage functions the
compiler takes (`jpipe.Pipeline`), an initializer that gives every split the
same weights (block `i` always gets the key folded from `i`), and the
unpipelined reference loss.

Conventions: ``embed.apply(vars, inputs) -> x``, ``block.apply(vars, x) -> x``,
``head.apply(vars, x, inputs) -> loss`` (a float scalar, the microbatch's mean),
where `inputs` is one microbatch's slice of the batch. The first stage holds
the embedding and its share of blocks, the last its blocks and the head; a
first or last stage may hold no block. Splits may be uneven: ``"3,4,4,3"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax


class FlaxStages(NamedTuple):
    """A Flax model cut into stages.

    Attributes:
      stages: ``stage(params, x, inputs) -> y`` per stage, in pipeline order.
      init: ``init(rng) -> list`` of per-stage parameter pytrees.
      loss: ``loss(params_list, batch)``: every stage in sequence, unpipelined.
      layers_per_stage: blocks held by each stage.
    """

    stages: tuple[Callable, ...]
    init: Callable[[Any], list]
    loss: Callable[[list, Any], jax.Array]
    layers_per_stage: tuple[int, ...]


def parse_layer_counts(num_layers: int, layers_per_stage: str | Sequence[int]) -> tuple[int, ...]:
    """Reads ``"3,4,4,3"`` (or a sequence) and checks it adds up to `num_layers`."""
    if isinstance(layers_per_stage, str):
        try:
            counts = tuple(int(x) for x in layers_per_stage.split(",") if x.strip())
        except ValueError:
            raise ValueError(
                f"layers_per_stage {layers_per_stage!r} must be integers separated by commas, "
                "like '3,4,4,3'"
            ) from None
    else:
        counts = tuple(int(x) for x in layers_per_stage)
    if not counts:
        raise ValueError("layers_per_stage is empty: give one count per stage, like '3,4,4,3'")
    if any(c < 0 for c in counts):
        raise ValueError(f"layers_per_stage {counts} has a negative count")
    if sum(counts) != num_layers:
        raise ValueError(
            f"layers_per_stage {','.join(map(str, counts))} adds up to {sum(counts)} "
            f"blocks, but the model has {num_layers}"
        )
    for s, c in enumerate(counts[1:-1], start=1):
        if c == 0:
            raise ValueError(
                f"layers_per_stage gives stage {s} no block; only the first and last "
                "stages (which hold the embedding and the head) may be empty"
            )
    return counts


def split_flax_model(
    embed: nn.Module,
    block: nn.Module,
    head: nn.Module,
    *,
    num_layers: int,
    layers_per_stage: str | Sequence[int],
    example_inputs: Any,
) -> FlaxStages:
    """Cuts ``head(block^num_layers(embed(inputs)), inputs)`` into stages.

    Args:
      embed, block, head: the three Flax modules (see the module docstring).
      num_layers: how many times `block` is applied (each with its own weights).
      layers_per_stage: blocks per stage, e.g. ``"3,4,4,3"`` or ``(3, 4, 4, 3)``.
      example_inputs: one microbatch's inputs, to initialise with (arrays or
        anything `init` accepts; only shapes matter).

    Returns:
      A `FlaxStages`.
    """
    counts = parse_layer_counts(num_layers, layers_per_stage)
    S = len(counts)
    starts = [sum(counts[:s]) for s in range(S)]

    def make_stage(s: int) -> Callable:
        first, last = s == 0, s == S - 1

        def stage(params, x, inputs):
            if first:
                x = embed.apply({"params": params["embed"]}, inputs)
            for block_params in params.get("blocks", ()):
                x = block.apply({"params": block_params}, x)
            if last:
                return head.apply({"params": params["head"]}, x, inputs)
            return x

        stage.__name__ = f"stage_{s}"
        return stage

    stages = tuple(make_stage(s) for s in range(S))

    def init(rng) -> list:
        if isinstance(rng, int):
            rng = jax.random.key(rng)
        embed_key, blocks_key, head_key = (jax.random.fold_in(rng, i) for i in range(3))
        embed_params = embed.init(embed_key, example_inputs)["params"]
        x = embed.apply({"params": embed_params}, example_inputs)
        blocks = [
            block.init(jax.random.fold_in(blocks_key, i), x)["params"] for i in range(num_layers)
        ]
        head_params = head.init(head_key, x, example_inputs)["params"]
        params_list = []
        for s in range(S):
            params = {}
            if s == 0:
                params["embed"] = embed_params
            if counts[s]:
                params["blocks"] = tuple(blocks[starts[s] : starts[s] + counts[s]])
            if s == S - 1:
                params["head"] = head_params
            params_list.append(params)
        return params_list

    def loss(params_list, batch):
        x = None
        for stage, params in zip(stages, params_list):
            x = stage(params, x, batch)
        return x

    return FlaxStages(stages, init, loss, counts)
