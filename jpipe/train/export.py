"""Trained weights out, pretrained weights in: the model's own parameters, unpacked.

The trainer keeps the parameters packed (`jpipe.Pipeline.pack`): each
rank's arrays of one size and dtype share a bucket, ``{"float32[4096]#3":
[R, 4096]}`` (docs/checkpoints.md), or with a mesh per rank (the per-rank
lowering in ``train.py``) one dict of ``[1, 4096]`` rows per rank. A
checkpoint holds them so. This
module turns them back into what the model's ``init`` made: one pytree per
stage, in the model's own classes (an Equinox-style dataclass, an NNX
state, a Flax dict), each leaf a `jax.Array`:

- `load_params(workdir)` reads a checkpoint written by `jpipe.train.train`
  and returns that list. The model is rebuilt (only its shapes, with
  `jax.eval_shape`: nothing is computed and no device of the run's mesh is
  needed) to know each stage's tree and which bucket row holds each of its
  arrays; the checkpoint's own record says how the run split the model
  (stages, blocks per stage, ranks), and its bucket list must be the one
  this model gives, or the call is refused.
- `save_params(path, params)` writes such a list (or any pytree of arrays)
  to a NumPy ``.npz`` file, one entry per leaf named by its key path
  (``[0].embed.w``, ``[1].blocks[0]['kernel']``).
- ``config.init_from`` (`initial_params`) starts a run from either: a run
  directory (its newest checkpoint) or such a ``.npz`` file, checked leaf by
  leaf against the model's own structure and shapes.

Why ``.npz`` for a saved pytree: it is one file that NumPy alone reads
(``np.load(path)`` lists the leaves by name), it can be written from any
framework's weights by naming the leaves as the model's key paths, and it
carries no Python classes, so loading it runs no code of the file's
author: the tree comes from the model being trained, the arrays from the
file. Dtypes NumPy does not know (bfloat16) are kept as their raw bits and
the dtype's name (``__dtypes__``). It holds the whole model on the host,
which suits what a pytree file is for (a small or medium model moved
between frameworks). A run directory is read onto the host too (the CPU's
memory, never an accelerator), the whole model at once, then packed onto
the run's mesh.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jpipe import models
from jpipe.models import registry
from jpipe.stage.pack import ParamLayout  # the packed layout is a pure function of shapes
from jpipe.train import process_arrays
from jpipe.train.config import ConfigError, TrainConfig

_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax writes it into every complete step
_DTYPES = "__dtypes__"  # the .npz entry naming the dtypes NumPy cannot store


def save_params(path: str | os.PathLike, params) -> str:
    """Writes a pytree of arrays to a ``.npz`` file that ``config.init_from`` reads.

    Args:
      path: the file to write (``.npz`` is added when missing, as NumPy does).
      params: what `load_params` returns (one pytree per stage) or any
        pytree of arrays; each leaf is stored under its key path
        (`jax.tree_util.keystr`).

    Returns:
      The path written.
    """
    path = os.fspath(path)
    if not path.endswith(".npz"):
        path += ".npz"
    arrays, dtypes = {}, {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(key_path)
        array = np.asarray(jax.device_get(leaf))
        if array.dtype.kind == "V" or array.dtype.name not in np.sctypeDict:  # bfloat16 & co
            dtypes[name] = array.dtype.name
            array = array.view(f"u{array.dtype.itemsize}")
        arrays[name] = array
    arrays[_DTYPES] = np.array(json.dumps(dtypes))
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def load_params(workdir: str | os.PathLike, config=None, step: int | None = None) -> list:
    """The model's own parameters from a run directory's checkpoint.

    Args:
      workdir: the run's ``--workdir`` (or its ``checkpoints`` folder).
      config: the run's config (a ConfigDict such as ``train.py`` used, or
        a `TrainConfig`): only ``config.model`` is read, to rebuild the
        model's shapes. None reads it from the checkpoint, which works for
        the registered models (``gpt``, ``llama``); a model from a file
        needs the config (the checkpoint names the file without its folder).
      step: which checkpoint; None for the newest.

    Returns:
      One parameter pytree per stage, as the model's ``init`` makes them (its
      own classes), each leaf a `jax.Array` on the default device.

    Raises:
      ConfigError: no checkpoint, no such step, or a model whose arrays are
        not the checkpoint's (another config).
    """
    host = _checkpoint_params(workdir, config, step)
    return jax.tree.map(jax.device_put, host)


def initial_params(source: str, model: models.StagedModel, config: TrainConfig) -> list:
    """``config.init_from``'s parameters on the host, checked against `model`.

    Args:
      source: a run directory (its newest checkpoint) or a ``.npz`` file
        from `save_params`.
      model: the model being trained, cut into this run's stages.
      config: this run's config (a run directory's model is rebuilt with it).

    Returns:
      One pytree per stage like ``model.init``'s, of NumPy arrays in the
      model's dtypes.

    Raises:
      ConfigError: in one line, naming ``config.init_from`` and the first
        leaf that is missing, extra or of another shape.
    """
    want = jax.eval_shape(model.init, jax.random.key(0))
    if os.path.isdir(source):
        got = _checkpoint_params(source, config, None)
        leaves = {
            jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(got)[0]
        }
    elif os.path.isfile(source):
        leaves = _read_npz(source)
    else:
        raise ConfigError(
            f"config.init_from={source!r}: no such directory or file; give a run directory "
            "(its --workdir) or a .npz file from jpipe.train.save_params"
        )
    with_paths, tree = jax.tree_util.tree_flatten_with_path(want)
    held = len(leaves)
    out = []
    for key_path, shape in with_paths:
        name = jax.tree_util.keystr(key_path)
        if name not in leaves:
            raise ConfigError(
                f"config.init_from={source!r} has no parameter {name} (shape {shape.shape}), "
                f"which the model {config.model_name} has ({held} parameters there, "
                f"{len(with_paths)} here); start from parameters of this model cut into the "
                "same stages"
            )
        array = leaves.pop(name)
        if tuple(array.shape) != tuple(shape.shape):
            raise ConfigError(
                f"config.init_from={source!r}: parameter {name} has shape {tuple(array.shape)}, "
                f"the model {config.model_name} wants {tuple(shape.shape)}"
            )
        out.append(np.asarray(array).astype(shape.dtype, copy=False))
    if leaves:
        raise ConfigError(
            f"config.init_from={source!r} has parameter(s) the model {config.model_name} does "
            f"not: {_some(leaves)}; start from parameters of this model cut into the same stages"
        )
    return jax.tree.unflatten(tree, out)


def _some(leaves: Mapping) -> str:
    names = list(leaves)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _read_npz(path: str) -> dict[str, np.ndarray]:
    """A `save_params` file's leaves by key path, with their own dtypes."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"config.init_from={path!r} is not a .npz file of parameters ({e}); write one with "
            "jpipe.train.save_params"
        ) from None
    dtypes = json.loads(str(arrays.pop(_DTYPES, "{}")))
    for name, dtype in dtypes.items():
        if name in arrays:
            arrays[name] = arrays[name].view(np.dtype(getattr(jax.numpy, dtype, dtype)))
    return arrays


