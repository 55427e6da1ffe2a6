"""The trainer: a GPT, a pipeline schedule and a mesh, trained from a config.

`train(config, workdir)` is what ``train.py`` calls. It goes in one direction:

1. **Check.** The `ml_collections.ConfigDict` becomes a `TrainConfig`, typed
   frozen dataclasses that check every field. Then everything that can be
   refused without compiling is: the mesh is checked against the devices,
   the schedule is built and validated, the layers are split over its
   stages, the batch is checked against the microbatches and the data axis,
   and the corpus against the batch. A `ConfigError` names the field, the value, and what would be
   accepted. Nothing has been compiled yet.
2. **Build.** The model is cut into ``schedule.num_stages`` stages, the
   `jpipe.Pipeline` packs each rank's parameters (`jpipe._pack`), and the
   optimizer is built on the packed dict: optax AdamW with linear warm-up and
   cosine decay, weight decay masked off norms and biases (per bucket row:
   a bucket holds arrays of one size, whatever their shape), and
   `optax.clip_by_global_norm` over all the packed gradients. The packed
   arrays are sharded over ``pipe``, so that norm is taken over every stage's
   gradients together, not per stage; a bucket's padding rows (ranks without
   such an array) have zero gradients, add nothing to the norm, and stay zero
   under AdamW. The optimizer state is laid out like the parameters, so each
   device holds only its own stages' state.
3. **Compile.** `train_step` is jitted once, in `_compile_train_step`, with
   explicit shardings and the state donated. Evaluation uses the pipeline's
   own forward-only loss (`Pipeline.loss`).
4. **Run.** The loop dispatches step N before it reads step N-1's metrics, so
   the host never waits on the device except to evaluate, to checkpoint
   (only after checking the loss) and at the end. Batches come from
   `jpipe.data.Batches.batch_at(step, ...)`, a pure function of the step, so
   a resumed run sees exactly the batches an uninterrupted one would and
   gives the same losses, bit for bit. A NaN or infinite loss (or gradient
   norm) stops the run with `DivergedError` before any later checkpoint.

Reported: before the first step the schedule's chart, its simulated bubble
and peak live activations, and the compiled step's memory; during training a
progress bar (loss, tokens/s, step time); every ``eval_every`` steps the
held-out loss. ``DIR/metrics.jsonl`` gets one JSON object per logged step:
``step`` (optimizer steps done), ``loss`` (the training loss of that step's
batch), ``grad_norm``, ``lr``, ``step_time``, ``tokens_per_s``, and
``eval_loss`` on evaluated steps; a fresh run starts with a ``step: 0`` line
that holds only ``eval_loss``, the held-out loss before training. TensorBoard
gets the same when ``tensorboardX`` or TensorFlow is installed.

Several processes: each process builds only the rows of the global batch
that its devices hold (``jax.make_array_from_process_local_data``), every
process takes part in checkpoints (orbax coordinates them), and only process
0 prints, writes ``metrics.jsonl`` and TensorBoard.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpipe
from jpipe import data as data_lib
from jpipe._plan import LAYOUTS as TICK_LAYOUTS
from jpipe.checkpoint import Checkpoints
from jpipe.models import gpt
from jpipe.show import text_chart


class ConfigError(ValueError):
    """A config value that cannot work; raised before anything is compiled."""


class DivergedError(FloatingPointError):
    """The loss or the gradient norm became NaN or infinite."""


# ---------------------------------------------------------------------------
# Config: one conversion at the boundary, into frozen dataclasses.


def _fail(field: str, value, problem: str) -> ConfigError:
    return ConfigError(f"config.{field}={value!r}: {problem}")


def _check_int(field: str, value, minimum: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise _fail(field, value, f"must be {what}")
    return int(value)


def _check_float(field: str, value, lo: float, hi: float, *, lo_open=False, hi_open=False):
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise _fail(field, value, "must be a finite number")
    if (value <= lo if lo_open else value < lo) or (value >= hi if hi_open else value > hi):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise _fail(field, value, f"must be in {interval}")
    return float(value)


def _check_type(field: str, value, kind: type, accepted: str):
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise _fail(field, value, f"must be {accepted}")
    return value


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh: ``pipe`` ranks times ``data`` replicas."""

    pipe: int = 1
    data: int = 1

    def __post_init__(self):
        _check_int("mesh.pipe", self.pipe, 1)
        _check_int("mesh.data", self.data, 1)

    @property
    def size(self) -> int:
        return self.pipe * self.data


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how much is held out (see `jpipe.data`)."""

    path: str = ""
    max_bytes: int = 0
    eval_fraction: float = 0.1

    def __post_init__(self):
        _check_type("data.path", self.path, str, "a string (files/directories, comma-separated)")
        _check_int("data.max_bytes", self.max_bytes, 0)
        _check_float("data.eval_fraction", self.eval_fraction, 0, 1, lo_open=True, hi_open=True)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warm-up, cosine decay and global-norm clipping."""

    learning_rate: float
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    b1: float
    b2: float
    grad_clip_norm: float

    def __post_init__(self):
        _check_float("optimizer.learning_rate", self.learning_rate, 0, math.inf, lo_open=True)
        _check_int("optimizer.warmup_steps", self.warmup_steps, 0)
        _check_float("optimizer.min_lr_ratio", self.min_lr_ratio, 0, 1)
        _check_float("optimizer.weight_decay", self.weight_decay, 0, math.inf)
        _check_float("optimizer.b1", self.b1, 0, 1, hi_open=True)
        _check_float("optimizer.b2", self.b2, 0, 1, hi_open=True)
        _check_float("optimizer.grad_clip_norm", self.grad_clip_norm, 0, math.inf)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs, checked field by field.

    The fields are those of ``configs/default.py``, where each is explained.
    Cross-field checks that need the schedule or the devices happen in
    `prepare`.
    """

    schedule: str
    num_microbatches: int
    steps: int
    log_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    seed: int
    batch_size: int
    mesh: MeshConfig
    data: DataConfig
    model: gpt.GPTConfig
    optimizer: OptimizerConfig
    chunks: int = 0  # 0: the schedule's own default
    tick_layout: str = "auto"  # "auto", "unit" or "packed" (see jpipe.Pipeline)
    layers_per_stage: str = ""
    cpu_devices: int = 0
    profile: bool = False

    def __post_init__(self):
        _check_type(
            "schedule", self.schedule, str, "a schedule name, a .csv file or file.py:function"
        )
        if not self.schedule.strip():
            raise _fail("schedule", self.schedule, f"is empty; {_schedule_choices()}")
        _check_int("num_microbatches", self.num_microbatches, 1)
        _check_int("chunks", self.chunks, 0)
        if self.tick_layout not in TICK_LAYOUTS:
            raise _fail(
                "tick_layout", self.tick_layout, f"must be one of {', '.join(TICK_LAYOUTS)}"
            )
        _check_type("layers_per_stage", self.layers_per_stage, str, "a string such as '3,4,4,3'")
        _check_int("steps", self.steps, 1)
        _check_int("log_every", self.log_every, 1)
        _check_int("eval_every", self.eval_every, 0)
        _check_int("eval_batches", self.eval_batches, 1)
        _check_int("checkpoint_every", self.checkpoint_every, 0)
        _check_int("seed", self.seed, 0)
        _check_int("batch_size", self.batch_size, 1)
        _check_int("cpu_devices", self.cpu_devices, 0)
        _check_type("profile", self.profile, bool, "True or False")
        if self.model.vocab_size < data_lib.VOCAB_SIZE:
            raise _fail(
                "model.vocab_size",
                self.model.vocab_size,
                f"the byte-level corpus needs at least {data_lib.VOCAB_SIZE} token ids",
            )

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict | Mapping) -> TrainConfig:
        """Converts (and checks) a config such as ``configs/default.py``'s.

        Raises:
          ConfigError: a field is missing, unknown, or has a bad value.
        """
        raw = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
        sections = {
            "mesh": MeshConfig,
            "data": DataConfig,
            "optimizer": OptimizerConfig,
            "model": gpt.GPTConfig,
        }
        kwargs = _fields(cls, raw, "")
        for name, kind in sections.items():
            sub = kwargs.get(name)
            if not isinstance(sub, Mapping):
                raise _fail(name, sub, "must be a section (a ConfigDict)")
            sub_kwargs = _fields(kind, dict(sub), f"{name}.")
            try:
                kwargs[name] = kind(**sub_kwargs)
            except ConfigError:
                raise
            except (ValueError, TypeError) as e:  # GPTConfig's own checks
                raise ConfigError(f"config.{name}: {e}") from None
        return cls(**kwargs)


def _fields(kind: type, raw: dict, prefix: str) -> dict:
    """`raw` checked against `kind`'s fields: none unknown, none required missing."""
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config field(s) {', '.join('config.' + prefix + u for u in unknown)}; "
            f"the fields are {', '.join(prefix + f for f in fields)}"
        )
    required = dataclasses.MISSING
    missing = [
        n
        for n, f in fields.items()
        if n not in raw and f.default is required and f.default_factory is required
    ]
    if missing:
        raise ConfigError(
            f"config is missing {', '.join('config.' + prefix + m for m in missing)} "
            "(see configs/default.py for every field)"
        )
    return dict(raw)


