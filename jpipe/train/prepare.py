"""Step 1 of a run: everything that can be refused before compiling.

`prepare` checks a config against the devices, the schedule (built and
validated once), the layer split, the batch and the corpus, and builds the
mesh. Nothing is compiled and no array is made on a device.

Two things are decided here for a model from a file
(``config.model.name="file.py:build"``), whose builder gets
``config.model``'s fields as they are:

- Precision. A registered model (``gpt``, ``llama``) reads
  ``config.model.dtype`` itself. For a builder from a file the trainer
  applies ``config.model.dtype`` as a policy around each stage (`in_dtype`):
  the parameters stay float32 (so do the optimizer and the checkpoints),
  each stage gets them, its input and the batch's floating leaves cast to
  the dtype, and the last stage's loss is returned as float32 (computed in
  the dtype: a builder that wants a float32 softmax or norms keeps
  ``dtype`` out of ``config.model`` and reads a field of its own).
- ``config.init_from``: the parameters a run starts from, read and checked
  leaf by leaf against the model's structure and shapes
  (`jpipe.train.export.initial_params`) before anything is compiled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import jpipe
from jpipe import models
from jpipe.lower.interface import lowering_kind
from jpipe.models import registry
from jpipe.train import data as data_lib
from jpipe.train import export, sources, tokens
from jpipe.train.config import ConfigError, TrainConfig, config_error


class Prepared(NamedTuple):
    """What `prepare` checked and built; no arrays yet.

    Attributes:
      config: the checked config.
      schedule: the validated schedule.
      layers_per_stage: blocks per stage (``schedule.num_stages`` entries).
      mesh: the ``(pipe, data, fsdp, tensor)`` mesh, or one mesh per rank
        (`jpipe.make_rank_meshes`) under the per-rank lowering or with
        ``mesh.tensor_per_rank`` (`TrainConfig.rank_tensors`).
      train_data, eval_data: the batches, served by step (`data.Batches`,
        `tokens.GrainBatches` or `sources.SourceBatches`).
      model: the model cut into the schedule's stages (`jpipe.models.build_model`;
        for a builder from a file, with ``config.model.dtype`` applied by `in_dtype`).
      init_params: ``config.init_from``'s parameters, one pytree per stage of
        host arrays checked against the model; None to start from ``model.init``.
    """

    config: TrainConfig
    schedule: jpipe.Schedule
    layers_per_stage: tuple[int, ...]
    mesh: jax.sharding.Mesh | list[jax.sharding.Mesh]  # a list: one per rank
    train_data: data_lib.Batches | tokens.GrainBatches | sources.SourceBatches
    eval_data: data_lib.Batches | tokens.GrainBatches | sources.SourceBatches
    model: models.StagedModel | None = None
    init_params: list | None = None


def prepare(
    config: ml_collections.ConfigDict | Mapping | TrainConfig,
    devices=None,
    *,
    shapes_only: bool = False,
) -> Prepared:
    """Checks a config against the schedule, the devices and the corpus.

    Nothing is compiled and no array is made on a device.

    Args:
      config: a ConfigDict such as ``configs/default.py``'s, or a `TrainConfig`.
      devices: the devices to build the mesh from; default `jax.devices()`,
        ordered by ``(process_index, id)``.
      shapes_only: for a step built from shapes (`jpipe.train.compile_only`):
        the text corpus is not read (``train_data`` and ``eval_data`` are
        None; its batches' shapes are known, `batch_shapes`) and
        ``config.init_from`` is not opened (``init_params`` is None). A
        ``config.data.source`` is still made (it opens its data only when
        asked for a batch).

    Raises:
      ConfigError: naming the field, its value and what would be accepted.
    """
    c = config if isinstance(config, TrainConfig) else TrainConfig.from_config(config)
    devices = _enough_devices(c, devices)
    _check_tensor_degrees(c)
    schedule = _checked_schedule(c)
    model = _checked_model(c, schedule.num_stages)
    layers = tuple(model.layers_per_stage)
    init_params = None
    if c.init_from and not shapes_only:
        init_params = export.initial_params(c.init_from, model, c)
    _check_batch(c)
    _check_slices(c, schedule, model)
    if shapes_only and not c.data.source:  # the text corpus: shapes known without reading it
        train_data = eval_data = None
    else:
        train_data, eval_data = make_data(c)
        if schedule.slices:  # each slice reads its place in the sequence from the batch
            train_data = data_lib.WithPositions(train_data)
            eval_data = data_lib.WithPositions(eval_data)
    mesh = _make_mesh(c, devices)
    return Prepared(c, schedule, layers, mesh, train_data, eval_data, model, init_params)


def _enough_devices(c: TrainConfig, devices) -> list:
    """`devices` as a list (default: a process's devices side by side, see
    `jpipe.make_mesh`), refusing fewer than ``config.mesh`` needs."""
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = list(devices)
    if c.mesh.size <= len(devices):
        return devices
    cpu_hint = (
        f"; on a CPU-only host set cpu_devices >= {c.mesh.size} (train.py does this "
        "unless JAX was already started)"
        if all(d.platform == "cpu" for d in devices)
        else ""
    )
    axes = [("pipe", c.mesh.pipe), ("data", c.mesh.data)]
    axes += [(a, n) for a, n in (("fsdp", c.mesh.fsdp), ("tensor", c.mesh.tensor)) if n > 1]
    if c.mesh.rank_tensors is not None:
        raise ConfigError(
            f"config.mesh.tensor_per_rank={c.mesh.tensor_per_rank!r} x config.mesh.data="
            f"{c.mesh.data} x config.mesh.fsdp={c.mesh.fsdp} needs {c.mesh.size} devices, but "
            f"only {len(devices)} are present ({jpipe.describe_devices(devices)}); accepted: "
            f"the sum of tensor_per_rank * data * fsdp <= {len(devices)}{cpu_hint}"
        )
    raise ConfigError(
        f"{' x '.join(f'config.mesh.{a}={n}' for a, n in axes)} needs {c.mesh.size} "
        f"devices, but only {len(devices)} are present ({jpipe.describe_devices(devices)}); "
        f"accepted: {' * '.join(a for a, _ in axes)} <= {len(devices)}{cpu_hint}"
    )


def _check_tensor_degrees(c: TrainConfig) -> None:
    """Refuses a tensor degree (every rank's) that does not divide the model's heads and MLP."""
    for t in sorted(set(c.mesh.rank_tensors or (c.mesh.tensor,))):
        heads, d_ff = getattr(c.model, "num_heads", 1), getattr(c.model, "d_ff", 1)
        kv_heads = getattr(c.model, "num_kv_heads", None)  # a Llama's
        if isinstance(kv_heads, int) and kv_heads % t:
            raise config_error(
                "mesh.tensor",
                t,
                f"must divide model.num_kv_heads={kv_heads} (each device of the tensor axis holds "
                "whole groups of key/value heads)",
            )
        if isinstance(heads, int) and isinstance(d_ff, int) and (heads % t or d_ff % t):
            raise config_error(
                "mesh.tensor",
                t,
                f"must divide model.num_heads={c.model.num_heads} and model.d_ff={c.model.d_ff} "
                "(each device of the tensor axis runs whole heads and an equal part of the MLP)",
            )


def _checked_schedule(c: TrainConfig) -> jpipe.Schedule:
    """``config.schedule`` built (or read) and validated, with the config's ranks and
    microbatches."""
    R, M, V = c.mesh.pipe, c.num_microbatches, c.chunks
    setting = f"mesh.pipe={R}, num_microbatches={M}, chunks={V}"
    from_file = c.schedule.lower().endswith(".csv") and os.path.isfile(c.schedule)
    try:
        # A file fixes its own ranks and microbatches: read them, then name the field to change.
        schedule = jpipe.get_schedule(c.schedule, *(() if from_file else (R, M, V or None)))
    except ValueError as e:
        raise config_error("schedule", c.schedule, f"{e} ({setting})") from None
    for field, value, needed in (
        ("mesh.pipe", R, schedule.num_ranks),
        # Sliced (Seq1F1B), num_microbatches counts sequences; the lists, their slices.
        ("num_microbatches", M, schedule.num_sequences),
    ):
        if value != needed:
            raise config_error(
                field,
                value,
                f"the schedule {c.schedule} has {needed}; accepted: {field}={needed}",
            )
    try:
        jpipe.validate(schedule)
    except ValueError as e:
        raise config_error(
            "schedule", c.schedule, f"is not a valid schedule ({setting}): {e}"
        ) from None
    return schedule


def _checked_model(c: TrainConfig, S: int) -> models.StagedModel:
    """``config.model`` cut into `S` stages (stage functions only: no arrays are made).

    The layer split is checked first where the model has an integer
    ``num_layers``; a builder from a file gets ``config.model.dtype`` applied
    (`in_dtype`).
    """
    num_layers = getattr(c.model, "num_layers", None)
    if isinstance(num_layers, int):
        try:
            models.split_layers(num_layers, S, c.layers_per_stage or None)
        except ValueError as e:
            raise config_error(
                "layers_per_stage",
                c.layers_per_stage,
                f"{e} (the schedule has {S} stages; model.num_layers={num_layers})",
            ) from None
    tensor_axis = "tensor" if c.mesh.max_tensor > 1 else None
    try:
        model = models.build_model(
            c.model_name, registry.BuildArgs(c.model, S, c.layers_per_stage, tensor_axis)
        )
    except ValueError as e:
        said = str(e) if "the schedule has" in str(e) else f"{e} (the schedule has {S} stages)"
        raise config_error("model.name", c.model_name, said) from None
    dtype = getattr(c.model, "dtype", "float32")
    if registry.is_file_spec(c.model_name) and dtype != "float32":
        if dtype not in ("bfloat16", "float16"):
            raise config_error("model.dtype", dtype, "must be 'float32', 'bfloat16' or 'float16'")
        model = in_dtype(model, dtype)
    return model


def _check_slices(c: TrainConfig, schedule, model: models.StagedModel) -> None:
    """Refuses a sliced schedule (Seq1F1B) where the run cannot take it: the SPMD
    lowering, a model without slice carries, different tensor degrees per rank."""
    if not schedule.slices:
        return
    why = None
    if lowering_kind(c.lowering).one_program:
        why = "the SPMD program does not run sequence slices yet: set config.lowering='mpmd'"
    elif model.carries is None:
        why = (
            f"the model {c.model_name} does not take sequence slices (its StagedModel has "
            "no carries: the GPT and Llama do, with scan_layers off)"
        )
    elif c.mesh.rank_tensors:
        why = "sequence slices take one tensor degree for every rank (mesh.tensor), for now"
    elif getattr(c.model, "scan_layers", False) or getattr(c.model, "sequence_parallel", False):
        why = "scan_layers and sequence_parallel do not take sequence slices yet: set them False"
    elif getattr(c.model, "dropout", 0.0):
        # A row's key would draw the same mask for each of its slices.
        why = "dropout does not take sequence slices yet: set model.dropout=0"
    if why is not None:
        raise config_error("schedule", c.schedule, f"cuts each sequence into slices; {why}")


def _check_batch(c: TrainConfig) -> None:
    """Refuses a batch that does not split into the microbatches, replicas and processes
    (those of a run with one mesh), and
    the text corpus for a model without an integer ``seq_len``."""
    M = c.num_microbatches
    rows = M * c.mesh.replicas
    if c.batch_size % rows:
        raise config_error(
            "batch_size",
            c.batch_size,
            f"must be divisible by num_microbatches ({M}) x mesh.data ({c.mesh.data})"
            + (f" x mesh.fsdp ({c.mesh.fsdp})" if c.mesh.fsdp > 1 else "")
            + f" = {rows}; "
            f"accepted: a multiple of {rows}, such as {max(rows, c.batch_size // rows * rows)}",
        )
    # Processes share the batch's rows, but with a mesh per rank each loads it whole.
    if c.batch_size % jax.process_count() and c.rank_tensors is None:
        raise config_error(
            "batch_size",
            c.batch_size,
            f"must be divisible by the number of processes ({jax.process_count()})",
        )
    if not c.data.source and not isinstance(getattr(c.model, "seq_len", None), int):
        raise config_error(
            "data.source",
            c.data.source,
            f"is the text corpus, whose windows are config.model.seq_len tokens long, but the "
            f"model {c.model_name} has no integer seq_len; give config.model.seq_len or a "
            "data source of your own (config.data.source=path/to/file.py:function)",
        )


def _make_mesh(c: TrainConfig, devices: list):
    """The ``(pipe, data, fsdp, tensor)`` mesh over `devices`, or with
    `TrainConfig.rank_tensors` one mesh per rank."""
    R = c.mesh.pipe
    if c.mesh.across_hosts is not None:
        try:
            return jpipe.make_mesh(
                R,
                c.mesh.data,
                devices,
                fsdp=c.mesh.fsdp,
                tensor=c.mesh.tensor,
                across_hosts=c.mesh.across_hosts,
            )
        except ValueError as e:
            raise config_error(
                "mesh.pipe_hosts" if c.mesh.pipe_hosts else "mesh.data_hosts",
                c.mesh.pipe_hosts or c.mesh.data_hosts,
                f"{e} (mesh.pipe={R}, mesh.data={c.mesh.data}, pipe_hosts={c.mesh.pipe_hosts}, "
                f"data_hosts={c.mesh.data_hosts})",
            ) from None
    if c.rank_tensors is not None:  # one mesh per rank (the per-rank lowering's default)
        _check_hosts(c)
        return jpipe.make_rank_meshes(
            [{"data": c.mesh.data, "fsdp": c.mesh.fsdp, "tensor": t} for t in c.rank_tensors],
            devices,
        )
    return jpipe.make_mesh(R, c.mesh.data, devices, fsdp=c.mesh.fsdp, tensor=c.mesh.tensor)


def _check_hosts(c: TrainConfig) -> None:
    """Refuses a process whose devices are not those its plan's host has.

    The ranks take the devices in process order (`jpipe.make_rank_meshes`), so a
    host started out of the plan's order, or with other devices, would put
    ranks on the wrong kind of device or across two processes.
    """
    if not c.plan or jax.process_count() == 1:
        return
    hosts = jpipe.planner.read_plan_file(c.plan).process_devices
    me, have = jax.process_index(), len(jax.local_devices())
    if hosts and len(hosts) == jax.process_count() and hosts[me] != have:
        raise config_error(
            "plan",
            c.plan,
            f"gives process {me} {hosts[me]} devices (its 'processes' entry {me}), but this "
            f"process has {have}; start process i on the host of the plan's processes[i], "
            "with its devices",
        )


def check_row_keys(prepared: Prepared) -> None:
    """Refuses a model whose stages read per-row keys from another batch leaf than the trainer's.

    Raises:
      ConfigError: naming ``config.model.name`` and the leaf.
    """
    from jpipe.train.step import ROW_KEYS

    c, model = prepared.config, prepared.model
    if model.keys not in (None, ROW_KEYS):
        raise ConfigError(
            f"config.model.name={c.model_name!r}: its stages read per-row keys from the batch "
            f"leaf {model.keys!r}, but the trainer adds them as {ROW_KEYS!r}; build the model "
            f"with keys={ROW_KEYS!r}"
        )


class Built(NamedTuple):
    """Step 2 of a run (`build`): what the train step is made of.

    Attributes:
      pipeline: the model's stages, the schedule and the mesh (`jpipe.Pipeline`).
      optimizer: the optax optimizer of the packed parameters (with a mesh per
        rank, `jpipe.train.optimizer.RankOptimizers`).
      lr: the learning-rate schedule.
      state: the `jpipe.train.step.TrainState`, placed by its shardings
        (`jpipe.train.step.state_shardings`): arrays, or with ``shapes_only``
        `jax.ShapeDtypeStruct` s carrying those shardings.
    """

    pipeline: jpipe.Pipeline
    optimizer: object
    lr: object
    state: object


def build(prepared: Prepared, *, shapes_only: bool = False) -> Built:
    """Step 2: the pipeline, its packed parameters, the optimizer and the train state.

    The parameters are ``config.init_from``'s (`Prepared.init_params`) or
    made by `jpipe.Pipeline.init` where they live (no device or host holds
    the whole model). With `shapes_only`, nothing is made: the parameters
    and the optimizer's state are shapes with the shardings training would
    give them (`jax.eval_shape`), for a step compiled from shapes alone.
    """
    from jpipe.train import optimizer as optimizer_lib
    from jpipe.train.step import TrainState, state_shardings

    c, model = prepared.config, prepared.model
    carries = None
    if prepared.schedule.slices:  # each carry as one device holds it, for one slice's rows
        rows = c.batch_size // prepared.schedule.num_sequences // c.mesh.replicas
        tokens = next(iter(batch_shapes(prepared, None).values())).shape[1]
        carries = model.carries(rows, tokens, c.mesh.tensor)
    pipeline = jpipe.Pipeline(
        model.stages,
        prepared.schedule,
        prepared.mesh,
        tick_layout=c.tick_layout,
        lowering=c.lowering,
        carries=carries,
    )
    key = jax.random.key(c.seed)
    if shapes_only:
        shapes = jax.eval_shape(model.init, key)
        specs = model.specs(shapes) if model.specs is not None else None
        params = _packed_shapes(pipeline, model, key, shapes, specs)
    else:
        specs = model.specs(jax.eval_shape(model.init, key)) if model.specs is not None else None
        if prepared.init_params is not None:  # config.init_from, checked by prepare
            params = pipeline.pack(prepared.init_params, specs)
        else:
            params = pipeline.init(model.init, key, specs)
    if pipeline.rank_meshes is not None:  # one dict per rank on its own mesh: one AdamW each
        optimizer = optimizer_lib.per_rank_optimizers(c.optimizer, c.steps, pipeline)
    else:
        optimizer = optimizer_lib.make_optimizer(
            c.optimizer,
            c.steps,
            optimizer_lib.packed_decay_rows(pipeline),
            counted_rows=pipeline.layout.counted_rows(),
        )
    lr = optimizer_lib.learning_rate_schedule(c.optimizer, c.steps)

    def make_state(p):
        return TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p))

    zero1 = c.optimizer.shard_over_data
    if shapes_only:
        state = jax.eval_shape(make_state, params)
        state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            state,
            state_shardings(state, pipeline, zero1),
        )
    else:
        state = make_state(params)
        shardings = state_shardings(state, pipeline, zero1)
        if pipeline.rank_meshes is not None and jax.process_count() > 1:
            # The step counter has a copy in each process (`Pipeline.processes_sharding`):
            # each places its own (`device_put` would compare them with a collective
            # that fails where processes hold different numbers of devices).
            zero = np.zeros((), np.int32)
            count = jax.make_array_from_callback((), shardings.step, lambda _: zero)
            rest = jax.device_put(state._replace(step=None), shardings._replace(step=None))
            state = rest._replace(step=count)
        else:
            state = jax.device_put(state, shardings)
    return Built(pipeline, optimizer, lr, state)


def _packed_shapes(pipeline: jpipe.Pipeline, model, key, shapes, specs):
    """The packed parameters as shapes with their shardings (`Pipeline.packed_shapes`).

    With a mesh per rank, one dict per rank of its own buckets, as
    `Pipeline.init` would make them (its layout is set by `init_programs`,
    which makes nothing).
    """
    if pipeline.rank_meshes is None:
        return pipeline.packed_shapes(shapes, specs)
    pipeline.init_programs(model.init, key, specs)  # sets the layout; runs nothing
    layout, shardings = pipeline.layout, pipeline.param_sharding
    return [
        {
            b: jax.ShapeDtypeStruct(
                (1,) + tuple(layout.buckets[b][0]), layout.buckets[b][1], sharding=shardings[r][b]
            )
            for b in layout.rank_buckets(r)
        }
        for r in range(layout.num_ranks)
    ]


def batch_shapes(prepared: Prepared, sharding) -> dict:
    """The global batch's leaves as shapes with `sharding`, without reading the text corpus.

    The text corpus gives ``{"tokens", "targets"}``, int32 ``[batch_size,
    seq_len]``; a ``config.data.source`` is asked for its first batch (the
    only data this reads), whose leaves' trailing shapes and dtypes the
    trainer keeps for every step.
    """
    c = prepared.config
    if prepared.train_data is None or not c.data.source:
        shape, dtype = (c.batch_size, c.model.seq_len), np.dtype(np.int32)
        names = ("tokens", "targets") + (("positions",) if prepared.schedule.slices else ())
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for k in names}
    try:
        first = prepared.train_data.batch_at(0, 0, 1)
    except ValueError as e:
        raise ConfigError(f"config.data: {e}") from None
    return {
        k: jax.ShapeDtypeStruct((c.batch_size,) + v.shape[1:], v.dtype, sharding=sharding)
        for k, v in first.items()
    }


def in_dtype(model: models.StagedModel, dtype: str) -> models.StagedModel:
    """`model` computing in `dtype` from float32 parameters (the policy of the module docstring).

    Each stage gets its parameters, its input and the batch's floating leaves
    cast to `dtype`; the last stage's output (its loss, or a
    `jpipe.WeightedLoss`) is cast to float32. Integer leaves (labels, tokens,
    row keys) are left alone. Gradients reach the float32 parameters through
    the casts, so the optimizer and the checkpoints stay float32.
    """
    low = jnp.dtype(dtype)
    last = len(model.stages) - 1

    def cast(tree, to):
        def one(a):
            if isinstance(a, jax.Array | np.ndarray) and jnp.issubdtype(a.dtype, jnp.floating):
                return a.astype(to)
            return a

        return jax.tree.map(one, tree)

    def wrap(stage, s):
        def wrapped(params, x, inputs):
            y = stage(cast(params, low), cast(x, low), cast(inputs, low))
            return cast(y, jnp.float32) if s == last else y

        wrapped.__name__ = f"{getattr(stage, '__name__', 'stage')}_in_{dtype}"
        return wrapped

    stages = tuple(wrap(f, s) for s, f in enumerate(model.stages))

    def loss(params_list, batch):
        out = jpipe.run_stages(stages, params_list, batch)
        return out.total / out.weight if isinstance(out, jpipe.WeightedLoss) else out

    return model._replace(stages=stages, loss=loss)


def make_data(c: TrainConfig, batch_size: int | None = None) -> tuple:
    """The train and held-out batches ``config.data`` names, served by step.

    Args:
      c: the checked config.
      batch_size: rows of each global batch; default ``config.batch_size``
        (`jpipe.testing` asks for the rows of its check).

    Raises:
      ConfigError: naming ``config.data`` and what its source said.
    """
    batch_size = batch_size or c.batch_size
    try:
        if c.data.source:
            return _source_batches(c, batch_size)
        if c.data.tokenizer == "bpe":
            return tokens.make_datasets(
                path=c.data.path,
                max_bytes=c.data.max_bytes,
                eval_fraction=c.data.eval_fraction,
                vocab_size=c.model.vocab_size,
                seq_len=c.model.seq_len,
                batch_size=batch_size,
                seed=c.seed,
            )
        return data_lib.make_datasets(
            path=c.data.path,
            max_bytes=c.data.max_bytes,
            eval_fraction=c.data.eval_fraction,
            seq_len=c.model.seq_len,
            batch_size=batch_size,
            seed=c.seed,
        )
    except ValueError as e:
        raise ConfigError(f"config.data: {e}") from None


def _source_batches(
    c: TrainConfig, batch_size: int
) -> tuple[sources.SourceBatches, sources.SourceBatches]:
    """The train and eval batches of ``config.data.source``'s function."""
    fn = sources.get_source(c.data.source)
    fields = {f: getattr(c.data, f) for f in ("path", "max_bytes", "eval_fraction", "source")}
    options = ml_collections.FrozenConfigDict({**fields, **c.data.options})
    seq_len = getattr(c.model, "seq_len", None)
    made = []
    for split in ("train", "eval"):
        args = sources.DataArgs(options, split, batch_size, c.seed, seq_len=seq_len)
        made.append(sources.SourceBatches(fn, args, c.data.source))
    return made[0], made[1]