# ---------------------------------------------------------------------------
# Reading a checkpoint.


def _checkpoint_dir(workdir: str) -> str:
    workdir = os.path.abspath(os.fspath(workdir))
    inner = os.path.join(workdir, "checkpoints")
    return inner if os.path.isdir(inner) else workdir


def _checkpoint_params(workdir, config, step: int | None) -> list:
    """The checkpoint's parameters as host pytrees of the model's classes (see `load_params`)."""
    directory = _checkpoint_dir(workdir)
    if not os.path.isdir(directory):
        raise ConfigError(f"{workdir}: no such run directory (give the run's --workdir)")
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        steps = sorted(
            s
            for s in manager.all_steps()
            if os.path.isfile(os.path.join(directory, str(s), _METADATA_FILE))
        )
        if not steps:
            raise ConfigError(
                f"{directory} holds no complete checkpoint; train first (train.py "
                f"--workdir={workdir}) or give the run directory that has one"
            )
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ConfigError(
                f"{directory} has no complete checkpoint of step {step}; it has steps "
                f"{', '.join(map(str, steps))}"
            )
        meta = dict(
            manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        )
        layout = _layout(meta, config, f"the checkpoint of step {step} in {directory}")
        where = os.path.join(directory, str(step))
        saved = _saved_params(manager, step, where, meta)
    finally:
        manager.close()
    return layout.unpack_host(_packed(layout, saved, where))


def _saved_params(manager, step: int, where: str, meta: dict) -> dict[str, np.ndarray]:
    """Every parameter array the step holds, by its place in the state, on the host.

    A run on one mesh saves ``params.<bucket>`` (every rank's rows); a run
    with a mesh per rank saves ``params.<rank>.<bucket>`` (that rank's row).
    In a run of several processes, the arrays one process held whole are in
    the ``local`` item (`jpipe.train.process_arrays`), the others in ``state``,
    there as a flat dict by name.
    """
    found: dict[str, np.ndarray] = {}
    items = meta.get("items") or {"state": True}
    if "local" in items:
        local = os.path.join(where, "local")
        for name in process_arrays.ProcessArraysHandler().metadata(local):
            if name.startswith("params."):
                found[name] = process_arrays.read_on_host(local, name)
    if not items.get("state"):
        return found
    tree = ocp.StandardCheckpointHandler().metadata(epath.Path(where) / "state").tree
    device = jax.devices("cpu")[0]  # host memory: never one accelerator for the whole model

    def target(m):
        return jax.ShapeDtypeStruct(
            tuple(m.shape), m.dtype, sharding=jax.sharding.SingleDeviceSharding(device)
        )

    if "params" in tree:  # the state's own tree: keep its parameters' part
        wanted = {"params": jax.tree.map(target, tree["params"])}
    else:  # several processes' global arrays: a flat dict by name
        wanted = {n: target(m) for n, m in tree.items() if n.startswith("params.")}
    if not jax.tree.leaves(wanted):  # every parameter was in ``local``
        return found
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), wanted)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=wanted, restore_args=restore_args, partial_restore=True
            )
        ),
    ).state
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored):
        found[jax.tree_util.keystr(path, simple=True, separator=".")] = np.asarray(leaf)
    return found