def _schedule_choices() -> str:
    names = ", ".join(jpipe.registered_schedules())
    return f"accepted: a built-in name ({names}), a PyTorch .csv file, or path/to/file.py:function"


# ---------------------------------------------------------------------------
# Devices.


def use_cpu_devices(config: ml_collections.ConfigDict | Mapping) -> int | None:
    """Fakes enough CPU devices for the mesh, before JAX starts its backends.

    Call it first thing, before any JAX computation. It sets
    ``jax_num_cpu_devices`` to ``config.cpu_devices`` or, when that is 0, to
    ``mesh.pipe * mesh.data``. That setting only shapes the CPU backend: on a
    machine with a GPU or TPU the mesh is built from the accelerators and the
    CPU devices are never used, so nothing is faked there.

    Returns:
      The CPU device count set, or None when JAX had already started (the
      setting can then no longer change) or the config does not say.
    """
    get = config.get if isinstance(config, Mapping | ml_collections.ConfigDict) else None
    mesh = get("mesh") if get else None
    try:
        n = int(get("cpu_devices", 0) or 0) or int(mesh["pipe"]) * int(mesh["data"])
    except (TypeError, KeyError, ValueError):
        return None  # `train` reports the bad field properly
    if n < 1:
        return None
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already initialized: keep what there is
        return None
    return n


