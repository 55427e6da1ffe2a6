"""The models every row of a benchmark runs, cut two ways.

A `Workload` is one model with a fixed number of layers and a fixed
microbatch size. It hands out:

- ``stages(S)``: the model cut into S pipeline stages for jpipe (and, with
  ``S = R``, for the unpipelined rows): ``(stage_fns, params_list)``. Every cut
  computes the same function from the same weights, so a 4-stage and an
  8-stage pipeline run the same model.
- ``peer(P)``: the same model in the form the SPMD pipelines of today need:
  an embedding that runs before the pipeline, P identical pieces of layers
  whose weights are stacked, and a head with the loss that runs after it.
- ``batch(M)``: a global batch of M microbatches.

Two models:

- ``gpt``: `jpipe.models.gpt` (pre-norm transformer blocks, learned
  positions, untied head, token cross-entropy); ``tiny-gpt`` is a very small
  one for tests and ``--quick``.
- ``dense``: the compiler issue's shape, layers ``x = relu(x @ w + b)`` of
  width D with a mean-squared-error loss; 8 layers of width 1024 and
  microbatches of 64 rows make 4 stages of two dense layers each.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jpipe.models import gpt


class PeerModel(NamedTuple):
    """A model as a vmap-style SPMD pipeline takes it.

    Attributes:
      embed: ``embed(params, inputs) -> x``, run on every microbatch before
        the pipeline.
      embed_params: its parameters.
      block: ``block(params, x) -> x``, one piece of the pipeline; every piece
        has the same structure, so their parameters stack.
      block_params: one parameter pytree per piece, in model order.
      head: ``head(params, x, inputs) -> loss``, the microbatch's mean loss,
        run after the pipeline.
      head_params: its parameters.
    """

    embed: Callable
    embed_params: Any
    block: Callable
    block_params: list
    head: Callable
    head_params: Any


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model of `num_layers` layers fed microbatches of `microbatch_size` rows.

    Attributes:
      name: the name `get_workload` knows it by.
      description: one line for the report.
      num_layers: layers (blocks) in the whole model; every stage count used
        must divide it.
      microbatch_size: rows per microbatch.
    """

    name: str
    description: str
    num_layers: int
    microbatch_size: int
    _stages: Callable = dataclasses.field(repr=False, compare=False)
    _peer: Callable = dataclasses.field(repr=False, compare=False)
    _batch: Callable = dataclasses.field(repr=False, compare=False)

    def _per_piece(self, pieces: int) -> int:
        if pieces < 1 or self.num_layers % pieces:
            raise ValueError(
                f"workload {self.name!r} has {self.num_layers} layers, which {pieces} "
                "stages cannot share evenly"
            )
        return self.num_layers // pieces

    def stages(self, num_stages: int) -> tuple[tuple[Callable, ...], list]:
        """``(stage_fns, params_list)``: the model in `num_stages` equal stages."""
        return self._stages(num_stages, self._per_piece(num_stages))

    def peer(self, num_pieces: int) -> PeerModel:
        """The model as embed, `num_pieces` stacked pieces of layers, head."""
        return self._peer(num_pieces, self._per_piece(num_pieces))

    def batch(self, num_microbatches: int, seed: int = 0) -> dict:
        """A host batch of ``num_microbatches * microbatch_size`` rows."""
        return self._batch(num_microbatches * self.microbatch_size, seed)


# -- GPT ----------------------------------------------------------------------


def _gpt_workload(name: str, description: str, config: gpt.GPTConfig, microbatch_size: int):
    def stages(num_stages, per):
        model = gpt.make_stages(config, (per,) * num_stages)
        return model.stages, model.init(0)

    def peer(pieces, per):
        # Zero blocks in the first and last stage: they only embed, and only
        # compute the head and the loss. The init does not depend on the cut.
        model = gpt.make_stages(config, (0,) + (per,) * pieces + (0,))
        params = model.init(0)
        first, middle, last = model.stages[0], model.stages[1], model.stages[-1]
        return PeerModel(
            embed=lambda p, inputs: first(p, None, inputs),
            embed_params=params[0],
            block=lambda p, x: middle(p, x, None),
            block_params=params[1:-1],
            head=last,
            head_params=params[-1],
        )

    def batch(rows, seed):
        return gpt.example_batch(config, rows, seed)

    return Workload(name, description, config.num_layers, microbatch_size, stages, peer, batch)