def _packed(layout: ParamLayout, saved: dict[str, np.ndarray], where: str) -> dict:
    """``{bucket: [R, *row]}`` from the saved arrays, of either layout (`_saved_params`)."""
    if all(f"params.{b}" in saved for b in layout.buckets):
        return {b: saved[f"params.{b}"] for b in layout.buckets}
    packed = {
        b: np.zeros((layout.num_ranks,) + tuple(row), dtype)
        for b, (row, dtype) in layout.buckets.items()
    }
    for s, r in enumerate(layout.stage_to_rank):
        for b in layout.stage_buckets(s):
            name = f"params.{r}.{b}"
            if name not in saved:
                raise ConfigError(
                    f"{where} holds no array {name} (stage {s}'s parameters, on rank {r}): "
                    "the checkpoint is incomplete or was written by another version of jpipe"
                )
            packed[b][r] = saved[name][0]
    return packed


def _layout(meta: dict, config, where: str) -> ParamLayout:
    """The packed layout of the checkpoint `meta` describes, from the model's shapes."""
    record = meta.get("layout", {})
    try:
        stage_to_rank = tuple(record["stage_to_rank"])
        layers = ",".join(str(n) for n in record["layers_per_stage"])
        num_ranks = int(record["mesh.pipe"])
        buckets = meta["buckets"]
    except (KeyError, TypeError):
        raise ConfigError(
            f"{where} has no parameter layout record (written by another version of jpipe?)"
        ) from None
    name, model_config = _model_of(record, config, where, meta.get("model_name"))
    mesh = meta.get("mesh", {})
    tensor = max(
        [int(mesh.get("tensor", 1) or 1)]
        + [int(t) for t in str(mesh.get("tensor_per_rank", "") or "").split(",") if t.strip()]
    )
    fsdp = int(mesh.get("fsdp", 1) or 1)
    try:
        model = registry.build_model(
            name,
            registry.BuildArgs(
                model_config, len(stage_to_rank), layers, "tensor" if tensor > 1 else None
            ),
        )
    except ValueError as e:
        raise ConfigError(f"{where}: cannot rebuild the model {name} ({e})") from None
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    specs = model.specs(shapes) if model.specs is not None else None
    layout = ParamLayout.of(
        shapes,
        stage_to_rank,
        num_ranks,
        specs=specs,
        axis_sizes={"fsdp": fsdp, "tensor": tensor},
        fsdp_axis="fsdp",
    )
    made = {b: [list(shape), dtype] for b, (shape, dtype) in sorted(layout.buckets.items())}
    if made != buckets:
        first = next(
            (b for b in sorted(set(made) | set(buckets)) if made.get(b) != buckets.get(b)), None
        )
        raise ConfigError(
            f"{where} holds other arrays than the model {name} makes with this config (bucket "
            f"{first}: {buckets.get(first)} in the checkpoint, {made.get(first)} from the "
            "model); pass the run's own config"
        )
    return layout


def _model_of(record: dict, config, where: str, full_name: str | None) -> tuple[str, object]:
    """The model's name and config, from `config` or else from the checkpoint's record.

    `full_name` is ``config.model.name`` as the run gave it, where the
    checkpoint records it (``meta["model_name"]``): a builder's file by its
    whole path, used when that file is still there.
    """
    if config is not None:
        c = config if isinstance(config, TrainConfig) else TrainConfig.from_config(config)
        return c.model_name, c.model
    fields = dict(record.get("model", {}))
    name = fields.pop("name", "gpt")
    if registry.is_file_spec(name) and isinstance(full_name, str):
        if registry.is_file_spec(full_name) and os.path.isfile(full_name.rpartition(":")[0]):
            return full_name, ml_collections.FrozenConfigDict(fields)
    if registry.is_file_spec(name):
        raise ConfigError(
            f"{where} was written by the model builder {name}, which it names without its "
            "folder; pass the run's config: load_params(workdir, config)"
        )
    _, kind = registry.get_model(name)
    if kind is None:
        return name, ml_collections.FrozenConfigDict(fields)
    return name, kind(**fields)