def _describe_devices(devices) -> str:
    kinds = sorted({d.platform for d in devices})
    text = f"{len(devices)} {'/'.join(kinds)} device{'s' if len(devices) != 1 else ''}"
    if kinds == ["cpu"] and len(devices) > 1:
        text += " (faked on the host's CPU cores: wall time shows no pipeline overlap)"
    return text


# ---------------------------------------------------------------------------
# Step 1: everything that can be refused before compiling.


class Prepared(NamedTuple):
    """What `prepare` checked and built; no arrays yet.

    Attributes:
      config: the checked config.
      schedule: the validated schedule.
      layers_per_stage: blocks per stage (``schedule.num_stages`` entries).
      mesh: the ``(pipe, data)`` mesh.
      train_data, eval_data: the corpus, served by step.
    """

    config: TrainConfig
    schedule: jpipe.Schedule
    layers_per_stage: tuple[int, ...]
    mesh: jax.sharding.Mesh
    train_data: data_lib.Batches
    eval_data: data_lib.Batches


def prepare(config: ml_collections.ConfigDict | Mapping | TrainConfig, devices=None) -> Prepared:
    """Checks a config against the schedule, the devices and the corpus.

    Nothing is compiled and no array is made on a device.

    Args:
      config: a ConfigDict such as ``configs/default.py``'s, or a `TrainConfig`.
      devices: the devices to build the mesh from; default `jax.devices()`.

    Raises:
      ConfigError: naming the field, its value and what would be accepted.
    """
    c = config if isinstance(config, TrainConfig) else TrainConfig.from_config(config)
    R, M, V = c.mesh.pipe, c.num_microbatches, c.chunks

    devices = list(jax.devices() if devices is None else devices)
    if c.mesh.size > len(devices):
        cpu_hint = (
            f"; on a CPU-only host set cpu_devices >= {c.mesh.size} (train.py does this "
            "unless JAX was already started)"
            if all(d.platform == "cpu" for d in devices)
            else ""
        )
        raise ConfigError(
            f"config.mesh.pipe={R} x config.mesh.data={c.mesh.data} needs {c.mesh.size} devices, "
            f"but only {len(devices)} are present ({_describe_devices(devices)}); "
            f"accepted: pipe * data <= {len(devices)}{cpu_hint}"
        )

    if c.schedule.lower().endswith(".csv") and os.path.isfile(c.schedule):
        # A file fixes its ranks and microbatches: name the field to change.
        from_file = jpipe.get_schedule(c.schedule)
        for field, value, needed in (
            ("mesh.pipe", R, from_file.num_ranks),
            ("num_microbatches", M, from_file.num_microbatches),
        ):
            if value != needed:
                raise _fail(
                    field,
                    value,
                    f"the schedule file {c.schedule} has {needed}; accepted: {field}={needed}",
                )
    setting = f"mesh.pipe={R}, num_microbatches={M}, chunks={V}"
    try:
        schedule = jpipe.get_schedule(c.schedule, R, M, V or None)
    except ValueError as e:
        raise _fail("schedule", c.schedule, f"{e} ({setting})") from None
    if schedule.num_ranks != R or schedule.num_microbatches != M:
        raise _fail(
            "schedule",
            c.schedule,
            f"has {schedule.num_ranks} ranks and {schedule.num_microbatches} microbatches; "
            f"set mesh.pipe={schedule.num_ranks} and num_microbatches={schedule.num_microbatches}",
        )
    try:
        jpipe.validate(schedule)
    except ValueError as e:
        raise _fail("schedule", c.schedule, f"is not a valid schedule ({setting}): {e}") from None

    S = schedule.num_stages
    try:
        layers = gpt.split_layers(c.model.num_layers, S, c.layers_per_stage or None)
    except ValueError as e:
        raise _fail(
            "layers_per_stage",
            c.layers_per_stage,
            f"{e} (the schedule has {S} stages; model.num_layers={c.model.num_layers})",
        ) from None

    rows = M * c.mesh.data
    if c.batch_size % rows:
        raise _fail(
            "batch_size",
            c.batch_size,
            f"must be divisible by num_microbatches ({M}) x mesh.data ({c.mesh.data}) = {rows}; "
            f"accepted: a multiple of {rows}, such as {max(rows, c.batch_size // rows * rows)}",
        )
    if c.batch_size % jax.process_count():
        raise _fail(
            "batch_size",
            c.batch_size,
            f"must be divisible by the number of processes ({jax.process_count()})",
        )

    try:
        train_data, eval_data = data_lib.make_datasets(
            path=c.data.path,
            max_bytes=c.data.max_bytes,
            eval_fraction=c.data.eval_fraction,
            seq_len=c.model.seq_len,
            batch_size=c.batch_size,
            seed=c.seed,
        )
    except ValueError as e:
        raise ConfigError(f"config.data: {e}") from None

    mesh = jpipe.make_mesh(R, c.mesh.data, devices)
    return Prepared(c, schedule, layers, mesh, train_data, eval_data)