# -- dense ----------------------------------------------------------------------


def _dense_layers(params, x):
    for w, b in zip(params["w"], params["b"]):
        x = jax.nn.relu(x @ w + b)
    return x


def _dense_stage(params, x, inputs, *, first: bool, last: bool):
    if first:
        x = inputs["x"]
    x = _dense_layers(params, x)
    if last:
        return jnp.mean((x - inputs["y"]) ** 2)
    return x


def _dense_params(width: int, num_layers: int, per: int) -> list[dict]:
    # Layer i draws from a key folded from its global index, so every cut of
    # the model starts from the same weights.
    key = jax.random.key(0)
    scale = np.float32(1 / np.sqrt(width))
    ws = [
        np.asarray(jax.random.normal(jax.random.fold_in(key, i), (width, width))) * scale
        for i in range(num_layers)
    ]
    out = []
    for s in range(num_layers // per):
        layers = range(s * per, (s + 1) * per)
        out.append(
            {
                "w": tuple(ws[i] for i in layers),
                "b": tuple(np.zeros((width,), np.float32) for _ in layers),
            }
        )
    return out


def _dense_workload(name: str, description: str, width: int, num_layers: int, microbatch_size: int):
    def stages(num_stages, per):
        fns = tuple(
            functools.partial(_dense_stage, first=s == 0, last=s == num_stages - 1)
            for s in range(num_stages)
        )
        return fns, _dense_params(width, num_layers, per)

    def peer(pieces, per):
        return PeerModel(
            embed=lambda p, inputs: inputs["x"],
            embed_params={},
            block=_dense_layers,
            block_params=_dense_params(width, num_layers, per),
            head=lambda p, x, inputs: jnp.mean((x - inputs["y"]) ** 2),
            head_params={},
        )

    def batch(rows, seed):
        rng = np.random.default_rng(seed)
        return {
            "x": rng.standard_normal((rows, width), np.float32),
            "y": rng.standard_normal((rows, width), np.float32),
        }

    return Workload(name, description, num_layers, microbatch_size, stages, peer, batch)


# -- the registry ------------------------------------------------------------------

_GPT = gpt.GPTConfig(vocab_size=256, seq_len=32, num_layers=8, num_heads=4, d_model=256, d_ff=1024)
_TINY_GPT = gpt.GPTConfig(vocab_size=64, seq_len=8, num_layers=8, num_heads=2, d_model=32, d_ff=64)

_WORKLOADS = {
    "gpt": lambda: _gpt_workload(
        "gpt",
        "GPT, 8 blocks, D=256, 4 heads, MLP 1024, L=32, vocab 256, microbatch 4 sequences, float32",
        _GPT,
        4,
    ),
    "tiny-gpt": lambda: _gpt_workload(
        "tiny-gpt",
        "tiny GPT, 8 blocks, D=32, 2 heads, MLP 64, L=8, vocab 64, microbatch 2 sequences, float32",
        _TINY_GPT,
        2,
    ),
    "dense": lambda: _dense_workload(
        "dense",
        "8 dense layers relu(x @ w + b) of width 1024, MSE loss, microbatch 64 rows, float32",
        1024,
        8,
        64,
    ),
    "tiny-dense": lambda: _dense_workload(
        "tiny-dense",
        "8 dense layers relu(x @ w + b) of width 64, MSE loss, microbatch 8 rows, float32",
        64,
        8,
        8,
    ),
}


def workload_names() -> tuple[str, ...]:
    return tuple(_WORKLOADS)


def get_workload(name: str) -> Workload:
    """The workload called `name` (see `workload_names`)."""
    if name not in _WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: use one of {', '.join(_WORKLOADS)}")
    return _WORKLOADS[name]()
