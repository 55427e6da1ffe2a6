"""Step 3 of a run: the train step, jitted in one place.

`train_step` is a pure function of the state and a global batch; it is
jitted once, in `compile_train_step`, with explicit shardings and the state
donated.

Dropout keys. When the model draws random numbers, the step adds the batch's
per-row keys itself (`with_row_keys`: ``batch["keys"]``, from the config's
seed, the state's step and each row's index in the global batch). They are
computed inside the jitted step, each device making its own rows', so no host
computes or sends them, and they depend on nothing a restart, the process
count or the mesh changes: a resumed run draws what an unbroken one would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpipe
from jpipe import models

ROW_KEYS = "keys"  # the batch leaf of per-row keys (jpipe.models.row_keys)


def with_row_keys(batch: dict, seed: int, step, sharding=None) -> dict:
    """`batch` with its per-row keys for `step`: ``batch["keys"]``, ``uint32[N, 2]``.

    Args:
      batch: the global batch, its leaves ``[N, ...]``.
      seed: the run's seed (``config.seed``).
      step: the optimizer step the batch is for (traced inside the step).
      sharding: where to put the keys (the batch's sharding), inside a jit.
    """
    rows = jax.tree.leaves(batch)[0].shape[0]
    keys = models.row_keys(seed, step, rows)
    if sharding is not None:
        keys = jax.lax.with_sharding_constraint(keys, sharding)
    return {**batch, ROW_KEYS: keys}


class TrainState(NamedTuple):
    """What a checkpoint holds.

    Attributes:
      step: optimizer steps taken, an int32 scalar.
      params: the packed parameters, ``{bucket: [R, *shape]}`` over ``pipe``.
      opt_state: the optimizer's state, laid out like `params`.
    """

    step: jax.Array
    params: dict
    opt_state: Any


def train_step(
    state: TrainState,
    batch: dict,
    *,
    value_and_grad: Callable,
    optimizer: optax.GradientTransformation,
    lr: optax.Schedule,
    row_keys_seed: int | None = None,
    batch_sharding=None,
    counted_rows: dict | None = None,
):
    """One optimizer step on one global batch; pure.

    Args:
      state: the current `TrainState`.
      batch: ``{"tokens", "targets"}``, int32 ``[batch_size, L]``.
      value_and_grad: ``(packed_params, batch) -> (loss, packed_grads)``, the
        pipeline's (`jpipe.Pipeline.step_fn`).
      optimizer: from `make_optimizer`.
      lr: the learning-rate schedule, only to report it.
      row_keys_seed: for a model with dropout, the seed of the per-row keys
        the step adds to the batch (`with_row_keys`); None adds none.
      batch_sharding: where the keys go.
      counted_rows: the rows ``grad_norm`` counts (`apply_gradients`).

    Returns:
      ``(new_state, metrics)``; metrics are float32 scalars: ``loss`` (mean
      over the batch, before the update), ``grad_norm`` (global, before
      clipping) and ``lr`` (the rate this update used).
    """
    if row_keys_seed is not None:
        batch = with_row_keys(batch, row_keys_seed, state.step, batch_sharding)
    loss, grads = value_and_grad(state.params, batch)
    return apply_gradients(
        state, loss, grads, optimizer=optimizer, lr=lr, counted_rows=counted_rows
    )


def apply_gradients(state: TrainState, loss, grads, *, optimizer, lr, counted_rows=None):
    """The optimizer's update of `state` from `grads`: ``(new_state, metrics)`` as `train_step`.

    `counted_rows`: the rows ``grad_norm`` counts (`ParamLayout.counted_rows`:
    a replicated stage's copies once; None: all).
    """
    from jpipe.train.optimizer import counted_norm

    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss.astype(jnp.float32),
        "grad_norm": counted_norm(grads, counted_rows).astype(jnp.float32),
        "lr": jnp.asarray(lr(state.step), jnp.float32),
    }
    return TrainState(state.step + 1, params, opt_state), metrics


def state_shardings(
    state: TrainState, pipeline: jpipe.Pipeline, shard_over_data: bool = False
) -> TrainState:
    """Packed arrays (parameters, their optimizer state) over ``pipe``; the rest replicated.

    With `shard_over_data`, the optimizer state's packed arrays are split over
    the ``data`` axis too, where it divides their size (ZeRO stage 1).
    """
    if pipeline.rank_meshes is not None:
        return _rank_state_shardings(state, pipeline, shard_over_data)
    mesh = pipeline.mesh
    layout = pipeline.layout
    R = mesh.shape[pipeline.pipe_axis]
    data = pipeline.data_axis
    D = mesh.shape[data] if data else 1
    buckets = layout.buckets
    replicated = NamedSharding(mesh, P())

    def pick(path, leaf):
        key = path[-1] if path else None
        if (
            isinstance(key, jax.tree_util.DictKey)
            and key.key in buckets
            and tuple(leaf.shape) == (R,) + tuple(buckets[key.key][0])
        ):
            in_opt_state = getattr(path[0], "name", None) == "opt_state"
            extra = (data, D) if shard_over_data and D > 1 and in_opt_state else None
            return NamedSharding(mesh, layout.spec(key.key, pipeline.pipe_axis, extra))
        return replicated

    return jax.tree_util.tree_map_with_path(pick, state)


def _rank_state_shardings(state: TrainState, pipeline, shard_over_data: bool) -> TrainState:
    """`state_shardings` for ranks with meshes of their own: each rank's entries on its mesh.

    The parameters and optimizer state are one entry per rank (lists); the
    step count sits with the batch: on the first rank's devices, or across
    processes a copy in each (`Pipeline.processes_sharding`).
    """
    layout = pipeline.layout
    data = pipeline.data_axis
    counter = (
        pipeline.processes_sharding
        if jax.process_count() > 1
        else NamedSharding(pipeline.rank_meshes[0], P())
    )

    def rank_of(path) -> int:
        return path[1].idx  # (field, rank, ...): the rank's entry of the list

    def pick(path, leaf):
        field = getattr(path[0], "name", None)
        if field == "step":
            return counter
        mesh = pipeline.rank_meshes[rank_of(path)]
        key = path[-1]
        if isinstance(key, jax.tree_util.DictKey) and key.key in layout.buckets:
            D = mesh.shape[data] if data else 1
            extra = (data, D) if shard_over_data and D > 1 and field == "opt_state" else None
            return NamedSharding(mesh, layout.spec(key.key, pipeline.pipe_axis, extra))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(pick, state)


def compile_train_step(
    pipeline, optimizer, lr, state, batch, row_keys_seed=None, shard_over_data=False
):
    """Jits `train_step` (the only jit of a train step) and compiles it for these shapes.

    With `row_keys_seed` (a model with dropout), the step adds the batch's
    per-row keys from it (`with_row_keys`); `shard_over_data` splits the
    optimizer state over ``data`` (`state_shardings`).
    """
    if not pipeline.lowering_kind.one_program:  # the pieces run from the host
        return PerRankTrainStep(
            pipeline, optimizer, lr, state, batch, row_keys_seed, shard_over_data
        )
    shardings = state_shardings(state, pipeline, shard_over_data)
    keyed = batch
    if row_keys_seed is not None:
        keyed = jax.eval_shape(lambda b: with_row_keys(b, row_keys_seed, 0), batch)
    step = functools.partial(
        train_step,
        value_and_grad=pipeline.step_fn(keyed),
        optimizer=optimizer,
        lr=lr,
        row_keys_seed=row_keys_seed,
        batch_sharding=pipeline.batch_sharding,
        counted_rows=pipeline.layout.counted_rows(),
    )
    jitted = jax.jit(
        step,
        in_shardings=(shardings, pipeline.batch_sharding),
        out_shardings=(shardings, NamedSharding(pipeline.mesh, P())),
        donate_argnums=0,
    )
    return jitted.lower(state, batch).compile()


class PerRankTrainStep:
    """The train step under the per-rank lowering (``lowering="mpmd"``).

    Not one program: the pipeline's pieces run from the host
    (`jpipe.RankPrograms`), so the step is three calls, each jitted once
    here: the batch's dropout keys (when the model draws any), the
    pipeline's ``value_and_grad``, and the optimizer's update with the
    state donated. Called as `compile_train_step`'s result is:
    ``step(state, batch) -> (state, metrics)``.
    """

    def __init__(self, pipeline, optimizer, lr, state, batch, row_keys_seed, shard_over_data):
        self.pipeline = pipeline
        shardings = state_shardings(state, pipeline, shard_over_data)
        replicated = NamedSharding(pipeline.mesh, P())
        self._keys = None
        keyed = batch
        if row_keys_seed is not None:
            self._keys = jax.jit(
                lambda step, b: with_row_keys(b, row_keys_seed, step, pipeline.batch_sharding),
                out_shardings=pipeline.batch_sharding,
            )
            keyed = jax.eval_shape(lambda b: with_row_keys(b, row_keys_seed, 0), batch)
        if pipeline.rank_meshes is not None:
            self._update = _RankUpdates(pipeline, optimizer, lr, shardings)
        else:
            update = functools.partial(
                apply_gradients,
                optimizer=optimizer,
                lr=lr,
                counted_rows=pipeline.layout.counted_rows(),
            )
            self._update = jax.jit(
                update,
                in_shardings=(shardings, replicated, pipeline.param_sharding),
                out_shardings=(shardings, replicated),
                donate_argnums=0,  # the gradients have no output to reuse their buffers
            )
        keyed = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=pipeline.batch_sharding),
            keyed,
        )
        self.programs = pipeline.compile(state.params, keyed)

    def __call__(self, state, batch):
        if self._keys is not None:
            batch = self._keys(state.step, batch)
        loss, grads = self.pipeline.value_and_grad(state.params, batch)
        return self._update(state, loss, grads)

    def memory_analysis(self):
        """None: the step is many programs (`RankPrograms.compiled` has each one's)."""
        return None


class _RankUpdates:
    """The optimizer's update for ranks with meshes of their own (`Pipeline.rank_meshes`).

    Each rank's parameters and optimizer state live on its own devices, so
    the update is one jitted program per rank (`apply_gradients`' AdamW with
    that rank's decay rows, state donated), after the gradients' global norm
    is taken from each rank's sum of squares: the clipping and the reported
    ``grad_norm`` are those of every rank's gradients together, as under one
    mesh. Called as the jitted `apply_gradients` is:
    ``update(state, loss, grads) -> (state, metrics)``.

    Across processes each process updates its own ranks (the others' entries
    pass through, arrays with no shards here). Each publishes its ranks' sums
    of squares (float32 scalars) in the coordination service's key-value
    store, and every process adds all ranks' in rank order, as one process
    adds them on its device: every process clips by the same norm, the one
    process's run's to the bit. Not an XLA collective over a device of each
    process: on jax 0.12.1 such a program read back from the persistent
    compilation cache hung in its collective-permute (3 processes of 1, 2
    and 1 devices, resumed from a checkpoint), and the host waits for the
    step's gradients before the update anyway (`Courier.settle`).
    """

    def __init__(self, pipeline, optimizers, lr, shardings: TrainState):
        from jpipe.train.optimizer import clip_by_norm

        self.meshes = pipeline.rank_meshes
        self.lr = lr
        scalars = [NamedSharding(m, P()) for m in self.meshes]
        self._scalars = scalars
        self._here = [
            all(d.process_index == jax.process_index() for d in m.devices.flat) for m in self.meshes
        ]
        self._first = scalars[self._here.index(True)]
        self._steps = 0  # updates made, for the key-value store's keys

        counted = pipeline.layout.counted_rows()  # a replicated stage's copies once

        def squares(grads, r):
            return sum(
                jnp.sum(jnp.square(g.astype(jnp.float32)))
                for b, g in sorted(grads.items())
                if counted[b][r]
            )

        self._squares = [
            jax.jit(functools.partial(squares, r=r), out_shardings=sh)
            for r, sh in enumerate(scalars)
        ]

        def update(params, opt_state, grads, norm, optimizer):
            grads = clip_by_norm(grads, norm, optimizers.clip_norm)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._updates = [
            jax.jit(
                functools.partial(update, optimizer=optimizer),
                in_shardings=(
                    shardings.params[r],
                    shardings.opt_state[r],
                    pipeline.param_sharding[r],
                    scalars[r],
                ),
                out_shardings=(shardings.params[r], shardings.opt_state[r]),
                donate_argnums=(0, 1),
            )
            for r, optimizer in enumerate(optimizers.optimizers)
        ]

    def __call__(self, state: TrainState, loss, grads):
        partials = {
            r: f(g)
            for r, (f, g) in enumerate(zip(self._squares, grads, strict=True))
            if self._here[r]
        }
        if jax.process_count() > 1:
            total = jax.device_put(self._over_processes(partials), self._first)
        else:
            total = sum(jax.device_put(p, self._first) for p in partials.values())
        norm = jnp.sqrt(total)
        params, opt_state = [], []
        for r, update in enumerate(self._updates):
            if not self._here[r]:  # another process's rank: its entries pass through
                params.append(state.params[r])
                opt_state.append(state.opt_state[r])
                continue
            p, o = update(
                state.params[r],
                state.opt_state[r],
                grads[r],
                jax.device_put(norm, self._scalars[r]),
            )
            params.append(p)
            opt_state.append(o)
        metrics = {
            "loss": loss.astype(jnp.float32),
            "grad_norm": norm.astype(jnp.float32),
            "lr": jnp.asarray(self.lr(state.step), jnp.float32),
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    def _over_processes(self, partials: dict):
        """Every rank's sum of squares added in rank order (float32, as on a device), from
        this process's `partials` (``{rank: scalar}``) and the others' in the key-value store."""
        from jax._src import distributed

        client = distributed.global_state.client
        self._steps += 1
        base = f"jpipe/grad_squares/{self._steps}"
        for r, p in partials.items():
            client.key_value_set(f"{base}/{r}", np.asarray(p, np.float32).tobytes().hex())
        total = np.float32(0)
        for r in range(len(self.meshes)):
            if r in partials:
                value = np.asarray(partials[r], np.float32)
            else:
                text = client.blocking_key_value_get(f"{base}/{r}", 3_600_000)
                value = np.frombuffer(bytes.fromhex(text), np.float32)[0]
            total = np.float32(total + value)
        if self._steps > 2:  # every process has read those: a step's barrier came since
            for r in partials:
                client.key_value_delete(f"jpipe/grad_squares/{self._steps - 2}/{r}")
        return total