# ---------------------------------------------------------------------------
# Step 2: the optimizer, on the packed parameters.


def learning_rate_schedule(c: OptimizerConfig, steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to the peak, then cosine decay to ``min_lr_ratio`` of it."""
    warmup = min(c.warmup_steps, steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=c.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1),
        end_value=c.learning_rate * c.min_lr_ratio,
    )


def packed_decay_rows(pipeline: jpipe.Pipeline, mask_fn=gpt.weight_decay_mask) -> dict:
    """Where weight decay applies in the packed parameters: ``{bucket: bool[R]}``.

    A bucket's row `r` is one array of rank `r` (or padding), and arrays of the
    same size share a bucket whatever their shape, so a bucket can hold a
    matrix on one rank and a bias on another: the rule is per row, not per
    bucket. Padding rows get False (they are zero either way).

    Args:
      pipeline: a pipeline whose parameters have been packed.
      mask_fn: the model's rule, a pytree of bools from one stage's parameter
        shapes (`jpipe.models.weight_decay_mask`: matrices and embeddings decay,
        norms and biases do not).
    """
    layout = pipeline.layout
    rows = {name: np.zeros(layout.num_ranks, bool) for name in layout.buckets}
    for s in range(len(layout.leaves)):
        decays = jax.tree.leaves(mask_fn(layout.stage_avals(s)))
        for (bucket, _, _), decay in zip(layout.leaves[s], decays, strict=True):
            rows[bucket][layout.stage_to_rank[s]] = bool(decay)
    return rows


def decay_by_row(weight_decay: float, rows: dict) -> optax.GradientTransformation:
    """`optax.add_decayed_weights`, with the mask given per bucket row.

    Adds ``weight_decay * params`` to the updates of the rows where `rows` is
    True; other rows pass through unchanged.
    """

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("decay_by_row needs the parameters: pass them to update()")
        out = {}
        for name, u in updates.items():
            mask = rows[name]
            if weight_decay == 0 or not mask.any():
                out[name] = u
            else:
                rate = (weight_decay * mask).astype(np.dtype(u.dtype))
                out[name] = u + rate.reshape((-1,) + (1,) * (u.ndim - 1)) * params[name]
        return out, state

    return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(
    c: OptimizerConfig, steps: int, decay_rows: dict
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with `learning_rate_schedule`.

    The AdamW is `optax.adamw`'s chain (scale by Adam, add decayed weights,
    scale by the learning rate) with the decay masked per bucket row.

    Args:
      c: the optimizer's config.
      steps: the run's length, for the cosine decay.
      decay_rows: ``{bucket: bool[R]}`` from `packed_decay_rows`.
    """
    clip = optax.clip_by_global_norm(c.grad_clip_norm) if c.grad_clip_norm else optax.identity()
    return optax.chain(
        clip,
        optax.scale_by_adam(b1=c.b1, b2=c.b2),
        decay_by_row(c.weight_decay, decay_rows),
        optax.scale_by_learning_rate(learning_rate_schedule(c, steps)),
    )


# ---------------------------------------------------------------------------
# Step 3: the train step, jitted in one place.


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
):
    """One optimizer step on one global batch; pure.

    Args:
      state: the current `TrainState`.
      batch: ``{"tokens", "targets"}``, int32 ``[batch_size, L]``.
      value_and_grad: ``(packed_params, batch) -> (loss, packed_grads)``, the
        pipeline's (`jpipe.Pipeline.step_fn`).
      optimizer: from `make_optimizer`.
      lr: the learning-rate schedule, only to report it.

    Returns:
      ``(new_state, metrics)``; metrics are float32 scalars: ``loss`` (mean
      over the batch, before the update), ``grad_norm`` (global, before
      clipping) and ``lr`` (the rate this update used).
    """
    loss, grads = value_and_grad(state.params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss.astype(jnp.float32),
        "grad_norm": optax.tree.norm(grads).astype(jnp.float32),
        "lr": jnp.asarray(lr(state.step), jnp.float32),
    }
    return TrainState(state.step + 1, params, opt_state), metrics


def state_shardings(state: TrainState, pipeline: jpipe.Pipeline) -> TrainState:
    """Packed arrays (parameters, their optimizer state) over ``pipe``; the rest replicated."""
    mesh = pipeline.mesh
    R = mesh.shape[pipeline.pipe_axis]
    buckets = pipeline.layout.buckets
    over_pipe = NamedSharding(mesh, P(pipeline.pipe_axis))
    replicated = NamedSharding(mesh, P())

    def pick(path, leaf):
        key = path[-1] if path else None
        if (
            isinstance(key, jax.tree_util.DictKey)
            and key.key in buckets
            and tuple(leaf.shape) == (R,) + tuple(buckets[key.key][0])
        ):
            return over_pipe
        return replicated

    return jax.tree_util.tree_map_with_path(pick, state)


def _compile_train_step(pipeline, optimizer, lr, state, batch):
    """Jits `train_step` (the only jit of a train step) and compiles it for these shapes."""
    shardings = state_shardings(state, pipeline)
    step = functools.partial(
        train_step, value_and_grad=pipeline.step_fn(batch), optimizer=optimizer, lr=lr
    )
    jitted = jax.jit(
        step,
        in_shardings=(shardings, pipeline.batch_sharding),
        out_shardings=(shardings, NamedSharding(pipeline.mesh, P())),
        donate_argnums=0,
    )
    return jitted.lower(state, batch).compile()


# ---------------------------------------------------------------------------
# Batches on devices.


def _process_rows(sharding, batch_size: int) -> tuple[int, int]:
    """Which block of the batch's rows this process's devices hold: ``(index, count)``."""
    shape = (batch_size, 1)
    spans = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0]
        spans.add((rows.start or 0, batch_size if rows.stop is None else rows.stop))
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    reached = lo
    for start, stop in sorted(spans):
        if start > reached:
            break
        reached = max(reached, stop)
    size = hi - lo
    if reached < hi or batch_size % size or lo % size:
        raise ValueError(
            f"this process's devices hold rows {sorted(spans)} of {batch_size}, which are not "
            "one of equal blocks; order the devices so each process's share of the data "
            "axis is contiguous"
        )
    return lo // size, batch_size // size


def device_batch(batches: data_lib.Batches, step: int, sharding) -> dict:
    """The global batch of `step` on the devices, each process loading only its rows."""
    index, count = _process_rows(sharding, batches.batch_size)
    local = batches.batch_at(step, index, count)
    return {
        name: jax.make_array_from_process_local_data(
            sharding, rows, (batches.batch_size,) + rows.shape[1:]
        )
        for name, rows in local.items()
    }


# ---------------------------------------------------------------------------
# Metrics: metrics.jsonl, TensorBoard, the terminal.


class _Metrics:
    """Writes records to ``metrics.jsonl`` and TensorBoard, on process 0 only."""

    def __init__(self, workdir: str, resume_step: int, enabled: bool):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tensorboard = None
        self.tensorboard_name = None
        if not enabled:
            return
        _truncate_metrics(self.path, resume_step)
        self.tensorboard, self.tensorboard_name = _tensorboard_writer(
            os.path.join(workdir, "tensorboard")
        )

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, float):
                    self.tensorboard.scalar(key, value, step)
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def _truncate_metrics(path: str, last_step: int) -> None:
    """Drops records past `last_step`: a resumed run writes those steps again."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
    if len(kept) != len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


class _ScalarWriter(NamedTuple):
    """The three calls `_Metrics` makes of a TensorBoard writer."""

    scalar: Callable  # (name, value, step)
    flush: Callable
    close: Callable


def _tensorboard_writer(logdir: str) -> tuple[_ScalarWriter | None, str | None]:
    """A writer and its library's name, or ``(None, None)`` when neither is installed."""
    try:
        from tensorboardX import SummaryWriter  # noqa: PLC0415 (optional)
    except ImportError:
        try:
            from flax.metrics.tensorboard import SummaryWriter  # noqa: PLC0415 (needs TensorFlow)
        except ImportError:
            return None, None
        writer = SummaryWriter(logdir)
        return _ScalarWriter(writer.scalar, writer.flush, writer.close), "TensorFlow"
    writer = SummaryWriter(logdir)
    return _ScalarWriter(writer.add_scalar, writer.flush, writer.close), "tensorboardX"


def _say(text: str = "") -> None:
    if jax.process_index() == 0:
        print(text, flush=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


# ---------------------------------------------------------------------------
# Profile: per-stage F, I, W on the real devices, fed to the simulator.


class StageTimes(NamedTuple):
    """Seconds per microbatch for each stage's pieces (medians of a few runs)."""

    F: tuple[float, ...]
    I: tuple[float, ...]
    W: tuple[float, ...]
    B: tuple[float, ...]


def _median_seconds(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_stages(
    pipeline: jpipe.Pipeline, params: dict, batch: dict, microbatch: dict, reps: int = 5
) -> StageTimes:
    """Times each stage's F, I and W pieces on one microbatch, on its rank's device.

    The pieces are the ones the compiled step runs (`Pipeline.stage_kernels`):
    F keeps the residuals, I computes the input gradient and the carry, W the
    weight gradient from them; B is I + W, as the program runs it.

    Args:
      pipeline: the pipeline, with parameters packed.
      params: the packed parameters.
      batch: a global batch (fixes the shapes the pieces were traced for).
      microbatch: one microbatch as one device sees it (host arrays).
      reps: timed runs per piece, after one warm-up.
    """
    params_list = pipeline.unpack(params)
    kernels = pipeline.stage_kernels(batch)
    stage_to_rank = pipeline.plan.stage_to_rank
    M = pipeline.num_microbatches
    F, I, W = [], [], []
    x = None
    for s, k in enumerate(kernels):
        device = pipeline.mesh.devices[stage_to_rank[s], 0]
        p = jax.device_put(params_list[s], device)
        inputs = jax.device_put(microbatch, device)
        x = None if x is None else jax.device_put(x, device)
        forward = jax.jit(k.forward)
        F.append(_median_seconds(forward, p, x, inputs, reps=reps))
        y, res = forward(p, x, inputs)
        if s == len(kernels) - 1:
            g = [jnp.full((), 1.0 / M, y[0].dtype)]
        else:
            g = [jnp.ones_like(leaf) for leaf in y]
        input_grad = jax.jit(k.input_grad)
        I.append(_median_seconds(input_grad, p, inputs, res, g, reps=reps))
        _, carry = input_grad(p, inputs, res, g)
        W.append(_median_seconds(jax.jit(k.weight_grad), p, inputs, res, carry, reps=reps))
        x = jax.tree.unflatten(k.y_tree, y)
    B = tuple(i + w for i, w in zip(I, W))
    return StageTimes(tuple(F), tuple(I), tuple(W), B)


def _profile(pipeline, compiled, state, batch, microbatch, reps: int = 5) -> None:
    """Prints measured stage times, the predicted step times and the measured one."""
    if jax.process_count() > 1:
        _say("profile: skipped, it runs every stage from one process (single-process runs only)")
        return
    times = measure_stages(pipeline, state.params, batch, microbatch, reps=reps)
    ms = lambda t: f"{t * 1e3:8.2f}"  # noqa: E731
    _say(f"profile: time of one microbatch on one device, ms (median of {reps} runs)")
    _say("  stage         F        I        W        B")
    for s in range(len(times.F)):
        _say(f"  {s:>5} {ms(times.F[s])} {ms(times.I[s])} {ms(times.W[s])} {ms(times.B[s])}")
    costs = jpipe.Costs(F=times.F, I=times.I, W=times.W, B=times.B)
    sim = jpipe.simulate(pipeline.schedule, costs)
    lockstep = pipeline.plan.predicted_time(costs)

    # The measured step runs on a copy, so the real state neither advances nor is donated.
    step_times = []
    for _ in range(reps + 1):
        scratch = jax.tree.map(lambda a: a.copy(), state)
        start = time.perf_counter()
        jax.block_until_ready(compiled(scratch, batch))
        step_times.append(time.perf_counter() - start)
    measured = statistics.median(step_times[1:])
    _say(
        f"  predicted step time, event simulation (perfect overlap): {sim.makespan * 1e3:9.2f} ms"
        f"  (bubble {sim.bubble_fraction:.1%})"
    )
    _say(
        f"  predicted step time, lock-step program (Plan.predicted_time): {lockstep * 1e3:9.2f} ms"
    )
    _say(
        f"  measured train step (median of {reps}, with the optimizer update):"
        f" {measured * 1e3:9.2f} ms"
    )
    if all(d.platform == "cpu" for d in list(pipeline.mesh.devices.flat)):
        _say(
            "  (fake CPU devices share the host's cores, so the measured step cannot overlap ranks)"
        )


# ---------------------------------------------------------------------------
# Step 4: the run.


class TrainResult(NamedTuple):
    """What a call to `train` did.

    Attributes:
      losses: ``{step: training loss}`` for every step run by this call (step =
        optimizer steps done, from 1; the loss is that step's batch's, before
        its update).
      eval_losses: ``{step: held-out loss}`` for every evaluation of this call.
      start_step: the step this call started from (0, or the checkpoint's).
      final_step: the step it reached.
      wall_seconds: the call's wall time, from start to end.
      step_seconds: the median time of a step, between consecutive steps.
      tokens_per_second: training tokens per second at that median.
    """

    losses: dict[int, float]
    eval_losses: dict[int, float]
    start_step: int
    final_step: int
    wall_seconds: float
    step_seconds: float | None
    tokens_per_second: float | None


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _layout_record(prepared: Prepared) -> dict:
    """What fixes the packed layout of the parameters, as JSON: a checkpoint must match it."""
    c = prepared.config
    model = dataclasses.asdict(c.model)
    del model["dtype"]  # the compute dtype does not change the parameters
    return {
        "model": model,
        "layers_per_stage": list(prepared.layers_per_stage),
        "stage_to_rank": list(prepared.schedule.stage_to_rank),
        "mesh.pipe": c.mesh.pipe,
    }


def _checkpoint_meta(pipeline: jpipe.Pipeline, prepared: Prepared) -> dict:
    """The checkpoint's ``meta`` item: the layout record, the buckets, and for people, the rest."""
    return {
        "layout": _layout_record(prepared),
        "buckets": {
            name: [list(shape), dtype]
            for name, (shape, dtype) in sorted(pipeline.layout.buckets.items())
        },
        "schedule": prepared.config.schedule,
        "mesh": [prepared.config.mesh.pipe, prepared.config.mesh.data],
    }


def _check_resumable(checkpoints: Checkpoints, step: int, prepared: Prepared) -> None:
    """Refuses a checkpoint whose parameters were laid out for another model or split."""
    saved = checkpoints.metadata(step).get("layout", {})
    wanted = _layout_record(prepared)
    differences = [
        f"{key}: {saved.get(key)!r} in the checkpoint, {wanted[key]!r} now"
        for key in wanted
        if saved.get(key) != wanted[key]
    ]
    if differences:
        raise ConfigError(
            f"the checkpoint of step {step} in {checkpoints.directory} was written for another "
            f"model or pipeline split ({'; '.join(differences)}); resume with that run's config "
            "(config.model, config.layers_per_stage, config.schedule, config.mesh.pipe), or give "
            "a new --workdir"
        )


def _evaluate(pipeline: jpipe.Pipeline, params: dict, eval_data, batches: int) -> float:
    """Mean held-out loss over `batches` fixed batches."""
    total = 0.0
    for i in range(batches):
        loss = pipeline.loss(params, device_batch(eval_data, i, pipeline.batch_sharding))
        total = total + loss
    return float(total) / batches


def train(
    config: ml_collections.ConfigDict | Mapping | TrainConfig,
    workdir: str,
    *,
    progress: bool = True,
) -> TrainResult:
    """Trains from `config`, resuming from the newest checkpoint in `workdir`.

    Args:
      config: a ConfigDict such as ``configs/default.py``'s, or a `TrainConfig`.
      workdir: where checkpoints, ``metrics.jsonl`` and TensorBoard logs go.
      progress: show a progress bar (process 0 only).

    Returns:
      A `TrainResult`.

    Raises:
      ConfigError: a bad config value, or a checkpoint in `workdir` written for
        another model or split; before anything is compiled.
      DivergedError: the loss or gradient norm became NaN or infinite; no
        checkpoint is written after the bad step.
    """
    wall_start = time.perf_counter()
    prepared = prepare(config)
    lead = jax.process_index() == 0
    workdir = os.path.abspath(workdir)
    if lead:
        os.makedirs(workdir, exist_ok=True)
    checkpoints = Checkpoints(os.path.join(workdir, "checkpoints"))
    try:
        return _run(prepared, workdir, checkpoints, lead, progress, wall_start)
    finally:
        checkpoints.close()


def _run(
    prepared: Prepared,
    workdir: str,
    checkpoints: Checkpoints,
    lead: bool,
    progress: bool,
    wall_start: float,
) -> TrainResult:
    c, schedule, mesh = prepared.config, prepared.schedule, prepared.mesh
    removed = checkpoints.remove_incomplete()
    start = checkpoints.latest_step()
    if start is not None:
        _check_resumable(checkpoints, start, prepared)  # before anything is compiled
        if start >= c.steps:
            _say(
                f"nothing to do: {checkpoints.directory} is at step {start}, config.steps={c.steps}"
            )
            return TrainResult({}, {}, start, start, time.perf_counter() - wall_start, None, None)

    model = gpt.make_stages(c.model, prepared.layers_per_stage)
    pipeline = jpipe.Pipeline(model.stages, schedule, mesh, tick_layout=c.tick_layout)

    params_list = model.init(c.seed)
    params = pipeline.pack(params_list)
    optimizer = make_optimizer(c.optimizer, c.steps, packed_decay_rows(pipeline))
    lr = learning_rate_schedule(c.optimizer, c.steps)
    del params_list
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
    state = jax.device_put(state, state_shardings(state, pipeline))

    if start is not None:
        buckets = checkpoints.metadata(start).get("buckets")
        if buckets != _checkpoint_meta(pipeline, prepared)["buckets"]:
            raise ConfigError(
                f"the checkpoint of step {start} in {checkpoints.directory} packs the parameters "
                "into other buckets (written by another version of jpipe?); give a new --workdir"
            )
        state = checkpoints.restore(start, state)
    start = int(start or 0)

    # -- what a person sees before the first step --
    sim = jpipe.simulate(schedule)
    _say(
        f"devices: {_describe_devices(list(mesh.devices.flat))}; mesh pipe={c.mesh.pipe} x "
        f"data={c.mesh.data}"
    )
    _say(
        f"model: {pipeline.layout.padding['used'] / 1e6:.2f}M parameters, "
        f"{c.model.num_layers} blocks as {prepared.layers_per_stage} over "
        f"{schedule.num_stages} stages; padding {pipeline.layout.padding['padding_fraction']:.1%}"
    )
    _say(text_chart(sim))
    _say(
        f"simulated (F=1, B=2): bubble {sim.bubble_fraction:.1%}, peak live activations per "
        f"rank {list(sim.peak_activations)} microbatches"
    )

    batch = device_batch(prepared.train_data, start, pipeline.batch_sharding)
    compile_start = time.perf_counter()
    compiled = _compile_train_step(pipeline, optimizer, lr, state, batch)
    memory = compiled.memory_analysis()
    line = f"compiled the train step in {time.perf_counter() - compile_start:.1f} s"
    if memory is not None:
        line += (
            f"; per device: arguments {_mib(memory.argument_size_in_bytes)}, "
            f"temporaries {_mib(memory.temp_size_in_bytes)}"
        )
    _say(line)
    if c.profile:
        rows = c.batch_size // c.num_microbatches // c.mesh.data
        microbatch = {k: v[:rows] for k, v in prepared.train_data.batch_at(0).items()}
        _profile(pipeline, compiled, state, batch, microbatch)

    if removed:
        _say(f"removed unfinished checkpoint(s) {removed}")
    if start:
        _say(f"resuming from the checkpoint of step {start} in {checkpoints.directory}")
    # Records past the checkpoint are rewritten by this run; a fresh start
    # (no checkpoint) rewrites them all, step 0 included.
    metrics = _Metrics(workdir, start if start else -1, lead)
    if lead and metrics.tensorboard_name:
        _say(f"TensorBoard ({metrics.tensorboard_name}): {os.path.join(workdir, 'tensorboard')}")

    result = _loop(
        prepared, pipeline, compiled, state, batch, start, checkpoints, metrics, lead and progress
    )
    metrics.close()
    losses, eval_losses, step_times = result
    step_seconds = statistics.median(step_times) if step_times else None
    tokens = c.batch_size * c.model.seq_len
    tps = tokens / step_seconds if step_seconds else None
    wall = time.perf_counter() - wall_start
    if len(eval_losses) > 1:
        first, last = min(eval_losses), max(eval_losses)
        _say(
            f"held-out loss: {eval_losses[first]:.4f} at step {first} -> "
            f"{eval_losses[last]:.4f} at step {last}"
        )
    elif eval_losses:
        ((step, loss),) = eval_losses.items()
        _say(f"held-out loss at step {step}: {loss:.4f}")
    if step_seconds:
        _say(
            f"median step {step_seconds * 1e3:.1f} ms, {tps:,.0f} tokens/s; "
            f"wall time {wall:.1f} s; metrics in {metrics.path}"
        )
    final = max(losses) if losses else start
    return TrainResult(losses, eval_losses, start, final, wall, step_seconds, tps)


def _loop(prepared, pipeline, compiled, state, batch, start, checkpoints, metrics, show_bar):
    """The training loop; returns ``(losses, eval_losses, step_times)``."""
    from tqdm import tqdm  # noqa: PLC0415 (only the loop needs it)

    c = prepared.config
    tokens = c.batch_size * c.model.seq_len
    losses: dict[int, float] = {}
    eval_losses: dict[int, float] = {}
    step_times: list[float] = []
    meta = _checkpoint_meta(pipeline, prepared)

    bar = None

    def evaluate(step: int) -> float:
        loss = _evaluate(pipeline, state.params, prepared.eval_data, c.eval_batches)
        eval_losses[step] = loss
        text = f"step {step}: held-out loss {loss:.4f}"
        if bar is not None and show_bar:
            bar.write(text)  # above the progress bar
        else:
            _say(text)
        return loss

    if start == 0:
        metrics.write({"step": 0, "eval_loss": evaluate(0)})
    bar = tqdm(
        total=c.steps,
        initial=start,
        disable=not show_bar,
        dynamic_ncols=True,
        unit="step",
        file=sys.stdout,
    )

    window = {"seconds": 0.0, "steps": 0}
    clock = [time.perf_counter()]

    def finish(step: int, step_metrics: dict) -> dict:
        """Reads a dispatched step's metrics (waiting for it) and checks them."""
        values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
        now = time.perf_counter()
        seconds, clock[0] = now - clock[0], now
        if not (math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])):
            last = checkpoints.latest_step()
            where = (
                f"the last good checkpoint (step {last}) in {checkpoints.directory} is untouched"
                if last is not None
                else "no checkpoint was written"
            )
            raise DivergedError(
                f"step {step}: the loss is {values['loss']} and the gradient norm "
                f"{values['grad_norm']}; stopping. {where}. Try a lower "
                f"optimizer.learning_rate (now {c.optimizer.learning_rate}) or "
                f"optimizer.grad_clip_norm (now {c.optimizer.grad_clip_norm})"
            )
        losses[step] = values["loss"]
        step_times.append(seconds)
        window["seconds"] += seconds
        window["steps"] += 1
        record = {"step": step, **values, "step_time": seconds, "tokens_per_s": tokens / seconds}
        bar.update(1)
        if _due(step, c.log_every) or step == c.steps:
            per_step = window["seconds"] / window["steps"]
            bar.set_postfix(
                loss=f"{values['loss']:.4f}",
                tok_s=f"{tokens / per_step:,.0f}",
                step_ms=f"{per_step * 1e3:.0f}",
            )
            window.update(seconds=0.0, steps=0)
        return record

    try:
        pending = None
        for index in range(start, c.steps):
            if index != start:
                batch = device_batch(prepared.train_data, index, pipeline.batch_sharding)
            state, step_metrics = compiled(state, batch)  # dispatched; runs while we read the last
            if pending is not None:
                record = finish(*pending)
                if _due(record["step"], c.log_every):
                    metrics.write(record)
            pending = (index + 1, step_metrics)
            step = index + 1
            evaluating = _due(step, c.eval_every) or step == c.steps
            saving = _due(step, c.checkpoint_every) or step == c.steps
            if evaluating or saving:
                record = finish(*pending)  # waits for this step; raises before any save
                pending = None
                if evaluating:
                    record["eval_loss"] = evaluate(step)
                if evaluating or _due(step, c.log_every) or step == c.steps:
                    metrics.write(record)
                if saving:
                    checkpoints.save(step, state, meta)
                clock[0] = time.perf_counter()  # do not count evaluation or saving as step time
    finally:
        bar.close()
    return losses, eval_losses, step_times
